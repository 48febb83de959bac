"""Watching a run: the console off a terminal (fixed lines, no bar redraws), the W&B run read
back from its offline folder (every metrics.jsonl field, config, eval tables; a resumed run
continues the same W&B run), and the plots and summary of a finished run."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env
from dflash_train.app import cli
from dflash_train.core.config import load_config
from dflash_train.train import metrics, plot

TINY = ROOT / "configs" / "tiny.yaml"


def train_cmd(out: Path, prompts: Path, max_steps: int) -> list[str]:
    """The tiny config with the progress bar asked for, W&B on, and an evaluation every 2 steps."""
    return [sys.executable, "-m", "dflash_train", "train", "--config", str(TINY), "--output-dir", str(out),
            f"train.max_steps={max_steps}", "log.progress=true", "log.wandb=true", "checkpoint.every=2",
            "eval.every=2", f"eval.prompts={prompts}", "eval.max_new_tokens=8"]


def offline_env(home: Path) -> dict[str, str]:
    # W&B's caches and settings in the test's own folder: nothing read from or written to ~.
    return subprocess_env(WANDB_MODE="offline", WANDB_CONFIG_DIR=str(home / "config"),
                          WANDB_CACHE_DIR=str(home / "cache"), WANDB_DATA_DIR=str(home / "data"))


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory):
    """4 steps of the tiny config through the CLI with stdout and stderr a pipe (not a
    terminal), then the same command to 6 steps (a resume from step 4). Returns the run folder
    and (stdout, stderr) of both."""
    root = tmp_path_factory.mktemp("watched")
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["Count to five.", "Again."]}) + "\n"
                       + json.dumps({"turns": ["Name a colour."]}) + "\n")
    out, env = root / "run", offline_env(root / "wandb-home")
    outputs = []
    for steps in (4, 6):
        done = subprocess.run(train_cmd(out, prompts, steps), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        outputs.append((done.stdout, done.stderr))
    return out, outputs


def offline_runs(out: Path) -> list[Path]:
    return sorted((out / "wandb").glob("offline-run-*"))


def wandb_records(run_folder: Path) -> list[dict]:
    """Every record of an offline W&B run, as the pinned wandb's own reader prints them."""
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_folder)],
                          capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def history(records: list[dict]) -> dict[int, dict]:
    """The history rows by training step."""
    return {r["history"]["item"]["_step"]: r["history"]["item"] for r in records if r["type"] == "history"}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_log_off_a_terminal_has_fixed_lines_and_no_carriage_returns(watched_run):
    _, outputs = watched_run
    for (stdout, stderr), steps in zip(outputs, ((1, 2, 3, 4), (5, 6))):
        assert "\r" not in stdout and "\r" not in stderr
        lines = [l for l in stdout.splitlines() if re.match(r"step +\d+/\d+ \|", l)]
        assert [int(re.match(r"step +(\d+)", l)[1]) for l in lines] == list(steps)
        for line in lines:
            assert re.search(r"\| loss [\d.]+ \|.*\| \d+ tok/s \| [\d.]+ samples/s \| eta \d+:\d\d:\d\d \|", line), line
        assert ["eval tau" in l for l in lines] == [s % 2 == 0 for s in steps]
    first_lines = outputs[0][0].splitlines()
    assert any(l.startswith("best served tau ") for l in first_lines)
    assert first_lines[-2].startswith("drafter exported to ") and first_lines[-1].startswith("plots: ")


def test_console_line_leads_with_walked_tau_then_served_tau():
    record = {"step": 7, "epoch": 0, "loss": 1.5, "acc": 0.5, "tau_estimate": 3.0, "lr": 1e-3, "grad_norm": 0.5,
              "tokens_per_s": 1000.0, "samples_per_s": 2.0}
    line = metrics.console_line({**record, "walked_tau": 2.5, "eval_tau": 2.25}, 100, 3725.0)
    assert line.startswith("step   7/100 | loss 1.5000 | walked tau 2.50 | eval tau 2.25 | tau~ 3.00 | 1000 tok/s"
                           " | 2.00 samples/s | eta 1:02:05 |")
    assert "walked" not in metrics.console_line(record, 100, None) and "eta ?" in metrics.console_line(record, 100, None)


def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch):
    log_cfg = load_config(str(TINY), ["log.progress=true"]).log
    sink = metrics.MetricsSink(tmp_path, log_cfg, {}, total_steps=10, start_step=0)
    assert sink.bar is None  # pytest's captured streams are not a terminal
    sink.close()
    monkeypatch.setattr(metrics, "console_is_terminal", lambda: True)
    sink = metrics.MetricsSink(tmp_path, log_cfg, {}, total_steps=10, start_step=0)
    assert sink.bar is not None and sink.bar.total == 10
    sink.close()


def test_wandb_scalars_flatten_every_field():
    record = {"step": 3, "loss": 2.0, "acc_per_position": [0.5, None], "stage_s": {"backward": 0.2},
              "wait_s": {"drafter_recv": [0.1, 0.3], "target_send": [0.0]}, "avg_seq_len": 100.0,
              "padding_efficiency": 0.9, "eval_acceptance_lengths": [[[1, 2]]], "eval_histogram": [1, 1]}
    assert metrics.wandb_scalars(record) == {
        "step": 3, "loss": 2.0, "acc_per_position/0": 0.5, "stage_s/backward": 0.2, "wait_s/drafter_recv/0": 0.1,
        "wait_s/drafter_recv/1": 0.3, "wait_s/target_send/0": 0.0, "batch/avg_seq_len": 100.0,
        "batch/padding_efficiency": 0.9, "eval_histogram/0": 1, "eval_histogram/1": 1}


def test_wandb_offline_run_holds_every_field_the_config_and_the_eval_tables(watched_run):
    out, _ = watched_run
    first = offline_runs(out)[0]
    records = wandb_records(first)
    rows = history(records)
    logged = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()][:4]
    assert sorted(rows) == [1, 2, 3, 4]
    for record in logged:
        row = rows[record["step"]]
        for key, value in metrics.wandb_scalars(record).items():
            assert row[key] == pytest.approx(value), key
        assert any(k.startswith("histogram/run_length") for k in row)
        assert {"stage_s/backward", "batch/avg_seq_len", "tau_estimate", "lr"} <= row.keys()
        evaluated = "eval_tau" in record
        assert evaluated == (record["step"] % 2 == 0)
        assert any(k.startswith("eval/per_prompt") for k in row) == evaluated
        assert any(k.startswith("histogram/eval_acceptance") for k in row) == evaluated
    tables = list((first / "files" / "media" / "table" / "eval").glob("per_prompt_*.table.json"))
    assert len(tables) == 2
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["prompt", "turn", "cycles", "tau", "acceptance_lengths"]
    assert [(r[0], r[1]) for r in table["data"]] == [(0, 0), (0, 1), (1, 0)]
    run = next(r["run"] for r in records if r["type"] == "run")
    config = run["config"]["update"]
    assert config["train"]["max_steps"] == 4 and config["drafter"]["block_size"] == 8
    assert config["output_dir"] == str(out) and run["run_id"] == (out / "wandb_id").read_text().strip()


def test_resumed_run_continues_the_same_wandb_run(watched_run):
    out, outputs = watched_run
    assert "resumed at step 4" in outputs[1][0]
    runs = offline_runs(out)
    assert len(runs) == 2
    run_id = (out / "wandb_id").read_text().strip()
    assert all(r.name.endswith(f"-{run_id}") for r in runs)
    records = wandb_records(runs[1])
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["run_id"] == run_id and run["resume"] is True
    assert run["config"]["update"]["train"]["max_steps"] == 6
    assert sorted(history(records)) == [5, 6]


def test_plots_and_summary_of_a_run(watched_run, tmp_path, capsys):
    out, _ = watched_run
    panels = [out / "plots" / f"run-{name}.png" for name in plot.PANELS]
    assert png_size(out / "plots" / "run.png") == (1280, 1200)
    for path in panels:
        assert png_size(path) == (640, 400) and path.stat().st_size > 5000, path
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["drafter"] == str(out / "drafter")
    assert summary["best_served_tau"]["step"] in (2, 4, 6) and summary["best_walked_tau"] is None
    assert summary["train_time_s"] > 0 and summary["tokens"] > 0
    assert summary["plots"][0] == str(out / "plots" / "run.png")
    # The command draws the same run elsewhere.
    assert cli.main(["plot", str(out), "--out", str(tmp_path / "again.png")]) == 0
    said = capsys.readouterr().out
    assert said.startswith("run: 6 steps, training time ") and f"drafter exported to {out / 'drafter'}" in said
    assert png_size(tmp_path / "again.png") == (1280, 1200)
    assert png_size(tmp_path / "again-stages.png") == (640, 400)
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl: no such file" in capsys.readouterr().err


def test_plots_show_walked_tau_when_the_records_have_it(tmp_path):
    rows = [{"step": s, "loss": 3.0 / s, "lr": 1e-3, "tau_estimate": 2.0, "walked_tau": 1.0 + s / 10,
             "tokens_per_s": 100.0, "interval_s": 1.0, "stage_s": {"target": 0.5, "drafter_forward": 0.5}}
            for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    summary = plot.write_report(tmp_path)
    assert summary["steps"] == 3 and summary["best_walked_tau"] == {"step": 3, "value": 1.3}
    assert summary["drafter"] is None and summary["tokens"] == 300
    lines = plot.summary_lines(summary)
    assert "best walked tau 1.30 at step 3" in lines and "drafter: not exported" in lines
    assert png_size(tmp_path / "plots" / "run-tau.png") == (640, 400)


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
    import importlib.util

    from dflash_train.core.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb is true but the wandb package is not installed"):
        load_config(str(TINY), ["log.wandb=true"])
