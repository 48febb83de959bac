"""Throughput and MFU of the training step on synthetic workloads (`dflash-train bench`).

Owns the benchmark workloads (target and drafter shapes, sample lengths, anchors), the
synthetic data and the random-initialised target of a real shape they run on, the timing
protocol (warm-up, then timed steps of the run's `DrafterStep`, the step `train` takes), the
GPU idle share measured with torch.profiler, the runs under torchrun, and the report whose last
line is one JSON object. The useful-FLOP count behind MFU is flops.py's. docs/PERFORMANCE.md
explains what is counted.

Shape legend: b rows, L padded length, N blocks, B block size, H hidden size, V vocabulary.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_train.config import ConfigError, load_config, runs_whole_target
from dflash_train.errors import output_file_problem
from dflash_train.flops import Shape, WorkCounter, peak_flops, useful_flops
from dflash_train.metrics import peak_memory_gib

QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
    max_position_embeddings=40960, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
# SmolLM2-135M-Instruct's shape (the bundled target; Llama architecture, tied embeddings).
SMOLLM2_135M = dict(
    model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
    max_position_embeddings=8192, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
TINY_TARGET = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, rms_norm_eps=1e-6,
    max_position_embeddings=512, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


@dataclass(frozen=True)
class Workload:
    description: str
    target: dict
    """Qwen3Config fields of the random-initialised target."""
    settings: dict
    """Config tree the run starts from (then the command line's overrides)."""
    lengths: tuple[int, int]
    """Sample lengths are drawn uniformly from [min, max] tokens (fixed when equal)."""
    num_samples: int
    """Synthetic samples in one epoch (the data cursor cycles through epochs)."""
    warmup: int | None
    """Untimed steps before timing; None: one whole epoch (every batch shape seen once)."""
    steps: int
    supervised: float = 0.5
    """Share of each sample, at its end, that carries loss (the assistant part)."""


# The settings of configs/qwen3-8b.yaml that both 8B workloads share (compiled target and
# drafter layers, 4 anchor buckets per doubling, the 5-layer block-16 drafter; Qwen3's first
# unused token as the mask).
QWEN3_8B_RUN = {"target": {"compile": True}, "train": {"compile": True, "anchor_buckets_per_doubling": 4},
                "drafter": {"num_layers": 5, "block_size": 16, "mask_token_id": 151669}}

WORKLOADS: dict[str, Workload] = {
    "w2": Workload(
        "Qwen3-8B-shaped target, 5-layer drafter, block 16, 768-token samples (last half "
        "supervised), 256 anchors per sample",
        QWEN3_8B,
        {**QWEN3_8B_RUN,
         "data": {"max_length": 768, "token_budget": 6144, "bucket_boundaries": [768]},
         "objective": {"num_anchors": 256}},
        lengths=(768, 768), num_samples=128, warmup=5, steps=20,
    ),
    "paper": Workload(
        "Qwen3-8B-shaped target, 5-layer drafter, block 16, lengths uniform in 256..3072 "
        "(last half supervised), 512 anchors per sample, 8 length buckets",
        QWEN3_8B,
        {**QWEN3_8B_RUN,
         "data": {"max_length": 3072, "token_budget": 8192, "max_batch_size": 32, "num_buckets": 8},
         "objective": {"num_anchors": 512}},
        lengths=(256, 3072), num_samples=256, warmup=None, steps=20,
    ),
    "smollm2": Workload(
        "SmolLM2-135M-shaped target, 5-layer drafter, block 16, lengths uniform in 128..1536 "
        "(last half supervised), 512 anchors per sample: the quality run's training step",
        SMOLLM2_135M,
        {"target": {"compile": True}, "train": {"compile": True},
         "drafter": {"num_layers": 5, "block_size": 16, "mask_token_id": 49151},
         "data": {"max_length": 2048, "token_budget": 16384, "max_batch_size": 64},
         "objective": {"num_anchors": 512}},
        lengths=(128, 1536), num_samples=256, warmup=None, steps=20,
    ),
    "tiny": Workload(
        "CPU-sized: 4-layer hidden-64 target, 2-layer drafter, block 8, lengths 32..128, "
        "16 anchors per sample (tests)",
        TINY_TARGET,
        {"drafter": {"num_layers": 2, "block_size": 8, "num_taps": 2, "mask_token_id": 511},
         "data": {"max_length": 128, "token_budget": 512, "num_buckets": 2},
         "objective": {"num_anchors": 16}, "train": {"anchor_multiple": 8, "num_threads": 1}},
        lengths=(32, 128), num_samples=48, warmup=2, steps=10,
    ),
}



# --------------------------------------------------------------------------- data and target


def synthetic_dataset(workload: Workload, mask_token_id: int, seed: int):
    """Random token ids (never the mask token) with the workload's lengths; the last
    `supervised` share of every sample carries loss."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    rng = np.random.default_rng(seed)
    low, high = workload.lengths
    lengths = rng.integers(low, high + 1, workload.num_samples)
    vocab = min(int(workload.target["vocab_size"]), mask_token_id)
    ids, masks = [], []
    for n in lengths.tolist():
        ids.append(rng.integers(0, vocab, n))
        mask = np.zeros(n, dtype=bool)
        mask[n - int(round(n * workload.supervised)):] = True
        masks.append(mask)
    # Named by what draws it: no content hash (datasets hashes with dill, which some pyarrow
    # and Python pairings cannot pickle).
    table = InMemoryTable.from_pydict({"input_ids": ids, "loss_mask": masks, "length": lengths})
    return Dataset(table, fingerprint=f"bench-{workload.num_samples}-{low}-{high}-{seed}-{mask_token_id}")


def target_config(workload: Workload):
    """The transformers config of the workload's target (Qwen3 unless it names a model_type)."""
    from transformers import AutoConfig

    fields = dict(workload.target)
    return AutoConfig.for_model(fields.pop("model_type", "qwen3"), **fields)


def build_random_target(config, device: torch.device, dtype: torch.dtype, seed: int):
    """`build_target` for train.build: a randomly initialised causal LM of `config`'s shape,
    built directly on `device` in `dtype` (an 8B model in seconds; no weights on disk)."""
    from transformers import AutoModelForCausalLM

    from dflash_train.target import Target

    def build(layer_ids: list[int], labels: str) -> Target:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        return Target(model, layer_ids, labels)

    return build


class RandomFeatureTarget:
    """The target's stand-in for `--drafter-only`: random features of the tapped width (one
    tensor per batch shape, made once), random frozen embedding and lm_head; no forward runs.
    With no `layer_ids` it is the heads of a disaggregated bench's drafter rank (as
    `target.TargetHeads`: embedding and lm_head of the target's shape, no features)."""

    def __init__(self, config, layer_ids: list[int], device: torch.device, dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator(device).manual_seed(seed)
        H, V = int(config.hidden_size), int(config.vocab_size)
        self.num_features = len(layer_ids) * H
        self.device, self.dtype, self.gen = device, dtype, gen
        self.embed_weight = torch.randn(V, H, generator=gen, device=device, dtype=dtype) * 0.02
        self.lm_head_weight = torch.randn(V, H, generator=gen, device=device, dtype=dtype) * 0.02
        self.features: dict[tuple, torch.Tensor] = {}

    def capture(self, input_ids_bL: torch.Tensor):
        shape = tuple(input_ids_bL.shape)
        if shape not in self.features:
            self.features[shape] = torch.randn(*shape, self.num_features, generator=self.gen,
                                               device=self.device, dtype=self.dtype)
        return self.features[shape], None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.embed_weight)


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
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from dflash_train.train import take_step

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
        import warnings

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
        import traceback

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


# --------------------------------------------------------------------------- the run


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
    _sync(device)
    log(f"{num_warmup} warm-up steps in {time.perf_counter() - started:.1f} s")
    run.timer.flush()
    run.step.acc.reset()
    counter.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def workload_config(workload: str, overrides: list[str], drafter_only: bool = False):
    """The workload's settings plus `overrides`, checked for what a synthetic run needs."""
    if workload not in WORKLOADS:
        raise ConfigError([f"--workload {workload!r} is unknown: choose one of {', '.join(WORKLOADS)}"])
    wl = WORKLOADS[workload]
    cfg = load_config(None, overrides, base=wl.settings)
    if drafter_only and cfg.objective.labels != "data":
        raise ConfigError([f"--drafter-only runs no target, so objective.labels={cfg.objective.labels} has no "
                           f"labels: drop one of the two"])
    if cfg.drafter.mask_token_id is None:
        raise ConfigError(["drafter.mask_token_id: synthetic data has no tokenizer to choose a mask token "
                           f"from; set it (below the target's vocabulary of {wl.target['vocab_size']})"])
    return cfg


def build_run(workload: str, overrides: list[str], drafter_only: bool = False, log=print, dist=None):
    """The workload's run (train.build, checkpoints off): its settings plus `overrides`,
    synthetic data, and a random target of the workload's shape (or random features with
    `drafter_only`); returns it and the target's transformers config. `dist`: this rank's
    dist.Dist when the caller made it already."""
    from dflash_train.target import resolve_device, resolve_dtype
    from dflash_train.train import build

    cfg = workload_config(workload, overrides, drafter_only)
    wl = WORKLOADS[workload]
    device = resolve_device(cfg.train.device)
    dtype = resolve_dtype(cfg.target.dtype, device)
    config = target_config(wl)
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


def run_bench(workload: str, steps: int | None = None, warmup: int | None = None,
              overrides: list[str] | None = None, drafter_only: bool = False, profile: int | None = None,
              profile_summary: Path | None = None, peak_tflops: float | None = None, log=print) -> dict:
    """Build the workload's run, warm it up, time `steps` steps, then profile `profile` steps
    (CUDA; default: as many as were timed) that replay the timed steps' batches from the first
    on; returns the report (the JSON object)."""
    if workload not in WORKLOADS:
        raise ConfigError([f"--workload {workload!r} is unknown: choose one of {', '.join(WORKLOADS)}"])
    for name, value in (("--steps", steps), ("--warmup", warmup), ("--profile-steps", profile)):
        if value is not None and value < (1 if name == "--steps" else 0):
            raise ConfigError([f"{name} must be >= {1 if name == '--steps' else 0}, got {value}"])
    wl = WORKLOADS[workload]
    overrides = list(overrides or [])
    if world_size() > 1:
        if drafter_only:
            raise ConfigError(["--drafter-only runs in one process: drop it or launch without torchrun"])
        return run_bench_distributed(workload, steps, warmup, overrides, peak_tflops, log)
    from dflash_train.train import take_step, warm_up

    started = time.perf_counter()
    run, config = build_run(workload, overrides, drafter_only, log)
    cfg, device = run.cfg, run.dist.device
    counter = WorkCounter(run.step.drafter)
    log(f"bench {workload}: built in {time.perf_counter() - started:.1f} s on {device}")
    if not drafter_only:
        warm_up(run)
    num_warmup = warmup_count(wl, run, warmup)
    num_steps = steps or wl.steps
    warm_up_steps(run, counter, lambda: take_step(run, counter.watch), num_warmup,
                  lambda text: log(f"bench {workload}: {text}"))
    graphs_before = _compiled_graphs()
    first_timed = run.steps_done
    results = []
    started = time.perf_counter()
    for _ in range(num_steps):
        results.append(take_step(run, counter.watch))
    _sync(device)
    applied = sum(r.applied for r in results)  # read after timing: the device may have decided
    wall = time.perf_counter() - started
    compiles = _compiled_graphs() - graphs_before
    stage_total = run.timer.flush()
    loss_rows = int(run.step.acc.count_K.sum())  # host sync: after timing
    run.step.acc.reset()
    work = counter.count(cfg.objective.num_anchors, loss_rows)
    peak_memory = peak_memory_gib(device)
    counter.handle.remove()

    idle = None
    num_profile = num_steps if profile is None else profile
    if device.type == "cuda" and num_profile > 0:
        counter = WorkCounter(run.step.drafter)
        idle = profile_steps(run, counter, num_profile, profile_summary, first_step=first_timed)
        counter.handle.remove()

    d = run.step.drafter
    tc = config
    labels = cfg.objective.labels
    target_layers = tc.num_hidden_layers if runs_whole_target(labels) else max(d.target_layer_ids) + 1
    flops = useful_flops(work, Shape.of(tc), target_layers, labels == "target", Shape.of(d.config),
                         d.config.num_hidden_layers, len(d.target_layer_ids), target_ran=not drafter_only,
                         distill=labels == "distill")
    total_flops = sum(flops.values())
    peak = peak_flops(device, peak_tflops)
    stage_s = {k: v / num_steps for k, v in stage_total.items()}
    stage_sum = sum(stage_s.values()) or 1.0
    samples = work.samples
    report = {
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
        "peak_memory_gib": peak_memory,
        "gpu_idle_share": idle,
        "steps": num_steps,
        "warmup_steps": num_warmup,
        "skipped_steps": num_steps - applied,
        "compiles_during_timing": compiles,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "overrides": overrides,
    }
    return report


# --------------------------------------------------------------------------- under torchrun


def world_size() -> int:
    """torchrun's WORLD_SIZE; 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_bench_distributed(workload: str, steps: int | None, warmup: int | None, overrides: list[str],
                          peak_tflops: float | None, log=print) -> dict | None:
    """One rank of a bench under torchrun (topology.mode colocated or disaggregated): every rank
    builds the workload's run, of warm-up + timed steps (train.max_steps) with checkpoints off;
    drafter ranks (colocated: every rank) take each step and its stop agreement as
    train.train_drafter does, target ranks run train.train_target. Each rank measures its own
    side; global rank 0 gathers them (control group) and returns the report, the other ranks
    None."""
    import torch.distributed as tdist

    from dflash_train.dist import Dist
    from dflash_train.train import batch_plan

    say = log if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)
    wl = WORKLOADS[workload]
    started = time.perf_counter()
    cfg = workload_config(workload, overrides)
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
    or received) each followed by the stop agreement, as in train.train_drafter; its stage
    times, receive wait, bytes received and useful FLOPs."""
    from dflash_train.train import drain, take_step, warm_up

    cfg, device, receiver = run.cfg, run.dist.device, run.receiver
    counter = WorkCounter(run.step.drafter)

    def step():
        result = take_step(run, counter.watch)
        run.control.agree(run.steps_done, result)  # no signal handler, no time limit: nobody stops
        return result

    warm_up(run)
    warm_up_steps(run, counter, step, num_warmup, lambda text: say(f"bench: {text}"))
    recv_wait = receiver.wait_s if receiver is not None else 0.0
    graphs_before = _compiled_graphs()
    results = []
    started = time.perf_counter()
    for _ in range(num_steps):
        results.append(step())
    _sync(device)
    applied = sum(r.applied for r in results)  # read after timing: the device may have decided
    wall = time.perf_counter() - started
    compiles = _compiled_graphs() - graphs_before
    stage_total = run.timer.flush()
    drain(run)
    loss_rows = int(run.step.acc.count_K.sum())  # host sync: after timing
    work = counter.count(cfg.objective.num_anchors, loss_rows)
    counter.handle.remove()
    dr = run.step.drafter
    labels = cfg.objective.labels
    target_layers = config.num_hidden_layers if runs_whole_target(labels) else max(dr.target_layer_ids) + 1
    # The target forward is counted from the samples this rank trained on, wherever it ran.
    flops = useful_flops(work, Shape.of(config), target_layers, labels == "target", Shape.of(dr.config),
                         dr.config.num_hidden_layers, len(dr.target_layer_ids), distill=labels == "distill")
    return {
        "wall_s": wall, "stage_s": {k: v / num_steps for k, v in stage_total.items()},
        "recv_wait_s_per_step": (receiver.wait_s - recv_wait) / num_steps if receiver is not None else None,
        "bytes": counter.bytes_sent if receiver is not None else None,
        "flops": flops, "samples": work.samples, "context_tokens": work.context_tokens,
        "padded_tokens": work.padded_tokens, "attention_pairs": work.attention_pairs,
        "applied": applied, "compiles": compiles,
    }


def _target_side(run, num_warmup: int, num_steps: int) -> dict:
    """A target rank of a disaggregated run: train.train_target over warm-up + timed steps; its
    stage times and send wait over the steps after the warm-up ones (it may run up to `lag`
    steps ahead of the drafters, so its window is its own)."""
    from dflash_train.train import train_target

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


def run_cli(args) -> int:
    output = Path(args.output) if args.output else None
    summary = None
    if args.profile and world_size() > 1:
        raise ConfigError(["--profile is for one process: launch without torchrun"])
    problem = output_file_problem(output) if output is not None else None
    if problem is not None:
        raise ConfigError([f"--output {output}: {problem}"])
    if args.profile:
        summary = (output.parent if output else Path(".")) / f"bench-{args.workload}-kernels.txt"
    report = run_bench(args.workload, steps=args.steps, warmup=args.warmup, overrides=args.overrides,
                       drafter_only=args.drafter_only, profile=args.profile_steps, profile_summary=summary,
                       peak_tflops=args.peak_tflops)
    if report is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    for line in format_report(report):
        print(line)
    if summary is not None and summary.exists():
        print(f"kernel summary written to {summary}")
    line = json.dumps(report)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(line + "\n")
    print(line, flush=True)
    if report["skipped_steps"]:
        # A skipped step (non-finite loss or gradients) did no update: its time is not a training
        # step's, and on synthetic data it means a broken setting. The report stays written.
        print(f"bench: {report['skipped_steps']} of {report['steps']} timed steps were skipped as non-finite "
              f"(no optimizer step): these figures do not time training; find what made the loss or "
              f"gradients NaN or inf (overrides: {report['overrides'] or 'none'}) before reading them",
              file=sys.stderr, flush=True)
        return 1
    return 0
