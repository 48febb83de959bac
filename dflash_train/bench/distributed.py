"""The training bench under torchrun (topology.mode colocated or disaggregated).

Owns one rank's part of it: the drafter side (warm-up, then timed steps with the stop agreement,
as train.loop.train_drafter takes them) or, in a disaggregated run, the target side
(train.loop.train_target), each measuring its own figures; and the report global rank 0 makes of
every rank's figures, in the layout of the one-process report (training.py) plus the ranks, the
transport's waits and the bytes moved.
"""

from __future__ import annotations

import datetime
import math
import os
import time

import torch
import torch.distributed as tdist

from dflash_train.bench.flops import WorkCounter, peak_flops
from dflash_train.bench.harness import build_run, compiled_graph_count, step_flops, warm_up_steps
from dflash_train.bench.workloads import WORKLOADS, synthetic_dataset, workload_settings
from dflash_train.core.devices import synchronize
from dflash_train.train.dist import Dist
from dflash_train.train.loop import batch_plan, drain, take_step, train_target, warm_up
from dflash_train.train.metrics import peak_memory_gib

# --------------------------------------------------------------------------- under torchrun


def world_size() -> int:
    """torchrun's WORLD_SIZE; 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_bench_distributed(workload: str, steps: int | None, warmup: int | None, overrides: list[str],
                          peak_tflops: float | None, log=print) -> dict | None:
    """One rank of a bench under torchrun (topology.mode colocated or disaggregated): every rank
    builds the workload's run, of warm-up + timed steps (train.max_steps) with checkpoints off;
    drafter ranks (colocated: every rank) take each step and its stop agreement as
    train.loop.train_drafter does, target ranks run train.loop.train_target. Each rank measures
    its own side; global rank 0 gathers them (control group) and returns the report, the other
    ranks None."""
    say = log if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)
    wl = WORKLOADS[workload]
    started = time.perf_counter()
    cfg, _ = workload_settings(workload, overrides)
    d = Dist.from_env(cfg.topology, cfg.train.device)
    if warmup is None:  # one epoch: every bucket shape seen on every rank
        lengths = synthetic_dataset(wl, cfg.drafter.mask_token_id, cfg.train.seed)["length"]
        M = d.assignment(cfg.train.grad_accum).micro_per_step
        warmup = wl.warmup if wl.warmup is not None else math.ceil(batch_plan(cfg, lengths).num_batches / M)
    num_steps = steps or wl.steps
    # The run ends after the timed steps: target ranks stop producing there.
    run, config = build_run(workload, [*overrides, f"train.max_steps={warmup + num_steps}"], log=log, dist=d)
    say(f"bench {workload}: built in {time.perf_counter() - started:.1f} s on {d.world_size} ranks "
        f"({len(d.target_ranks)} target, {len(d.drafter_ranks)} drafter; {cfg.topology.mode})")
    if run.step is not None:
        own = _drafter_side(run, config, warmup, num_steps, say)
    else:
        own = _target_side(run, warmup, num_steps)
    own.update(rank=d.rank, role=d.role, peak_memory_gib=peak_memory_gib(d.device))
    gathered = [None] * d.world_size if d.rank == 0 else None
    tdist.gather_object(own, gathered, dst=0, group=d.control)
    d.close()
    if d.rank != 0:
        return None
    return _combine(workload, run, gathered, warmup, num_steps, overrides, peak_flops(d.device, peak_tflops))


def _drafter_side(run, config, num_warmup: int, num_steps: int, say) -> dict:
    """A drafter (or colocated) rank: warm-up steps, then timed steps (micro-batches made here,
    or received) each followed by the stop agreement, as in train.loop.train_drafter; its stage
    times, receive wait, bytes received and useful FLOPs."""
    cfg, device, receiver = run.cfg, run.dist.device, run.receiver
    counter = WorkCounter(run.step.drafter)

    def step():
        result = take_step(run, counter.watch)
        run.control.agree(run.steps_done, result)  # no signal handler, no time limit: nobody stops
        return result

    warm_up(run)
    warm_up_steps(run, counter, step, num_warmup, lambda text: say(f"bench: {text}"))
    recv_wait = receiver.wait_s if receiver is not None else 0.0
    graphs_before = compiled_graph_count()
    results = []
    started = time.perf_counter()
    for _ in range(num_steps):
        results.append(step())
    synchronize(device)
    applied = sum(r.applied for r in results)  # read after timing: the device may have decided
    wall = time.perf_counter() - started
    compiles = compiled_graph_count() - graphs_before
    stage_total = run.timer.flush()
    drain(run)
    loss_rows = int(run.step.acc.count_K.sum())  # host sync: after timing
    work = counter.count(cfg.objective.num_anchors, loss_rows)
    counter.handle.remove()
    # The target forward is counted from the samples this rank trained on, wherever it ran.
    flops = step_flops(run, config, work)
    return {
        "wall_s": wall, "stage_s": {k: v / num_steps for k, v in stage_total.items()},
        "recv_wait_s_per_step": (receiver.wait_s - recv_wait) / num_steps if receiver is not None else None,
        "bytes": counter.bytes_sent if receiver is not None else None,
        "flops": flops, "samples": work.samples, "context_tokens": work.context_tokens,
        "padded_tokens": work.padded_tokens, "attention_pairs": work.attention_pairs,
        "applied": applied, "compiles": compiles,
    }


def _target_side(run, num_warmup: int, num_steps: int) -> dict:
    """A target rank of a disaggregated run: train.loop.train_target over warm-up + timed steps; its
    stage times and send wait over the steps after the warm-up ones (it may run up to `lag`
    steps ahead of the drafters, so its window is its own)."""
    window = {"send_wait": 0.0, "started": time.perf_counter()}

    def on_step(step: int) -> None:
        if step == num_warmup:
            run.timer.flush()
            window.update(send_wait=run.sender.wait_s, started=time.perf_counter())

    train_target(run, on_step)
    return {"wall_s": time.perf_counter() - window["started"],
            "stage_s": {k: v / num_steps for k, v in run.timer.flush().items()},
            "send_wait_s_per_step": (run.sender.wait_s - window["send_wait"]) / num_steps}


def _combine(workload: str, run, ranks: list[dict], num_warmup: int, num_steps: int, overrides: list[str],
             peak: float | None) -> dict:
    """The report of a torchrun bench from every rank's own figures (in rank order)."""
    d = run.dist
    drafters = [r for r in ranks if r["role"] != "target"]
    targets = [r for r in ranks if r["role"] == "target"]
    wall = max(r["wall_s"] for r in drafters)
    samples = sum(r["samples"] for r in drafters)
    flops = {k: sum(r["flops"][k] for r in drafters) for k in drafters[0]["flops"]}
    total_flops = sum(flops.values())
    stage_s = drafters[0]["stage_s"]
    stage_sum = sum(stage_s.values()) or 1.0
    moved = None if not d.disaggregated else sum(r["bytes"] for r in drafters)
    return {
        "workload": workload,
        "drafter_only": False,
        "world_size": d.world_size,
        "mode": run.cfg.topology.mode,
        "num_target_ranks": len(d.target_ranks),
        "num_drafter_ranks": len(d.drafter_ranks),
        "samples_per_s": samples / wall,
        "samples_per_s_per_gpu": samples / wall / d.world_size,
        "ms_per_sample": 1000.0 * wall / max(samples, 1),
        "target_tokens_per_s": sum(r["context_tokens"] for r in drafters) / wall,
        "target_padded_tokens_per_s": sum(r["padded_tokens"] for r in drafters) / wall,
        "step_s": wall / num_steps,
        "stage_s": stage_s,
        "stage_share": {k: v / stage_sum for k, v in stage_s.items()},
        "target_stage_s": targets[0]["stage_s"] if targets else None,
        "wait_s_per_step": None if not d.disaggregated else {
            "drafter_recv": [r["recv_wait_s_per_step"] for r in drafters],
            "target_send": [r["send_wait_s_per_step"] for r in targets]},
        "transfer_bytes_per_step": None if moved is None else moved / num_steps,
        "transfer_gbytes_per_s": None if moved is None else moved / wall / 1e9,
        "mfu": total_flops / (wall * peak * d.world_size) if peak else None,
        "useful_tflops_per_s": total_flops / wall / 1e12,
        "peak_tflops": peak / 1e12 if peak else None,
        "flops_per_sample": {**{k: v / max(samples, 1) for k, v in flops.items()}, "total": total_flops / max(samples, 1)},
        "attention_pairs_per_sample": sum(r["attention_pairs"] for r in drafters) / max(samples, 1),
        "samples": samples,
        "samples_per_step": samples / num_steps,
        "peak_memory_gib": max(r["peak_memory_gib"] for r in ranks),
        "gpu_idle_share": None,
        "steps": num_steps,
        "warmup_steps": num_warmup,
        "skipped_steps": num_steps - min(r["applied"] for r in drafters),
        "compiles_during_timing": max(r["compiles"] for r in drafters),
        "device": torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "overrides": overrides,
    }
