"""Training metrics: device-side accumulation, stage timers, and the sinks they go to.

Owns what a log step shows and where it goes: `OUTPUT/metrics.jsonl` (always, one JSON object
per log step), TensorBoard, Weights & Biases (`log.wandb`: every field, nested ones flattened
with `/`, the resolved config and the evaluation tables; WANDB_MODE=offline works; a resumed
run continues the same W&B run), one console line per log step, and on a terminal a progress
bar with ETA (off a terminal, no bar redraws: the console line carries the ETA). Values
accumulate on the device between log steps; `Accumulator.flush` is the one host sync of an
interval. The curves and the summary of a finished run are plot.py's.
"""

from __future__ import annotations

import json
import math
import secrets
import string
import sys
import time
from pathlib import Path

import datasets
import torch
from tqdm import tqdm
from transformers.utils import logging as transformers_logging

from dflash_train.core.config import ConfigError
from dflash_train.core.loss import BlockLossOutput


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: the peak of `max_memory_allocated` (since the last reset); CPU: the process's peak
    resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource  # POSIX only: imported where the CPU figure is read

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Accumulator:
    """Sums over a log interval, kept on the device."""

    FIELDS = ("loss_sum", "weight_sum", "run_sum", "num_blocks", "tokens", "padded_tokens",
              "samples", "sum_seq_len", "sum_max_seq_len", "micro_batches", "grad_norm_sum",
              "steps", "skipped", "failed_batches")
    PER_STEP = ("grad_norm_sum", "steps", "skipped")

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.reset()

    def reset(self) -> None:
        zeros = lambda n=(): torch.zeros(n, dtype=torch.float64, device=self.device)  # noqa: E731
        self.sums = {name: zeros() for name in self.FIELDS}
        self.correct_K = zeros(self.block_size - 1)
        self.count_K = zeros(self.block_size - 1)
        self.run_hist = zeros(self.block_size)
        self.started = time.perf_counter()

    def add_loss(self, out: BlockLossOutput) -> None:
        s = self.sums
        s["loss_sum"] += out.loss_sum.detach()
        s["weight_sum"] += out.weight_sum
        s["run_sum"] += out.run_sum
        s["num_blocks"] += out.num_blocks
        self.correct_K += out.correct_K
        self.count_K += out.count_K
        self.run_hist += out.run_hist

    def add_batch(self, tokens: int, padded_tokens: int, rows: int, sum_seq_len: int, max_seq_len: int) -> None:
        # Host integers: adding them to device tensors queues a tiny copy, no sync.
        s = self.sums
        s["tokens"] += tokens
        s["padded_tokens"] += padded_tokens
        s["samples"] += rows
        s["sum_seq_len"] += sum_seq_len
        s["sum_max_seq_len"] += max_seq_len
        s["micro_batches"] += 1

    def add_failed_batch(self) -> None:
        self.sums["failed_batches"] += 1

    def add_step(self, grad_norm: torch.Tensor, skipped: bool | torch.Tensor) -> None:
        """`skipped`: a host bool, or the device's flag (counted without reading it)."""
        self.sums["steps"] += 1
        if torch.is_tensor(skipped):
            self.sums["skipped"] += skipped.to(torch.float64)
            self.sums["grad_norm_sum"] += torch.where(skipped, 0.0, grad_norm.detach().double())
        elif skipped:
            self.sums["skipped"] += 1
        else:
            self.sums["grad_norm_sum"] += grad_norm.detach().double()

    def state_dict(self) -> dict:
        """Host copy (checkpoint time): a resumed run logs the same interval means."""
        return {
            "sums": {k: float(v) for k, v in self.sums.items()},
            "correct_K": self.correct_K.tolist(),
            "count_K": self.count_K.tolist(),
            "run_hist": self.run_hist.tolist(),
        }

    def load_state_dict(self, state: dict) -> None:
        for k, v in state["sums"].items():
            self.sums[k] = torch.tensor(v, dtype=torch.float64, device=self.device)
        for name in ("correct_K", "count_K", "run_hist"):
            setattr(self, name, torch.tensor(state[name], dtype=torch.float64, device=self.device))

    def flush(self) -> dict:
        """Interval means as Python numbers (the one host sync of a log interval), then reset."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        packed = torch.cat([torch.stack([self.sums[k] for k in self.FIELDS]), self.correct_K, self.count_K, self.run_hist])
        values = packed.tolist()  # host sync: log step only
        s = dict(zip(self.FIELDS, values[: len(self.FIELDS)]))
        K = self.block_size - 1
        correct = values[len(self.FIELDS) : len(self.FIELDS) + K]
        count = values[len(self.FIELDS) + K : len(self.FIELDS) + 2 * K]
        hist = values[len(self.FIELDS) + 2 * K :]
        applied = max(s["steps"] - s["skipped"], 1)
        blocks = max(s["num_blocks"], 1)
        mb = max(s["micro_batches"], 1)
        record = {
            "loss": s["loss_sum"] / s["weight_sum"] if s["weight_sum"] > 0 else float("nan"),
            "grad_norm": s["grad_norm_sum"] / applied,
            "acc": sum(correct) / max(sum(count), 1),
            "acc_per_position": [c / n if n else None for c, n in zip(correct, count)],
            "accepted_run_mean": s["run_sum"] / blocks,
            "tau_estimate": 1.0 + s["run_sum"] / blocks,
            "run_histogram": [int(h) for h in hist],
            "tokens_per_s": s["tokens"] / elapsed,
            "samples_per_s": s["samples"] / elapsed,
            "avg_seq_len": s["sum_seq_len"] / max(s["samples"], 1),
            "avg_max_seq_len": s["sum_max_seq_len"] / mb,
            "avg_batch_size": s["samples"] / mb,
            "padding_efficiency": s["tokens"] / max(s["padded_tokens"], 1),
            "skipped_steps": int(s["skipped"]),
            "skipped_batches": int(s["failed_batches"]),
            "interval_s": elapsed,
        }
        self.reset()
        return record


    def all_reduce(self, reduce_sum) -> None:
        """Sum the data sums over ranks in place (`reduce_sum` all-reduces one tensor); the per-
        step fields (steps, skips, grad norm) are the same on every rank and stay as they are."""
        names = [k for k in self.FIELDS if k not in self.PER_STEP]
        packed = torch.cat([torch.stack([self.sums[k] for k in names]), self.correct_K, self.count_K, self.run_hist])
        reduce_sum(packed)
        for i, k in enumerate(names):
            self.sums[k] = packed[i].clone()
        K, n = self.block_size - 1, len(names)
        self.correct_K, self.count_K = packed[n : n + K].clone(), packed[n + K : n + 2 * K].clone()
        self.run_hist = packed[n + 2 * K :].clone()


class StageTimer:
    """Wall time per stage. On CUDA, events are recorded without syncing and read at log
    time; on CPU, perf_counter deltas."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, object, object]] = []
        self.totals: dict[str, float] = {}
        self._last = None
        self._name = None

    def mark(self, name: str | None) -> None:
        """End the running stage (if any) and start `name` (None: just end)."""
        now = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
        if self.cuda:
            now.record()
        if self._name is not None:
            self.pending.append((self._name, self._last, now))
        self._name, self._last = name, now

    def flush(self) -> dict[str, float]:
        if self.cuda and self.pending:
            self.pending[-1][2].synchronize()  # log step only
        for name, start, end in self.pending:
            dt = start.elapsed_time(end) / 1000.0 if self.cuda else end - start
            self.totals[name] = self.totals.get(name, 0.0) + dt
        self.pending.clear()
        out, self.totals = {k: round(v, 4) for k, v in self.totals.items()}, {}
        return out


def console_is_terminal() -> bool:
    """Whether both console streams are a terminal: progress bars redraw with carriage returns,
    which a log file (`make train > train.log`, a batch scheduler's log) must not hold."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def quiet_progress_bars() -> None:
    """Off a terminal, turn off the progress bars of the libraries a run loads through
    (datasets' caching and saving, transformers' weight loading; every other tqdm bar is off
    by TQDM_DISABLE, dflash_train.app): the log keeps its fixed lines only."""
    if console_is_terminal():
        return

    datasets.disable_progress_bars()
    transformers_logging.disable_progress_bar()


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def console_line(record: dict, total_steps: int, eta_s: float | None) -> str:
    """The fixed console line of a log step: step, loss, tau (walked tau first when the record
    has it, then the served eval tau of an evaluation step, then the training estimate tau~),
    throughput and ETA, then the rest."""
    width = len(str(total_steps))
    parts = [f"step {record['step']:>{width}}/{total_steps}", f"loss {record['loss']:.4f}"]
    if record.get("walked_tau") is not None:
        parts.append(f"walked tau {record['walked_tau']:.2f}")
    if record.get("val_loss") is not None:
        parts.append(f"val loss {record['val_loss']:.4f}")
    if record.get("eval_tau") is not None:
        parts.append(f"eval tau {record['eval_tau']:.2f}")
    parts += [f"tau~ {record['tau_estimate']:.2f}", f"{record['tokens_per_s']:.0f} tok/s",
              f"{record['samples_per_s']:.2f} samples/s", f"eta {format_duration(eta_s) if eta_s is not None else '?'}",
              f"acc {record['acc']:.3f}", f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.2f}",
              f"ep {record['epoch']}"]
    if record.get("skipped_steps"):
        parts.append(f"skipped {record['skipped_steps']}")
    if record.get("skipped_batches"):
        parts.append(f"failed batches {record['skipped_batches']}")
    return " | ".join(parts)


def walked_by_file_line(record: dict) -> str:
    """The walked tau of each data file the validation split holds (an evaluation step's second
    line, when there are several): which kind of text a drafter serves well or badly."""
    parts = [f"{name} {w['tau']:.2f} ({w['samples']} samples)" for name, w in record["walked_by_file"].items()]
    return f"step {record['step']}: walked tau by data file: " + ", ".join(parts)


# Batch statistics: W&B groups them under batch/.
BATCH_FIELDS = ("avg_seq_len", "avg_max_seq_len", "avg_batch_size", "padding_efficiency")
# Per-prompt detail that goes to W&B as a table, not as scalars.
TABLE_FIELDS = ("eval_acceptance_lengths",)


def flatten(value, key: str = ""):
    """(key, number) pairs of a record's value: nested dicts and lists give `key/name` and
    `key/index` (`stage_s/backward`, `wait_s/drafter_recv/0`); None and text are left out."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from flatten(v, f"{key}/{k}" if key else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from flatten(v, f"{key}/{i}")
    elif isinstance(value, bool):
        yield key, int(value)
    elif isinstance(value, (int, float)):
        yield key, value


def wandb_scalars(record: dict) -> dict[str, float]:
    """Every metrics.jsonl field as W&B scalars, flattened; the batch statistics under batch/."""
    out = {}
    for k, v in record.items():
        if k not in TABLE_FIELDS:
            out.update(flatten(v, f"batch/{k}" if k in BATCH_FIELDS else k))
    return out


class WandbRun:
    """The W&B run of a run folder. Its id is kept in OUTPUT/wandb_id, so a resumed run (the
    same command again) continues the same W&B run; logged at the training step."""

    ID_FILE = "wandb_id"

    def __init__(self, output_dir: Path, project: str, config_dict: dict) -> None:
        # wandb is the optional `wandb` extra (installed: the config check says so).
        import wandb

        self.wandb = wandb
        id_path = Path(output_dir) / self.ID_FILE
        if id_path.exists():
            run_id = id_path.read_text().strip()
        else:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            id_path.write_text(run_id + "\n")
        try:
            self.run = wandb.init(project=project, dir=str(output_dir), id=run_id, resume="allow",
                                  name=Path(output_dir).name, config=config_dict, allow_val_change=True)
        except wandb.errors.UsageError as err:  # no login: said as a config problem, not a traceback

            raise ConfigError([f"log.wandb: {err} (or set WANDB_MODE=offline to write {output_dir}/wandb "
                               f"only, and `wandb sync` it later)"]) from err

    def log(self, record: dict) -> None:
        payload: dict = wandb_scalars(record)
        if record.get("run_histogram"):
            payload["histogram/run_length"] = self.histogram(record["run_histogram"], first=0)
        if record.get("eval_histogram"):
            payload["histogram/eval_acceptance"] = self.histogram(record["eval_histogram"], first=1)
        if record.get("walked_histogram"):
            payload["histogram/walked_acceptance"] = self.histogram(record["walked_histogram"], first=1)
        if record.get("eval_acceptance_lengths") is not None:
            payload["eval/per_prompt"] = self.acceptance_table(record["eval_acceptance_lengths"])
        self.run.log(payload, step=record["step"])

    def histogram(self, counts: list[int], first: int):
        """Counts of the integer values first, first + 1, ...: one bin centred on each."""
        edges = [first - 0.5 + i for i in range(len(counts) + 1)]
        return self.wandb.Histogram(np_histogram=(counts, edges))

    def acceptance_table(self, per_prompt: list[list[list[int]]]):
        """One row per prompt and turn: its cycles, tau (mean acceptance length) and lengths."""
        table = self.wandb.Table(columns=["prompt", "turn", "cycles", "tau", "acceptance_lengths"])
        for p, turns in enumerate(per_prompt):
            for t, lengths in enumerate(turns):
                tau = sum(lengths) / len(lengths) if lengths else None
                table.add_data(p, t, len(lengths), tau, " ".join(map(str, lengths)))
        return table

    def close(self) -> None:
        self.run.finish()


class NullSink:
    """What ranks other than the logging one get: every call does nothing."""

    def progress(self, n: int = 1) -> None: ...
    def end_at(self, step: int) -> None: ...
    def log(self, record: dict) -> None: ...
    def event(self, text: str) -> None: ...
    def close(self) -> None: ...


class MetricsSink:
    """JSONL + TensorBoard + W&B + console line (+ progress bar on a terminal), for the logging
    rank."""

    def __init__(self, output_dir: Path, log_cfg, config_dict: dict, total_steps: int, start_step: int) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self._truncate_after(start_step)
        self.file = open(self.path, "a")
        self.total_steps, self.start_step, self.started = total_steps, start_step, time.perf_counter()
        self.tb = None
        if log_cfg.tensorboard:
            # TensorBoard's writer pulls in the tensorboard package: only runs that log to it pay.
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=start_step + 1)
        self.wandb = WandbRun(output_dir, log_cfg.wandb_project, config_dict) if log_cfg.wandb else None
        self.bar = None
        if log_cfg.progress and console_is_terminal():
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, leave=True)

    def _truncate_after(self, step: int) -> None:
        """Drop lines logged after the checkpoint we resume from: they will be logged again."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
        self.path.write_text("".join(k + "\n" for k in kept))

    def progress(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def end_at(self, step: int) -> None:
        """The run's last step is now `step` (a schedule fitted to train.max_time_s): the console
        line, the ETA and the bar count to it."""
        self.total_steps = step
        if self.bar is not None:
            self.bar.total = step
            self.bar.refresh()

    def _describe(self, record: dict) -> None:
        """The bar leads with the last walked tau (else the training estimate tau~)."""
        if record.get("walked_tau") is not None:
            self.bar.set_description_str(f"walked tau {record['walked_tau']:.2f}")
        elif not (self.bar.desc or "").startswith("walked"):
            self.bar.set_description_str(f"tau~ {record['tau_estimate']:.2f}")

    def eta_s(self, step: int) -> float | None:
        """Seconds to the last step at this invocation's pace so far (evaluations and saves
        included); None before the first step."""
        done = step - self.start_step
        if done <= 0:
            return None
        return (time.perf_counter() - self.started) / done * max(self.total_steps - step, 0)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(f"train/{k}", v, step)
            for k, v in record.get("stage_s", {}).items():
                self.tb.add_scalar(f"stage_s/{k}", v, step)
            # The tau group side by side, the walked (validation) one first.
            for tag, key in (("tau/1_walked", "walked_tau"), ("tau/2_served", "eval_tau"),
                             ("tau/3_estimate", "tau_estimate")):
                if isinstance(record.get(key), (int, float)) and math.isfinite(record[key]):
                    self.tb.add_scalar(tag, record[key], step)
            for name, walked in record.get("walked_by_file", {}).items():
                if math.isfinite(walked["tau"]):
                    self.tb.add_scalar(f"walked_by_file/{name}", walked["tau"], step)
        if self.wandb is not None:
            self.wandb.log(record)
        if self.bar is not None:
            self._describe(record)
        self.event(console_line(record, self.total_steps, self.eta_s(step)))
        if record.get("walked_by_file"):
            self.event(walked_by_file_line(record))

    def event(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
        if self.bar is not None:
            self.bar.close()
