"""A run's report, drawn from its metrics.jsonl: the curves as PNGs, summary.json, and the
summary's console lines.

Owns what `dflash-train plot RUN_DIR` writes and what `train` writes when it ends: an overview
figure (`plots/run.png` by default) and one PNG per panel beside it (`run-loss.png`, ...) of
the loss (training, and validation when measured), the learning rate, tau (walked and served when the records have them, the training
estimate tau~ always), tokens/s and each stage's share of the logged step time; and
`summary.json` (steps, training time, throughput, final figures, best walked and served tau,
the exported drafter and which step's weights it holds). Reads the run folder only, so it works on any run, finished or not.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from dflash_train.core.errors import MissingPath
from dflash_train.train.metrics import format_duration

PANELS = ("loss", "lr", "tau", "throughput", "stages")
PANEL_INCHES = (6.4, 4.0)
COLUMNS = 2
DPI = 100
"""A panel PNG is 640 x 400 pixels; the overview (3 rows of 2 panels) 1280 x 1200."""


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl in order (a last line cut by a kill is left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise MissingPath(f"{path}: no such file (is {run_dir} a run folder?)")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a finite `key`."""
    points = [(r["step"], r[key]) for r in records
              if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def draw_panel(ax, name: str, records: list[dict]) -> None:
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if name == "loss":
        ax.plot(*series(records, "loss"), color="#4c72b0", label="training (objective.labels / weighting)")
        validation = series(records, "val_loss")
        if validation[0]:  # always the paper's decayed CE on the data's tokens, whatever the objective
            ax.plot(*validation, color="#c44e52", marker="o", label="validation: decayed CE on data tokens, every anchor")
            ax.legend(loc="best", fontsize="small")
        ax.set_title("loss")
    elif name == "lr":
        ax.plot(*series(records, "lr"), color="#55a868")
        ax.set_title("learning rate")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    elif name == "tau":
        walked, served = series(records, "walked_tau"), series(records, "eval_tau")
        if walked[0]:
            ax.plot(*walked, color="#c44e52", label="walked tau")
        if served[0]:
            ax.plot(*served, color="#4c72b0", marker="o", label="served tau (eval)")
        ax.plot(*series(records, "tau_estimate"), color="#8c8c8c", linestyle="--", linewidth=1,
                label="tau~ (training estimate)")
        ax.set_title("tau (mean tokens committed per cycle)")
        ax.legend(loc="best", fontsize="small")
    elif name == "throughput":
        ax.plot(*series(records, "tokens_per_s"), color="#8172b2")
        ax.set_title("throughput (tokens/s)")
    elif name == "stages":
        timed = [r for r in records if r.get("stage_s")]
        stages = list(dict.fromkeys(k for r in timed for k in r["stage_s"]))  # in step order
        shares = [[r["stage_s"].get(k, 0.0) / (sum(r["stage_s"].values()) or 1.0) for r in timed] for k in stages]
        if timed:
            ax.stackplot([r["step"] for r in timed], shares, labels=stages)
            ax.legend(loc="upper left", fontsize="x-small", ncol=2)
        ax.set_ylim(0, 1)
        ax.set_title("share of the logged step time by stage")


def figure(rows: int, cols: int):
    # A Figure of its own (no pyplot): no global backend state, nothing left open. matplotlib is
    # heavy to import and only a run's report draws.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows), dpi=DPI)
    return fig, fig.subplots(rows, cols, squeeze=False)


def draw(records: list[dict], out: Path) -> list[Path]:
    """The overview at `out` and one PNG per panel beside it (`{stem}-{panel}.png`); the paths
    written, the overview first."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = math.ceil(len(PANELS) / COLUMNS)
    overview, axes = figure(rows, COLUMNS)
    flat = [ax for row in axes for ax in row]
    for ax, name in zip(flat, PANELS):
        draw_panel(ax, name, records)
    for ax in flat[len(PANELS):]:
        ax.set_visible(False)
    overview.tight_layout()
    overview.savefig(out)
    written = [out]
    for name in PANELS:
        fig, axes = figure(1, 1)
        draw_panel(axes[0][0], name, records)
        fig.tight_layout()
        path = out.with_name(f"{out.stem}-{name}.png")
        fig.savefig(path)
        written.append(path)
    return written


def best(records: list[dict], key: str) -> dict | None:
    steps, values = series(records, key)
    if not values:
        return None
    i = max(range(len(values)), key=values.__getitem__)
    return {"step": steps[i], "value": values[i]}


def exported_step(run_dir: Path, records: list[dict]) -> tuple[int | None, str]:
    """Whose weights RUN_DIR/drafter holds, read from the run's config.yaml and records: with
    checkpoint.keep_best, the step of the best walked tau (when one was measured); else the
    last step."""
    config = Path(run_dir) / "config.yaml"
    settings = yaml.safe_load(config.read_text()) if config.is_file() else None
    keep_best = bool(((settings or {}).get("checkpoint") or {}).get("keep_best"))
    walked = best(records, "walked_tau")
    if keep_best and walked is not None:
        return walked["step"], "best walked tau"
    return (records[-1]["step"] if records else None), "last step"


def summarize(records: list[dict], drafter: Path | None, drafter_step: tuple[int | None, str] = (None, "")) -> dict:
    """The run in figures. Training time is the sum of the logged intervals (saves included,
    in-training evaluations not); tokens and samples are summed the same way. `drafter_step`:
    (step, why) of the exported weights (`exported_step`)."""
    train_s = sum(r.get("interval_s", 0.0) for r in records)
    tokens = sum(r.get("tokens_per_s", 0.0) * r.get("interval_s", 0.0) for r in records)
    samples = sum(r.get("samples_per_s", 0.0) * r.get("interval_s", 0.0) for r in records)
    last = records[-1] if records else {}
    memory = [r["peak_memory_gib"] for r in records if "peak_memory_gib" in r]
    return {
        "steps": last.get("step", 0),
        "train_time_s": round(train_s, 3),
        "tokens": round(tokens),
        "samples": round(samples),
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "samples_per_s": samples / train_s if train_s > 0 else None,
        "final": {k: last.get(k) for k in ("step", "epoch", "loss", "acc", "tau_estimate", "lr")},
        "best_walked_tau": best(records, "walked_tau"),
        "best_served_tau": best(records, "eval_tau"),
        "skipped_steps": last.get("skipped_total", 0),
        "skipped_batches": sum(r.get("skipped_batches", 0) for r in records),
        "peak_memory_gib": max(memory) if memory else None,
        "drafter": str(drafter) if drafter is not None else None,
        "drafter_step": drafter_step[0] if drafter is not None else None,
        "drafter_choice": drafter_step[1] if drafter is not None else None,
    }


def summary_lines(summary: dict) -> list[str]:
    """The last console lines of a run: steps and time, tau, the drafter, where the report is."""
    rate = summary["tokens_per_s"]
    lines = [f"run: {summary['steps']} steps, training time {format_duration(summary['train_time_s'])}"
             + (f" ({rate:.0f} tokens/s, {summary['samples_per_s']:.2f} samples/s)" if rate else "")
             + (f", final loss {summary['final']['loss']:.4f}" if summary["final"]["loss"] is not None else "")]
    taus = [f"best {label} tau {b['value']:.2f} at step {b['step']}"
            for label, b in (("walked", summary["best_walked_tau"]), ("served", summary["best_served_tau"])) if b]
    if not taus and summary["final"]["tau_estimate"] is not None:
        taus = [f"tau~ {summary['final']['tau_estimate']:.2f} at the end (training estimate, a diagnostic; "
                f"data.validation with eval.every measures the walked tau)"]
    lines += taus
    if summary["drafter"]:
        which = (f" (step {summary['drafter_step']}: the {summary['drafter_choice']})"
                 if summary.get("drafter_step") is not None else "")
        lines.append(f"drafter exported to {summary['drafter']}{which}")
    else:
        lines.append("drafter: not exported")
    if summary.get("plots"):
        lines.append(f"plots: {summary['plots'][0]} (+ {len(summary['plots']) - 1} panels); "
                     f"summary: {summary['summary']}")
    return lines


def write_report(run_dir: Path, out: Path | None = None, drafter: Path | None = None) -> dict:
    """Plots (overview at `out`, default RUN_DIR/plots/run.png) and RUN_DIR/summary.json of a
    run; `drafter` defaults to RUN_DIR/drafter when that folder exists. Returns the summary."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if drafter is None and (run_dir / "drafter" / "config.json").is_file():
        drafter = run_dir / "drafter"
    summary = summarize(records, drafter, exported_step(run_dir, records))
    summary["plots"] = [str(p) for p in draw(records, Path(out) if out else run_dir / "plots" / "run.png")]
    summary["summary"] = str(run_dir / "summary.json")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def report_run(run_dir: Path, drafter: Path, log=print) -> None:
    """End of `train`: the report of the run and its summary as the last console lines. A
    report that fails to draw costs the run nothing (the drafter is exported): it is said, and
    `dflash-train plot` draws it again."""
    try:
        summary = write_report(run_dir, drafter=drafter)
    except Exception as err:  # noqa: BLE001
        log(f"drafter exported to {drafter}")
        log(f"plots and summary.json not written ({type(err).__name__}: {err}); try `dflash-train plot {run_dir}`")
        return
    for line in summary_lines(summary):
        log(line)
