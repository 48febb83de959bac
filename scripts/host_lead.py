"""Where a bench workload's GPU waits for the host: the host's lead over the GPU at probes
inside each step, over the same steps the bench times.

    python scripts/host_lead.py --workload smollm2 [--steps 20] [--warmup N] [--out FILE] [overrides ...]

Builds the workload's run as `dflash-train bench` does, installs the probes, runs the bench's
warm-up steps (the workload's count unless --warmup), then --steps probed steps (by default the
bench's timed count, so these are the steps `bench` would time). A probe records the host's
clock and a CUDA event at: each stage mark of the step (data, target, pack, mask,
drafter_forward, backward, optimizer), each drafter layer's forward and, through a gradient
hook on its output, the start of its backward (on the autograd engine's thread), and the start
and end of the loss. After the steps, one sync; each probe's lead is the time the GPU reached its
event minus the time the host recorded it, both from the first probe. A lead near 0 means the
GPU had nothing queued there and waited for the host; a lead that collapses to 0 inside a stage
that normally keeps tens of milliseconds means the host stalled there (or synchronised).

Prints, per probe name, the mean and least lead and the GPU and host time to the next probe
(the steps after the first two), then one line per step: its GPU and host time, the lead at its
start and its least lead (and where). Also the Python garbage collections during the probed
steps (their count and time per generation). On CPU the events are host clocks: every lead is 0.
"""

from __future__ import annotations

import argparse
import gc
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from dflash_train.bench import flops, harness, workloads
from dflash_train.train import step as step_module
from dflash_train.train.metrics import StageTimer


class _HostClock:
    """A CPU stand-in for a CUDA event: the host's clock at record()."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: "_HostClock") -> float:
        return (other.t - self.t) * 1e3


class _Probed(torch.nn.Module):
    """A drafter layer with a probe before its forward and one at the start of its backward."""

    def __init__(self, inner: torch.nn.Module, index: int, probes: "Probes") -> None:
        super().__init__()
        self.inner, self.index = inner, index
        self.probes = probes

    def forward(self, *args, **kwargs):
        self.probes.record(f"L{self.index}:fwd")
        out = self.inner(*args, **kwargs)
        if out.requires_grad:
            out.register_hook(lambda grad: self.probes.record(f"L{self.index}:bwd"))
        return out


class Probes:
    """While installed (a context manager), records (name, host ms, event) at the probes; `on`
    gates recording, so that warm-up steps run through the same code unrecorded."""

    def __init__(self, run) -> None:
        self.run = run
        self.cuda = run.dist.device.type == "cuda"
        self.records: list[tuple[str, float, object]] = []
        self.collections: list[tuple[int, float]] = []
        self.on = False
        self._lock = threading.Lock()
        self._gc_start = 0.0

    def record(self, name: str) -> None:
        if not self.on:
            return
        host = time.perf_counter()
        event = torch.cuda.Event(enable_timing=True) if self.cuda else _HostClock()
        event.record()
        with self._lock:
            self.records.append((name, host, event))

    def _on_gc(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.collections.append((info["generation"], (time.perf_counter() - self._gc_start) * 1e3))

    def __enter__(self) -> "Probes":
        drafter = self.run.step.drafter
        self._layers = list(drafter.layers)
        for i, layer in enumerate(self._layers):
            drafter.layers[i] = _Probed(layer, i, self)
        self._mark, self._block_loss = StageTimer.mark, step_module.block_loss
        probes, mark, block_loss = self, self._mark, self._block_loss

        def probed_mark(timer, name):
            probes.record(f"stage:{name}" if name is not None else "stage:end")
            return mark(timer, name)

        def probed_loss(*args, **kwargs):
            probes.record("loss:start")
            out = block_loss(*args, **kwargs)
            probes.record("loss:end")
            return out

        StageTimer.mark = probed_mark
        step_module.block_loss = probed_loss
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        self.on = False
        gc.callbacks.remove(self._on_gc)
        StageTimer.mark, step_module.block_loss = self._mark, self._block_loss
        drafter = self.run.step.drafter
        for i, layer in enumerate(self._layers):
            drafter.layers[i] = layer

    def report(self) -> list[str]:
        """The tables of the module docstring, from the records of the probed steps."""
        first_event, first_host = self.records[0][2], self.records[0][1]
        rows = [(name, (host - first_host) * 1e3, first_event.elapsed_time(event)) for name, host, event in self.records]
        steps = [i for i, row in enumerate(rows) if row[0].startswith("step ")]
        end = rows[-1]
        lines = [f"{len(steps)} probed steps: host {end[1]:.1f} ms, GPU {end[2]:.1f} ms ({end[2] / max(1, len(steps)):.2f} ms "
                 "per step on the GPU)",
                 f"{'probe':22s} {'mean lead':>9s} {'least':>8s} {'GPU to next':>11s} {'host to next':>12s}  (ms; steps 3 on)"]
        by_name: dict[str, list[list[float]]] = {}
        for k, start in enumerate(steps[2:], start=2):
            stop = steps[k + 1] if k + 1 < len(steps) else len(rows) - 1
            for j in range(start + 1, stop):
                name, host, gpu = rows[j]
                nxt = rows[j + 1]
                by_name.setdefault(name, [[], [], []])
                by_name[name][0].append(gpu - host)
                by_name[name][1].append(nxt[2] - gpu)
                by_name[name][2].append(nxt[1] - host)
        for name, (leads, gpu_next, host_next) in by_name.items():
            n = len(leads)
            lines.append(f"{name:22s} {sum(leads) / n:9.2f} {min(leads):8.2f} {sum(gpu_next) / n:11.2f} "
                         f"{sum(host_next) / n:12.2f}")
        lines.append("per step: GPU and host time, the lead at its start, its least lead (where) (ms)")
        for k, start in enumerate(steps):
            stop = steps[k + 1] if k + 1 < len(steps) else len(rows) - 1
            inside = [(rows[j][2] - rows[j][1], rows[j][0]) for j in range(start + 1, stop)] or [(0.0, "-")]
            least = min(inside)
            lines.append(f"  step {k + 1:3d}: GPU {rows[stop][2] - rows[start][2]:7.2f}  host {rows[stop][1] - rows[start][1]:7.2f}  "
                         f"lead at start {rows[start][2] - rows[start][1]:7.2f}  least {least[0]:7.2f} ({least[1]})")
        by_generation = defaultdict(list)
        for generation, ms in self.collections:
            by_generation[generation].append(ms)
        lines.append("garbage collections: " + (", ".join(
            f"generation {g}: {len(v)}, {sum(v):.1f} ms (longest {max(v):.1f})" for g, v in sorted(by_generation.items()))
            or "none"))
        return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="smollm2", choices=sorted(workloads.WORKLOADS))
    parser.add_argument("--steps", type=int, default=None, help="probed steps (default: the bench's timed count)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: the bench's)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for the bench")
    args = parser.parse_args(argv)
    from dflash_train.train.loop import take_step, warm_up

    run, _ = harness.build_run(args.workload, args.overrides, False, print)
    workload = workloads.WORKLOADS[args.workload]
    counter = flops.WorkCounter(run.step.drafter)
    warm_up(run)
    num_warmup = harness.warmup_count(workload, run, args.warmup)
    with Probes(run) as probes:
        harness.warm_up_steps(run, counter, lambda: take_step(run, counter.watch), num_warmup, print)
        probes.on = True
        for k in range(args.steps or workload.steps):
            probes.record(f"step {k + 1}")
            take_step(run, counter.watch)
        probes.record("end")
        probes.on = False
    if run.dist.device.type == "cuda":
        torch.cuda.synchronize(run.dist.device)
    counter.handle.remove()
    lines = probes.report()
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
