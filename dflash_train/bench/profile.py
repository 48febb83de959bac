"""The profile window of the training bench (`--profile`): the share of wall time the GPU is idle
over steps that replay the timed ones, measured with torch.profiler, and the kernel summary
file: kernels ranked by device time, host operations by their own time, and the call sites
where the host waits for the GPU."""

from __future__ import annotations

import os
import traceback
import warnings
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from dflash_train.train.loop import take_step

# --------------------------------------------------------------------------- idle share


def busy_time(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """Length of the union of `intervals`, clipped to `window`."""
    start, end = window
    busy, reach = 0.0, start
    for s, e in sorted(intervals):
        s, e = max(s, reach), min(e, end)
        if e > s:
            busy += e - s
            reach = e
    return busy


def profile_steps(run, counter, steps: int, summary_path: Path | None, first_step: int | None = None) -> float:
    """Share of wall time the GPU runs no kernel and no copy over `steps` steps (from the first
    launch of the window to the end of its last kernel), measured with torch.profiler; with
    `summary_path`, also writes the kernels ranked by total device time there.

    `first_step`: the window replays the steps from this one on (`run.steps_done` is rewound to
    it): the bench passes its first timed step, so the profiled steps train on the timed steps'
    batches (every micro-batch is a pure function of its global index: the same shapes, lengths
    and anchors; only the weights have moved on)."""
    device = run.dist.device
    if first_step is not None:
        run.steps_done = first_step
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("bench_window"):
            for _ in range(steps):
                take_step(run, counter.watch)
            torch.cuda.synchronize(device)
    events = prof.events()
    # Kernels and copies only: ranges of record_function (and the optimizer's own annotation)
    # also appear on the device timeline, spanning idle gaps, and must not count as busy.
    device_events = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    window = next(e for e in events if e.name == "bench_window").time_range
    span = (window.start, window.end)
    busy = busy_time([(e.time_range.start, e.time_range.end) for e in device_events], span)
    if summary_path is not None:
        totals: dict[str, list[float]] = {}
        for e in device_events:
            entry = totals.setdefault(e.name, [0.0, 0])
            entry[0] += e.time_range.end - e.time_range.start
            entry[1] += 1
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
        device_total = sum(v[0] for v in totals.values()) or 1.0
        # The window's own work: the first timed steps' batches when replayed, else those after
        # them; attention's share of a step follows the squared lengths of its samples.
        work = counter.count(run.cfg.objective.num_anchors, 0)  # host syncs: after the window
        lines = [f"{steps} profiled steps, window {(span[1] - span[0]) / 1e3:.1f} ms, device busy "
                 f"{busy / 1e3:.1f} ms ({busy / (span[1] - span[0]):.1%}); their work: {work.samples} samples, "
                 f"{work.context_tokens} context tokens, {work.block_rows} block rows, "
                 f"{work.attention_pairs:.4g} attention pairs (all drafter layers)",
                 f"{'share':>7} {'ms':>10} {'calls':>7}  kernel"]
        lines += [f"{v[0] / device_total:>7.1%} {v[0] / 1e3:>10.2f} {v[1]:>7}  {name[:160]}" for name, v in ranked[:40]]
        lines += host_summary(prof, steps, len(device_events))
        with SyncSites(device) as syncs:  # one more step, outside the window: where the host waits
            take_step(run, counter.watch)
        torch.cuda.synchronize(device)
        lines += syncs.lines(1)
        summary_path.write_text("\n".join(lines) + "\n")
    return max(0.0, 1.0 - busy / max(span[1] - span[0], 1e-9))


class SyncSites:
    """While open, every operation that makes the host wait for the GPU is counted by its call
    site: CUDA's sync debug mode warns at each (item, nonzero, a device-to-host copy, ...), and
    the warning's Python stack names the innermost frame outside torch and this package's frames
    that led there. On CPU there is no debug mode; warnings about synchronising are counted all
    the same (tests). Other warnings pass through as usual."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.sites: dict[tuple[str, str], int] = {}

    def __enter__(self) -> "SyncSites":
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        self._show = warnings.showwarning
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "called a synchronizing" not in str(message):  # not e.g. the debug mode's own warning
            self._show(message, category, filename, lineno, file, line)
            return
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        outside = [f for f in frames if f"{os.sep}torch{os.sep}" not in f.filename]
        site = f"{_short(outside[-1].filename)}:{outside[-1].lineno}" if outside else f"{filename}:{lineno}"
        ours = [f"{_short(f.filename)}:{f.lineno}" for f in frames if f"{os.sep}dflash_train{os.sep}" in f.filename]
        key = (site, " <- ".join(reversed(ours[-3:])))
        self.sites[key] = self.sites.get(key, 0) + 1

    def lines(self, steps: int) -> list[str]:
        total = sum(self.sites.values())
        out = ["", f"host syncs: {total / steps:.1f} per step (torch.cuda sync debug mode over {steps} step(s)), "
               "by call site (innermost frame outside torch | this package's frames)"]
        out += [f"{n / steps:>7.1f}  {site} | {ours}"
                for (site, ours), n in sorted(self.sites.items(), key=lambda kv: -kv[1])]
        return out


def _short(path: str) -> str:
    """A source path from its package folder on (site-packages and the checkout dropped)."""
    parts = Path(path).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1:])
    if "dflash_train" in parts:
        return "/".join(parts[parts.index("dflash_train"):])
    return path


def host_summary(prof, steps: int, device_events: int, top: int = 30) -> list[str]:
    """The host's side of a profile: device events (kernels and copies) per step, and the
    operations and runtime calls ranked by the host time spent in them alone (self time): where
    a step bound by the host spends it (launches, synchronisations, guards of compiled code)."""
    averages = sorted((e for e in prof.key_averages() if e.key != "bench_window"), key=lambda e: -e.self_cpu_time_total)
    host_total = sum(e.self_cpu_time_total for e in averages) or 1.0
    lines = ["", f"host: {device_events / steps:.0f} device events per step; operations by host self time "
             f"({host_total / 1e3 / steps:.1f} ms per step in all)",
             f"{'share':>7} {'ms/step':>10} {'calls/step':>10}  operation"]
    lines += [f"{e.self_cpu_time_total / host_total:>7.1%} {e.self_cpu_time_total / 1e3 / steps:>10.2f} "
              f"{e.count / steps:>10.1f}  {e.key[:160]}" for e in averages[:top]]
    return lines
