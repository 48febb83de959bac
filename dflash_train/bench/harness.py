"""What the training benches (one process and under torchrun) build on: the run of a workload
(train.loop.build on synthetic data and a random target), its warm-up steps, the count of graphs
compiled, and the useful FLOPs of the steps a drafter trained."""

from __future__ import annotations

import time

import torch

from dflash_train.bench.flops import Shape, WorkCount, useful_flops
from dflash_train.bench.workloads import (
    WORKLOADS,
    RandomFeatureTarget,
    Workload,
    build_random_target,
    synthetic_dataset,
    workload_settings,
)
from dflash_train.core.config import runs_whole_target
from dflash_train.core.devices import resolve_device, resolve_dtype, synchronize
from dflash_train.train.loop import build


def warmup_count(workload: Workload, run, warmup: int | None = None) -> int:
    """The untimed steps before a one-process bench's timed ones: `warmup` when given, else
    the workload's count, else one epoch of the run's batch plan (every batch shape compiled)."""
    if warmup is not None:
        return warmup
    return workload.warmup if workload.warmup is not None else run.plan.num_batches


def warm_up_steps(run, counter, step, num_warmup: int, log) -> None:
    """Run `num_warmup` untimed steps (compilation, allocator), then clear what the timed steps
    measure: stage timers, metric sums, the work count and the peak-memory mark."""
    device = run.dist.device
    started = time.perf_counter()
    for _ in range(num_warmup):
        step()
    synchronize(device)
    log(f"{num_warmup} warm-up steps in {time.perf_counter() - started:.1f} s")
    run.timer.flush()
    run.step.acc.reset()
    counter.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def compiled_graph_count() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    # torch._dynamo takes over a second to import: the bench's processes compile anyway, the
    # other commands that import this module do not.
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def build_run(workload: str, overrides: list[str], drafter_only: bool = False, log=print, dist=None):
    """The workload's run (train.loop.build, checkpoints off): its settings plus `overrides`,
    synthetic data, and a random target of the workload's shape, or of the shape of the folder
    a `target.path=DIR` override names (its config.json alone is read); random features instead
    with `drafter_only`. Returns it and the target's transformers config. `dist`: this rank's
    dist.Dist when the caller made it already."""
    wl = WORKLOADS[workload]
    cfg, config = workload_settings(workload, overrides, drafter_only)
    device = resolve_device(cfg.train.device)
    dtype = resolve_dtype(cfg.target.dtype, device)
    seed = cfg.train.seed
    if drafter_only:
        target = lambda layer_ids, labels: RandomFeatureTarget(config, layer_ids, device, dtype, seed)  # noqa: E731
    else:
        target = build_random_target(config, device, dtype, seed)
    # Built inside build(), after the rank's device is current: a bare "cuda" means that device.
    heads = lambda: RandomFeatureTarget(config, [], device, dtype, seed)  # noqa: E731 (disaggregated drafter ranks)
    run = build(cfg, log=log, target_config=config, build_target=target, build_heads=heads,
                dataset=synthetic_dataset(wl, cfg.drafter.mask_token_id, seed), checkpointing=False, dist=dist)
    return run, config


def step_flops(run, config, work: WorkCount, target_ran: bool = True) -> dict[str, float]:
    """Useful FLOPs (flops.useful_flops) of the work a drafter rank's steps did, `config` the
    target's transformers config: the target forward counted from the samples trained on,
    through the last tapped layer (every layer, and its lm_head with objective.labels=target,
    where the labels need the whole target), unless the target did not run (`target_ran`)."""
    drafter, labels = run.step.drafter, run.cfg.objective.labels
    target_layers = config.num_hidden_layers if runs_whole_target(labels) else max(drafter.target_layer_ids) + 1
    return useful_flops(work, Shape.of(config), target_layers, labels == "target", Shape.of(drafter.config),
                        drafter.config.num_hidden_layers, len(drafter.target_layer_ids), target_ran=target_ran,
                        distill=labels == "distill")
