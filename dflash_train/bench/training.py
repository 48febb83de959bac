"""Throughput and MFU of the training step on synthetic workloads (`dflash-train bench`).

Owns the one-process bench: the workload's run built (harness.py), warmed up, then timed steps
of the run's `DrafterStep` (the step `train` takes), an optional profile window replaying them
(the GPU idle share and kernel summary: profile.py), and the report whose last line is one JSON
object, with its human-readable lines. Under torchrun the bench is distributed.py's; the
workloads are workloads.py's and the useful-FLOP count behind MFU is flops.py's.
docs/PERFORMANCE.md explains what is counted.

Shape legend: b rows, L padded length, N blocks, B block size, H hidden size, V vocabulary.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.bench.distributed import run_bench_distributed, world_size
from dflash_train.bench.flops import WorkCount, WorkCounter, peak_flops
from dflash_train.bench.harness import build_run, compiled_graph_count, step_flops, warm_up_steps, warmup_count
from dflash_train.bench.profile import profile_steps
from dflash_train.bench.workloads import WORKLOADS
from dflash_train.core.config import ConfigError
from dflash_train.core.devices import synchronize
from dflash_train.train.loop import take_step, warm_up
from dflash_train.train.metrics import peak_memory_gib


@dataclass(frozen=True)
class TimedSteps:
    """What the timed steps of a one-process bench measured (host numbers, read after timing)."""

    warmup: int
    """Untimed steps before them."""
    steps: int
    first_step: int
    """The run's step count before the first of them (where a profile window replays from)."""
    wall: float
    """Seconds from the first step's launch to the device's end of the last."""
    applied: int
    """Steps that made an optimizer step (the others were skipped as non-finite)."""
    compiles: int
    """Graphs compiled during timing."""
    stage_total: dict[str, float]
    """Seconds per stage over the steps (metrics.StageTimer)."""
    work: WorkCount
    peak_memory: float
    """GiB (metrics.peak_memory_gib)."""


# --------------------------------------------------------------------------- the run


def check_options(workload: str, steps: int | None, warmup: int | None, profile: int | None) -> None:
    """ConfigError for an unknown workload or a step count out of range, in the words of the flags."""
    if workload not in WORKLOADS:
        raise ConfigError([f"--workload {workload!r} is unknown: choose one of {', '.join(WORKLOADS)}"])
    for name, value in (("--steps", steps), ("--warmup", warmup), ("--profile-steps", profile)):
        if value is not None and value < (1 if name == "--steps" else 0):
            raise ConfigError([f"{name} must be >= {1 if name == '--steps' else 0}, got {value}"])


def run_bench(workload: str, steps: int | None = None, warmup: int | None = None,
              overrides: list[str] | None = None, drafter_only: bool = False, profile: int | None = None,
              profile_summary: Path | None = None, peak_tflops: float | None = None, log=print) -> dict:
    """Build the workload's run, warm it up, time `steps` steps, then profile `profile` steps
    (CUDA; default: as many as were timed) that replay the timed steps' batches from the first
    on; returns the report (the JSON object). Under torchrun: run_bench_distributed."""
    check_options(workload, steps, warmup, profile)
    wl = WORKLOADS[workload]
    overrides = list(overrides or [])
    if world_size() > 1:
        if drafter_only:
            raise ConfigError(["--drafter-only runs in one process: drop it or launch without torchrun"])
        return run_bench_distributed(workload, steps, warmup, overrides, peak_tflops, log)
    started = time.perf_counter()
    run, config = build_run(workload, overrides, drafter_only, log)
    device = run.dist.device
    counter = WorkCounter(run.step.drafter)
    log(f"bench {workload}: built in {time.perf_counter() - started:.1f} s on {device}")
    if not drafter_only:
        warm_up(run)
    num_warmup = warmup_count(wl, run, warmup)
    warm_up_steps(run, counter, lambda: take_step(run, counter.watch), num_warmup,
                  lambda text: log(f"bench {workload}: {text}"))
    timed = time_steps(run, counter, num_warmup, steps or wl.steps)
    counter.handle.remove()
    idle = None
    num_profile = timed.steps if profile is None else profile
    if device.type == "cuda" and num_profile > 0:
        counter = WorkCounter(run.step.drafter)
        idle = profile_steps(run, counter, num_profile, profile_summary, first_step=timed.first_step)
        counter.handle.remove()
    flops = step_flops(run, config, timed.work, target_ran=not drafter_only)
    if run.step.sharding is not None:  # train.fsdp in one process: the process group it made
        run.step.sharding.close()
    return bench_report(workload, run, timed, flops, peak_flops(device, peak_tflops), idle, drafter_only, overrides)


def time_steps(run, counter: WorkCounter, num_warmup: int, num_steps: int) -> TimedSteps:
    """`num_steps` steps of the run, timed on the host from the first launch to the device's end
    of the last, with what they did (counter) and the stage timers' totals."""
    device = run.dist.device
    graphs_before = compiled_graph_count()
    first_timed = run.steps_done
    results = []
    started = time.perf_counter()
    for _ in range(num_steps):
        results.append(take_step(run, counter.watch))
    synchronize(device)
    applied = sum(r.applied for r in results)  # read after timing: the device may have decided
    wall = time.perf_counter() - started
    compiles = compiled_graph_count() - graphs_before
    stage_total = run.timer.flush()
    loss_rows = int(run.step.acc.count_K.sum())  # host sync: after timing
    run.step.acc.reset()
    work = counter.count(run.cfg.objective.num_anchors, loss_rows)
    return TimedSteps(num_warmup, num_steps, first_timed, wall, applied, compiles, stage_total, work,
                      peak_memory_gib(device))


def bench_report(workload: str, run, timed: TimedSteps, flops: dict[str, float], peak: float | None,
                 idle: float | None, drafter_only: bool, overrides: list[str]) -> dict:
    """The report of a one-process bench (the JSON object): rates, MFU against `peak` (FLOP/s;
    None: unknown), stage shares, FLOPs per sample, the GPU idle share (`idle`, None where not
    profiled) and what ran."""
    device, wall, num_steps, work = run.dist.device, timed.wall, timed.steps, timed.work
    total_flops = sum(flops.values())
    stage_s = {k: v / num_steps for k, v in timed.stage_total.items()}
    stage_sum = sum(stage_s.values()) or 1.0
    samples = work.samples
    return {
        "workload": workload,
        "drafter_only": drafter_only,
        "samples_per_s": samples / wall,
        "ms_per_sample": 1000.0 * wall / max(samples, 1),
        "target_tokens_per_s": work.context_tokens / wall,
        "target_padded_tokens_per_s": work.padded_tokens / wall,
        "step_s": wall / num_steps,
        "stage_s": stage_s,
        "stage_share": {k: v / stage_sum for k, v in stage_s.items()},
        "mfu": total_flops / (wall * peak) if peak else None,
        "useful_tflops_per_s": total_flops / wall / 1e12,
        "peak_tflops": peak / 1e12 if peak else None,
        "flops_per_sample": {**{k: v / max(samples, 1) for k, v in flops.items()}, "total": total_flops / max(samples, 1)},
        "attention_pairs_per_sample": work.attention_pairs / max(samples, 1),
        "samples": samples,
        "samples_per_step": samples / num_steps,
        "peak_memory_gib": timed.peak_memory,
        "gpu_idle_share": idle,
        "steps": num_steps,
        "warmup_steps": timed.warmup,
        "skipped_steps": num_steps - timed.applied,
        "compiles_during_timing": timed.compiles,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "overrides": overrides,
    }


def format_report(r: dict) -> list[str]:
    """The human-readable lines printed above the JSON line."""
    def opt(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    lines = [
        f"{r['workload']}{' (drafter only)' if r['drafter_only'] else ''} on {r['device']}, torch "
        f"{r['torch_version']}: {r['steps']} timed steps after {r['warmup_steps']} warm-up steps, "
        f"{r['samples_per_step']:.1f} samples per step",
        f"samples/s {r['samples_per_s']:.2f} ({r['ms_per_sample']:.1f} ms/sample) | target tokens/s "
        f"{r['target_tokens_per_s']:.0f} (padded {r['target_padded_tokens_per_s']:.0f}) | step {r['step_s']:.3f} s",
        f"MFU {opt(r['mfu'], '.3f')} ({r['useful_tflops_per_s']:.2f} useful TFLOP/s of {opt(r['peak_tflops'], '.1f')}) "
        f"| GPU idle {opt(r['gpu_idle_share'], '.3f')} | peak memory {r['peak_memory_gib']:.2f} GiB",
        "stage             s/step   share",
    ]
    lines += [f"  {k:<15} {v:>7.4f}  {r['stage_share'][k]:>6.1%}" for k, v in r["stage_s"].items()]
    lines.append("useful FLOPs per sample: " + ", ".join(f"{k} {v:.3e}" for k, v in r["flops_per_sample"].items()))
    if "world_size" in r:
        lines.insert(1, f"{r['world_size']} ranks, {r['mode']}: {r['num_target_ranks']} target, "
                        f"{r['num_drafter_ranks']} drafter | samples/s per GPU {r['samples_per_s_per_gpu']:.2f}")
        if r["target_stage_s"] is not None:
            lines.append("target rank 0: " + ", ".join(f"{k} {v:.4f}" for k, v in r["target_stage_s"].items())
                         + " s/step")
        if r["wait_s_per_step"] is not None:
            w = r["wait_s_per_step"]
            lines.append(f"waits s/step: drafter receive {[round(v, 4) for v in w['drafter_recv']]}, target send "
                         f"{[round(v, 4) for v in w['target_send']]} | transfer "
                         f"{r['transfer_bytes_per_step'] / 1e6:.1f} MB/step, {r['transfer_gbytes_per_s']:.3f} GB/s")
    if r["skipped_steps"]:
        lines.append(f"warning: {r['skipped_steps']} timed steps were skipped as non-finite (no optimizer step)")
    if r["compiles_during_timing"]:
        lines.append(f"warning: {r['compiles_during_timing']} graphs were compiled during timing: raise --warmup")
    return lines
