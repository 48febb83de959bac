"""The typed configuration tree: sections, defaults, strict YAML loading, dotted overrides.

Owns every setting of a run. Each component receives only its own section. Loading is strict:
unknown keys, wrong types and invalid values are all collected and reported in one error that
names the file, line and field and says what would be valid. The resolved tree is written
next to every checkpoint, and a resumed run's settings are compared with it (`settings_changes`,
`RESUME_FIXED`: what a resumed run cannot change).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
import yaml

from dflash_train.core.drafter import tap_order_problem
from dflash_train.core.errors import InputError

BUNDLED_TARGET = "bundled:smollm2-135m-instruct"
TINY_TARGET = "bundled:tiny-random-llama"
QWEN_CODER_TARGET = "bundled:qwen2.5-coder-0.5b-instruct"
BUNDLED_DATA = "bundled:sharegpt"
PROMPT_SETS = ("mt-bench", "humaneval", "gsm8k")
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's loss decay by block size
DEFAULT_MAX_RECORD_BYTES = 16 * 1024 * 1024  # data.max_record_bytes
# flex_attention kernel options train.flex_kernel_options may set, each also with a prefix fwd_ /
# bwd_ (the forward's or the backward's kernel only); the switches are true / false. Not offered:
# ROWS_GUARANTEED_SAFE (it assumes every row meets a visible key in the first tile the kernel
# reads for it; under the mask rule a row can meet a wholly masked tile first, and the outputs
# were NaN), and BACKEND (its FLASH kernels ran slower than these on SmolLM2's shape,
# docs/PERFORMANCE.md).
FLEX_KERNEL_SWITCHES = ("PRESCALE_QK", "WRITE_DQ", "USE_TMA")
FLEX_KERNEL_OPTIONS = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2",
                       "num_warps", "num_stages", *FLEX_KERNEL_SWITCHES)


@dataclass
class TargetSection:
    path: str = BUNDLED_TARGET
    """Local Hugging Face folder of the frozen target, `bundled:smollm2-135m-instruct`, or
    `bundled:tiny-random-llama` (random weights, SmolLM2 tokenizer: tests and smoke runs)."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Target weights: auto = bfloat16 on GPU, float32 on CPU."""
    compile: bool = False
    """torch.compile each kept decoder layer of the target (norms, rope and residuals fused; one
    graph per batch shape, built during warm-up). Layer hooks stay outside the compiled code."""
    cuda_graphs: bool = True
    """On CUDA, replay the target forward from one CUDA graph per batch shape of the plan (at most
    two per length bucket), captured during warm-up (target.GraphedTarget): for a small target,
    launching its kernels one by one costs the host as much as running them costs the GPU. A
    target whose forward makes the host wait for the GPU (found by a check in warm-up) runs
    without graphs, and the log says so; a capture that fails all the same stops the warm-up
    with an error that names this switch. Memory: one output set of the largest shape and the
    graphs' shared pool."""


@dataclass
class DrafterSection:
    num_layers: int = 5
    """Draft decoder layers (paper: 5 for Qwen3-8B)."""
    block_size: int = 16
    """Tokens per block: the anchor plus block_size - 1 proposals."""
    target_layer_ids: list[int] | None = None
    """0-based target layers to tap; default: the published rule spreading num_taps over the
    target's layers (drafter.default_target_layer_ids)."""
    num_taps: int | None = None
    """Number of tapped target layers when target_layer_ids is unset (default: num_layers)."""
    mask_token_id: int | None = None
    """Block mask token; default: a reserved id chosen from the target's tokenizer."""
    sliding_window: int | None = None
    """Window W (tokens) for sliding-window layers; alone, makes every layer sliding-window."""
    layer_types: list[str] | None = None
    """Per layer 'full_attention' or 'sliding_attention' (overrides the sliding_window default)."""
    intermediate_size: int | None = None
    """MLP width; default: the target's."""
    init_from: str | None = None
    """A drafter folder (published format) to start from instead of random weights."""

    def problems(self) -> list[str]:
        p = []
        positive(p, "drafter.num_layers", self.num_layers)
        if self.block_size < 2:
            p.append(f"drafter.block_size must be >= 2, got {self.block_size}")
        ids = self.target_layer_ids
        order = tap_order_problem(ids) if ids and all(isinstance(i, int) for i in ids) else None
        if order:
            p.append(f"drafter.target_layer_ids must be strictly increasing: {order}")
        positive(p, "drafter.num_taps", self.num_taps, allow_none=True)
        positive(p, "drafter.sliding_window", self.sliding_window, allow_none=True)
        return p


@dataclass
class DataSection:
    paths: list[str] = field(default_factory=lambda: [BUNDLED_DATA])
    """Chat data files or folders (.json/.jsonl/.parquet), `bundled:sharegpt`, or one folder
    written by `dflash-train data prepare` (used as it is; max_length/overlong do not apply)."""
    max_length: int = 3072
    """Tokens per sample after the chat template; longer samples are handled by `overlong`."""
    overlong: Literal["truncate", "drop"] = "truncate"
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    """A record (a JSONL line, an element of a JSON array) longer than this many bytes is skipped
    and reported with its file and line before it is decoded, so reading data takes memory by
    the record, never by the file; the default is far above any real chat (a sample keeps
    max_length tokens)."""
    limit: int | None = None
    """Use only the first N training samples (quick runs), counted after the validation split."""
    validation: int | float = 0
    """Conversations held out of training for validation (walked tau and validation loss every
    `eval.every` steps): a count (an integer >= 1), a fraction in (0, 1), or 0 (off). Picked by
    a seeded hash of each conversation's opening (its system turns and first user turn), so the
    split is the same in every run on the same data, whatever the order of the files and the other
    settings (data.limit, the target, train.seed); every sample of a held-out conversation is
    held out. A fraction holds out each conversation whose hash falls below it; a count the
    conversations with the smallest hashes. docs/DATA.md, "Validation split"."""
    validation_seed: int = 0
    """Seed of the validation split's hash: another seed holds out other conversations."""
    token_budget: int = 16384
    """Padded target tokens per micro-batch (rows x bucket length)."""
    max_batch_size: int = 64
    """Rows per micro-batch."""
    num_buckets: int = 8
    """Length buckets derived from length quantiles (ignored when bucket_boundaries is set)."""
    bucket_boundaries: list[int] | None = None
    """Explicit bucket upper bounds in tokens."""
    cache_dir: str | None = None
    """Where prepared data is cached; default: <cache root>/data."""

    def problems(self) -> list[str]:
        p = []
        for name in ("max_length", "token_budget", "max_batch_size", "num_buckets", "max_record_bytes"):
            positive(p, f"data.{name}", getattr(self, name))
        positive(p, "data.limit", self.limit, allow_none=True)
        if self.token_budget < self.max_length:
            p.append(f"data.token_budget ({self.token_budget}) must hold one sample of data.max_length "
                     f"({self.max_length}) tokens: raise the budget or lower max_length")
        if not self.paths:
            p.append(f"data.paths is empty: give chat data files or '{BUNDLED_DATA}'")
        v = self.validation
        if v < 0 or (v >= 1 and v != int(v)):
            p.append(f"data.validation must be 0 (off), a count of conversations (an integer >= 1) or a "
                     f"fraction in (0, 1), got {v!r}")
        return p


@dataclass
class ObjectiveSection:
    num_anchors: int = 512
    """Anchors (blocks) per document per step, at most."""
    gamma: float | None = None
    """Loss decay over block positions (weighting=decay); default by block size (16 -> 7,
    10 -> 5, 8 -> 4)."""
    labels: Literal["data", "target", "distill"] = "data"
    """Train towards the data tokens (paper), the target's own greedy predictions, or (distill)
    the target's whole next-token distribution at each position: KL(target || drafter), the
    target's logits recomputed in the loss from its final hidden state, which travels with the
    batch ([T, H] in the target's dtype). target and distill run the whole target."""
    weighting: Literal["decay", "dpace", "dpace_prefix", "dpace_continuation"] = "decay"
    """Loss weight of block position k: decay = exp(-(k-1)/gamma), normalised by the weights'
    sum (paper); dpace = D-PACE, per block from the drafter's own (detached) probability of
    each label, smoothed s_j = (1 - dpace_alpha) q_j + dpace_alpha: w_k = sum over j >= k of
    s_1...s_j, normalised by the number of supervised positions; dpace_prefix = s_1...s_k
    alone; dpace_continuation = w_k / (s_1...s_k)."""
    dpace_alpha: float = 0.5
    """D-PACE confidence smoothing in [0, 1] (1: every s_j = 1, the weights ignore confidence)."""
    loop_tails: Literal["supervise", "skip"] = "supervise"
    """Replies that end in a loop (data.loop_period: a small target's greedy replies cut at
    their budget often do): supervise every token (the paper), or skip the loop past its first
    3 periods in training samples (the tokens stay as context; the validation split keeps every
    token, so walked tau still measures what serving sees)."""
    noise: Literal["uniform", "gaussian", "none"] = "uniform"
    noise_std: float = 0.05
    """Noise on captured target features during training (U[-std, std] or N(0, std^2))."""
    lm_head_chunk_rows: int = 4096
    """Rows of block tokens per lm_head chunk in the loss."""

    def problems(self) -> list[str]:
        p = []
        positive(p, "objective.num_anchors", self.num_anchors)
        positive(p, "objective.gamma", self.gamma, allow_none=True)
        if self.noise_std < 0:
            p.append(f"objective.noise_std must be >= 0, got {self.noise_std}")
        positive(p, "objective.lm_head_chunk_rows", self.lm_head_chunk_rows)
        if not 0 <= self.dpace_alpha <= 1:
            p.append(f"objective.dpace_alpha must be in [0, 1], got {self.dpace_alpha}")
        if self.weighting != "decay" and self.gamma is not None:
            p.append(f"objective.gamma is the decay of objective.weighting=decay; with weighting="
                     f"{self.weighting} it has no effect: remove it or set weighting=decay")
        return p


@dataclass
class OptimSection:
    lr: float = 6e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_ratio: float = 0.04
    """Fraction of the total steps with linear warm-up, then cosine decay to min_lr_ratio * lr."""
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0

    def problems(self) -> list[str]:
        p = []
        positive(p, "optim.lr", self.lr)
        if not 0 <= self.warmup_ratio < 1:
            p.append(f"optim.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:
            p.append(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for b in ("beta1", "beta2"):
            if not 0 <= getattr(self, b) < 1:
                p.append(f"optim.{b} must be in [0, 1), got {getattr(self, b)}")
        positive(p, "optim.grad_clip", self.grad_clip)
        return p


@dataclass
class TrainSection:
    epochs: int = 6
    max_steps: int | None = None
    """Stop after this many optimizer steps (default: the end of `epochs`)."""
    max_time_s: float | None = None
    """Wall-clock limit in seconds: the run ends (checkpoint, export) at the first step boundary
    past it, counted from the start of this process's training loop."""
    fit_schedule_to_time: bool = True
    """With max_time_s: where the steps left to the schedule (max_steps or epochs) will not fit
    the time left, the learning rate's cosine is made to end, and the run with it, at the step the
    time is measured to reach (after 50 steps of this process, again every 500), so a run cut by
    time ends with its rate decayed; a warm-up still under way then takes optim.warmup_ratio of the
    fitted steps (never ending before the next step). false: the schedule of max_steps, cut where
    time runs out."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    """Drafter attention: auto = flex on CUDA, sdpa (dense mask) on CPU."""
    compile: bool = False
    """torch.compile the drafter layers (and its two norms outside them) and, on CUDA, the
    lm_head loss's per-chunk math (where `loss_kernel` leaves it to torch)."""
    loss_kernel: Literal["auto", "triton", "torch"] = "auto"
    """What computes the loss between the lm_head's two matrix products (log-softmax, argmax,
    the label's log-probability, the softmax the input gradient multiplies): triton = one
    Triton kernel per chunk (`loss_kernel.py`; CUDA, hard labels, i.e. objective.labels data or
    target); torch = torch operations (compiled with `compile` on CUDA); auto = triton where it
    applies, torch otherwise (CPU, objective.labels=distill). docs/PERFORMANCE.md has the A/B."""
    anchor_multiple: int = 64
    """Anchor (block) counts per packed row are padded up to a multiple of this (then to the
    buckets of `anchor_buckets_per_doubling` where those are on), and packed rows to
    data.token_budget tokens."""
    anchor_buckets_per_doubling: int = 0
    """0 (default): anchor counts stay exact multiples of anchor_multiple, and the compiled
    drafter layers and flex attention are dynamic in the query count (one recompile, on the
    second count seen). s >= 1 (a power of two): counts (in multiples of anchor_multiple) are
    padded to the next of s evenly spaced sizes per doubling, one compiled shape each: 1 =
    powers of two (padding blocks up to half of a row's blocks), 4 = at most a fifth. Padding
    blocks cost the drafter's layers a full row each (the loss skips them), which is why exact
    counts are the default (docs/PERFORMANCE.md)."""
    fp8: Optional[Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]] = None
    """Float8 matrix products in the drafter's linear layers (fc and every layer's projections),
    by torchao's float8 training recipe of that name: one scale per tensor ("tensorwise"), per
    row ("rowwise"), or per row with the weight gradient's product kept in bf16
    ("rowwise_with_gw_hp"). The master weights, the optimizer, the target and the lm_head stay
    as they are. CUDA GPUs of compute capability 8.9 or newer; the `fp8` extra. null (the
    default): off, because float8 lowered served tau on the real SmolLM2 run (docs/QUALITY.md);
    docs/PERFORMANCE.md has what each recipe does for speed."""
    flex_kernel_options: Optional[dict[str, Union[int, bool]]] = None
    """Options of the drafter's flex attention kernels on CUDA (flex_attention's
    `kernel_options`): forward tile sizes BLOCK_M / BLOCK_N, backward BLOCK_M1 / BLOCK_N1 /
    BLOCK_M2 / BLOCK_N2 (each dividing the BlockMask's 128-token tiles), num_warps, num_stages
    (both kernels), the switches PRESCALE_QK, WRITE_DQ and USE_TMA (Hopper's tensor memory
    accelerator); any of them prefixed fwd_ or bwd_ for one kernel only (e.g. bwd_num_warps,
    fwd_USE_TMA). A setting replaces the default as a whole.
    null (default): for drafters of head dim 64 or less, 64 x 64 tiles in both kernels, a
    backward of 4 warps and 2 stages and TMA loads in the forward
    (compilation.SMALL_HEAD_FLEX_OPTIONS, measured faster on SmolLM2's shape); torch's choice
    otherwise; {}: always torch's choice. docs/PERFORMANCE.md has the measurements."""
    max_consecutive_skips: int = 10
    """Stop the run after this many consecutive non-finite steps."""
    max_consecutive_batch_failures: int = 5
    """Stop the run after the target forward failed on this many micro-batches in a row, in the
    run's global micro-batch order whatever the topology (each failure, e.g. out of memory on an
    unusual shape, is logged and its micro-batch skipped)."""
    num_threads: int | None = None
    """CPU intra-op threads (torch.set_num_threads). Default: 1 where the run's device is a GPU
    (the host's CPU tensor work there is small bookkeeping whose parallel regions stall when
    other work shares the host's cores: docs/PERFORMANCE.md), torch's choice on CPU."""
    fsdp: bool = False
    """Shard the drafter, its gradients and its AdamW state over the drafter ranks with FSDP2
    (torch's fully_shard, per decoder layer, then the rest of the drafter) instead of a whole
    replica on every rank; the same batches and losses (up to the order of sums over ranks).
    Checkpoints are then written sharded (torch.distributed.checkpoint) and resume on any number
    of ranks, with or without FSDP; the export is one folder, as without. Also on one process (a
    process group of its own). docs/ARCHITECTURE.md, "A sharded drafter (train.fsdp)"."""

    def problems(self) -> list[str]:
        p = []
        if self.fsdp and not torch.distributed.is_available():
            p.append("train.fsdp=true needs torch.distributed, which this torch build lacks: install a build "
                     "with distributed support, or set train.fsdp=false")
        positive(p, "train.epochs", self.epochs)
        positive(p, "train.max_steps", self.max_steps, allow_none=True)
        positive(p, "train.max_time_s", self.max_time_s, allow_none=True)
        positive(p, "train.grad_accum", self.grad_accum)
        positive(p, "train.anchor_multiple", self.anchor_multiple)
        p += flex_kernel_option_problems(self.flex_kernel_options or {})
        if self.fp8 is not None and importlib.util.find_spec("torchao") is None:
            p.append(f"train.fp8={self.fp8} but the torchao package is not installed: pip install 'dflash-train[fp8]'")
        s = self.anchor_buckets_per_doubling
        if isinstance(s, int) and (s < 0 or s & (s - 1)):
            p.append(f"train.anchor_buckets_per_doubling must be 0 (exact counts) or a power of two "
                     f"(1, 2, 4, 8, ...), got {s}")
        positive(p, "train.max_consecutive_skips", self.max_consecutive_skips)
        positive(p, "train.max_consecutive_batch_failures", self.max_consecutive_batch_failures)
        return p


@dataclass
class CheckpointSection:
    every: int = 500
    """Save every N optimizer steps (and at the end, and on SIGTERM/SIGINT)."""
    keep: int = 3
    """Keep the newest K checkpoints."""
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the exported drafter folder."""
    keep_best: bool = False
    """Keep the checkpoint of the evaluation step with the best walked validation tau (never
    removed by `keep`) and export that one instead of the last step's. Needs the walked tau
    (data.validation and eval.every) and a checkpoint at every evaluation step (eval.every a
    multiple of `every`). Ties keep the earlier step."""

    def problems(self) -> list[str]:
        p = []
        positive(p, "checkpoint.every", self.every)
        positive(p, "checkpoint.keep", self.keep)
        return p


@dataclass
class LogSection:
    """Where log steps go: OUTPUT/metrics.jsonl and one console line each, always; the fields
    below add the rest."""

    every: int = 10
    """Log (one host sync) every N optimizer steps."""
    tensorboard: bool = True
    """The scalars also in OUTPUT/tensorboard/."""
    wandb: bool = False
    """Also to Weights & Biases (the `wandb` extra; WANDB_MODE=offline writes OUTPUT/wandb/
    only): every metrics.jsonl field, the resolved config, the evaluation tables. The W&B run
    id is kept in OUTPUT/wandb_id: a resumed run continues the same W&B run."""
    wandb_project: str = "dflash-train"
    """The W&B project of the run (the run is named after output_dir's last part)."""
    progress: bool = True
    """A progress bar with ETA, on a terminal only: off a terminal (a log file) the console
    lines carry the ETA and no bar is redrawn."""

    def problems(self) -> list[str]:
        p = []
        positive(p, "log.every", self.every)
        if self.wandb and importlib.util.find_spec("wandb") is None:
            p.append("log.wandb is true but the wandb package is not installed: pip install 'dflash-train[wandb]'")
        return p


@dataclass
class EvalSection:
    every: int = 0
    """Evaluate every N optimizer steps (0: never): the walked tau and validation loss on the
    held-out split (data.validation), and the served tau of real speculative decoding on
    `prompts`. Must be a multiple of log.every: the results go into that step's metrics.jsonl
    record. The served evaluation loads a second, full copy of the target (the training target
    stops at the last tapped layer). The run's last step (max_steps or the max_time_s stop) is
    evaluated too."""
    prompts: str | None = "mt-bench"
    """Prompts of the served evaluation: mt-bench, humaneval, gsm8k, or a JSONL file of
    {"turns": [...]}; null: none (the walked tau on the validation split only)."""
    limit: int | None = 4
    """Evaluate only the first N prompts of the set (null: all)."""
    max_new_tokens: int = 64
    """Tokens per response at most (greedy decoding)."""

    def problems(self) -> list[str]:
        p = []
        if self.every < 0:
            p.append(f"eval.every must be >= 0 (0 turns evaluation off), got {self.every}")
        positive(p, "eval.limit", self.limit, allow_none=True)
        positive(p, "eval.max_new_tokens", self.max_new_tokens)
        if (self.every and self.prompts is not None and self.prompts not in PROMPT_SETS
                and not Path(self.prompts).is_file()):
            p.append(f"eval.prompts must be mt-bench, humaneval, gsm8k, an existing JSONL file or null, "
                     f"got {self.prompts!r}")
        return p


@dataclass
class TopologySection:
    """How the processes of a run (one per device, started by torchrun) are used."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: every rank runs the target and a drafter replica (data parallel);
    disaggregated: target ranks capture and send packed batches to drafter ranks."""
    num_target_ranks: int | None = None
    """Disaggregated only: target ranks per node (the first local ranks of every node); the
    other local ranks train the drafter. At least one of each per node."""
    queue_depth: int = 2
    """Disaggregated only: batches in flight per drafter rank at most (sent, not yet received)."""
    split_fc: bool = False
    """Ship the tapped layers unconcatenated and do the concat and the feature noise on the
    drafter side (same numbers as doing them on the target side)."""
    timeout_s: float = 60.0
    """Seconds a rank waits for another (a batch, a send slot, a collective) before it exits
    non-zero naming what it waited for; must exceed the longest pause of any rank (a step, a
    checkpoint save, an evaluation)."""
    target_tp: int = 1
    """Ranks of one node that hold one target replica together, tensor parallel through the
    target's transformers plan (Llama, Qwen2/3, Qwen3-MoE, Mixtral, Gemma, ...). Colocated: each
    group of target_tp consecutive ranks runs the target on each member's micro-batch in turn
    (the drafter stays data parallel over every rank); disaggregated: the target ranks of a node
    form groups of target_tp, each one producer whose first rank sends. Same batches, same
    numbers as 1."""

    def problems(self) -> list[str]:
        p = []
        positive(p, "topology.target_tp", self.target_tp)
        if self.mode == "disaggregated":
            if self.num_target_ranks is None or self.num_target_ranks < 1:
                p.append(f"topology.num_target_ranks must be >= 1 in disaggregated mode (target ranks per node), "
                         f"got {self.num_target_ranks!r}")
            elif self.target_tp > 0 and self.num_target_ranks % self.target_tp:
                p.append(f"topology.num_target_ranks ({self.num_target_ranks}) must be a multiple of "
                         f"topology.target_tp ({self.target_tp}): a node's target ranks form groups of target_tp")
        elif self.num_target_ranks is not None:
            p.append("topology.num_target_ranks is for topology.mode=disaggregated only (colocated: every rank "
                     "holds the target); remove it or set topology.mode=disaggregated")
        positive(p, "topology.queue_depth", self.queue_depth)
        positive(p, "topology.timeout_s", self.timeout_s)
        return p


@dataclass
class FaultsSection:
    """Injected failures, for tests and debugging only; all off by default. Steps are 1-based
    optimizer steps, as logged."""

    nan_at_steps: list[int] = field(default_factory=list)
    """Turn the loss of these steps NaN (the non-finite guard must skip them)."""
    target_error_at_steps: list[int] = field(default_factory=list)
    """Raise inside the target forward on every micro-batch of these steps."""
    target_error: Literal["runtime", "oom"] = "runtime"
    """What the target forward raises: a RuntimeError, or torch.OutOfMemoryError."""
    delay_at_steps: list[int] = field(default_factory=list)
    """Sleep delay_seconds after these steps (a slow or hung rank, with on_ranks)."""
    delay_seconds: float = 0.0
    """Length of each injected delay, in seconds."""
    sigterm_at_steps: list[int] = field(default_factory=list)
    """Send this process SIGTERM after these steps."""
    sigterm_in_save_at_steps: list[int] = field(default_factory=list)
    """Send this process SIGTERM halfway through writing the checkpoint of these steps."""
    interrupt_save_at_steps: list[int] = field(default_factory=list)
    """Die (os._exit(137), like kill -9) halfway through writing the checkpoint of these steps."""
    corrupt_checkpoint_at_steps: list[int] = field(default_factory=list)
    """After saving the checkpoint of these steps, cut its drafter.safetensors to half."""
    on_ranks: list[int] | None = None
    """Global ranks on which the faults above fire (default: every rank)."""

    def problems(self) -> list[str]:
        p = []
        if self.on_ranks is not None and any(r < 0 for r in self.on_ranks):
            p.append(f"faults.on_ranks must hold global ranks >= 0, got {self.on_ranks}")
        for name, value in dataclasses.asdict(self).items():
            if name.endswith("_steps") and any(step < 1 for step in value):
                p.append(f"faults.{name} must hold optimizer steps >= 1, got {value}")
        if self.delay_seconds < 0:
            p.append(f"faults.delay_seconds must be >= 0, got {self.delay_seconds}")
        return p


@dataclass
class Config:
    output_dir: str = "runs/default"
    """Checkpoints, metrics, the exported drafter and the resolved config go here."""
    target: TargetSection = field(default_factory=TargetSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    data: DataSection = field(default_factory=DataSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    eval: EvalSection = field(default_factory=EvalSection)
    topology: TopologySection = field(default_factory=TopologySection)
    faults: FaultsSection = field(default_factory=FaultsSection)


# `dflash-train train` without --config: a drafter for the bundled SmolLM2-135M-Instruct on the
# bundled ShareGPT chats, sized to finish in a few minutes on a CPU (configs/default.yaml is the
# same run written out; a test keeps them equal). A --config file starts from the paper recipe
# (the dataclass defaults above) instead.
EMBEDDED_DEFAULT: dict = {
    "output_dir": "runs/default",
    "drafter": {"num_layers": 1, "block_size": 16},
    "data": {"max_length": 512, "token_budget": 2048, "max_batch_size": 16},
    "objective": {"num_anchors": 16},
    "optim": {"lr": 1.0e-3},
    "train": {"max_steps": 60, "anchor_multiple": 16},
    "checkpoint": {"every": 20, "keep": 2},
    "log": {"every": 10},
}


class ConfigError(InputError):
    """All problems of a configuration, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(problems))


# --------------------------------------------------------------------------- loading


def _line_map(text: str) -> dict[str, int]:
    """Dotted key path -> 1-based line in the YAML text (for error messages)."""
    lines: dict[str, int] = {}
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                path = f"{prefix}{key.value}"
                lines[path] = key.start_mark.line + 1
                walk(value, path + ".")

    walk(root, "")
    return lines


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of names to {_type_name(typing.get_args(tp)[1])}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp, path: str, problems: list[str], where) -> Any:
    """Check `value` against annotation `tp`; return the converted value or None on error."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{where(path)}: expected a mapping of settings, got {value!r}")
            return None
        return _build(tp, value, path + ".", problems, where)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            trial: list[str] = []
            out = _convert(value, arg, path, trial, where)
            if not trial:
                return out
        problems.append(f"{where(path)}: expected {_type_name(tp)}, got {value!r}")
        return None
    if origin is Literal:
        if value not in typing.get_args(tp):
            problems.append(f"{where(path)}: must be one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{where(path)}: expected {_type_name(tp)}, got {value!r}")
            return None
        _, item = typing.get_args(tp)
        return {str(k): _convert(v, item, f"{path}.{k}", problems, where) for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{where(path)}: expected {_type_name(tp)}, got {value!r}")
            return None
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{path}[{i}]", problems, where) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{where(path)}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where(path)}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads `3e-4` (no dot) as a string; accept what Python reads as a number.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where(path)}: expected a number, got {value!r}")
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{where(path)}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp} at {path}")  # our own invariant


def _build(cls, data: dict, prefix: str, problems: list[str], where):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            problems.append(
                f"{where(prefix + str(key))}: unknown setting '{prefix}{key}' "
                f"(known in this section: {', '.join(sorted(names))})"
            )
            continue
        before = len(problems)
        converted = _convert(value, hints[key], prefix + key, problems, where)
        # A rejected value keeps its default, so range checks still run on a well-typed tree
        # and every mistake of a file is reported in one go. A section is kept even when one
        # of its keys was rejected: its other fields still get their range checks.
        if len(problems) == before or (dataclasses.is_dataclass(hints[key]) and converted is not None):
            kwargs[key] = converted
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError([f"override {dotted}: '{key}' is not a section"])
    node[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> Config:
    """Defaults <- YAML file <- `section.key=value` overrides (values parsed as YAML).
    Without a file, `base` (a settings tree; default: the embedded default run) is the
    starting point."""
    tree: dict = copy.deepcopy(EMBEDDED_DEFAULT if base is None else base) if path is None else {}
    lines: dict[str, int] = {}
    source = "defaults"
    problems: list[str] = []
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError([f"{path}: config file not found"])
        text = path.read_text()
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError([f"{path}: not valid YAML: {err}"]) from err
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError([f"{path}: the top level must be a mapping of sections"])
        tree = loaded or {}
        lines = _line_map(text)
    overridden = set()
    for item in overrides or []:
        if "=" not in item:
            problems.append(f"override {item!r}: expected section.key=value")
            continue
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
        overridden.add(key.strip())

    def where(dotted: str) -> str:
        if dotted in overridden:
            return f"command line override {dotted}"
        if dotted.split("[")[0] in lines:
            return f"{source}:{lines[dotted.split('[')[0]]}: {dotted}"
        return f"{source}: {dotted}"

    cfg = _build(Config, tree, "", problems, where)
    problems += [_locate(msg, where) for msg in validate(cfg)]
    if problems:
        raise ConfigError(problems)
    return cfg


def _locate(message: str, where) -> str:
    """Prefix a range-check message ('field must ...') with the file and line of its field."""
    field_name = message.split(" ", 1)[0]
    located = where(field_name)
    return message if located.endswith(f"defaults: {field_name}") else f"{located}: {message}"


def loss_kernel_problems(setting: str, device: str, labels: str) -> list[str]:
    """What rules out train.loss_kernel=`setting` for a device type ("auto" before it is
    resolved: nothing yet) and objective.labels; validate checks the config, and
    compilation.loss_kernel the resolved device."""
    if setting != "triton":
        return []
    problems = []
    if device not in ("auto", "cuda"):
        problems.append(f"train.loss_kernel=triton runs on CUDA GPUs, and this run's device is {device}: "
                        f"set train.loss_kernel to auto or torch")
    if labels == "distill":
        problems.append("train.loss_kernel=triton scores hard labels, not objective.labels=distill: "
                        "set train.loss_kernel to auto or torch")
    return problems


def validate(cfg: Config) -> list[str]:
    """Value checks that need no model: each section's own ranges (its `problems`), then the
    consistency between sections."""
    sections = (cfg.drafter, cfg.data, cfg.objective, cfg.optim, cfg.train, cfg.checkpoint, cfg.log,
                cfg.eval, cfg.topology, cfg.faults)
    return [problem for section in sections for problem in section.problems()] + consistency_problems(cfg)


def consistency_problems(cfg: Config) -> list[str]:
    """What one section's settings rule out in another's."""
    p = loss_kernel_problems(cfg.train.loss_kernel, cfg.train.device, cfg.objective.labels)
    every, validation = cfg.eval.every, cfg.data.validation
    if every and cfg.log.every > 0 and every % cfg.log.every:
        p.append(f"eval.every ({every}) must be a multiple of log.every ({cfg.log.every}): "
                 f"evaluation results are written into that step's log record")
    if every and cfg.eval.prompts is None and not validation:
        p.append("eval.every is set but there is nothing to evaluate: set data.validation (walked tau on "
                 "held-out conversations) or eval.prompts (served tau)")
    if cfg.checkpoint.keep_best:
        if not (every and validation):
            p.append("checkpoint.keep_best needs the walked validation tau: set data.validation and eval.every")
        elif cfg.checkpoint.every > 0 and every % cfg.checkpoint.every:
            p.append(f"checkpoint.keep_best keeps the checkpoint of the best evaluation step, so every "
                     f"evaluation step must save one: make eval.every ({every}) a multiple of "
                     f"checkpoint.every ({cfg.checkpoint.every})")
    block = cfg.drafter.block_size
    if cfg.objective.weighting == "decay" and cfg.objective.gamma is None and block not in DEFAULT_GAMMA:
        p.append(f"objective.gamma has no default for drafter.block_size={block} "
                 f"(defaults exist for {', '.join(map(str, sorted(DEFAULT_GAMMA)))}): set objective.gamma")
    return p


def positive(problems: list[str], name: str, value, allow_none: bool = False) -> None:
    """Add `name must be > 0` to `problems` unless `value` is (or is None where allowed)."""
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        problems.append(f"{name} must be > 0, got {value!r}")


def flex_kernel_option_problems(options: dict) -> list[str]:
    """train.flex_kernel_options: known names, tiles dividing the BlockMask's 128-token tiles."""
    p = []
    for key, value in options.items():
        name = key[4:] if key.startswith(("fwd_", "bwd_")) else key
        if name not in FLEX_KERNEL_OPTIONS:
            p.append(f"train.flex_kernel_options.{key}: unknown option (known: {', '.join(FLEX_KERNEL_OPTIONS)}, "
                     f"each also as fwd_NAME or bwd_NAME for one kernel)")
        elif name.startswith("BLOCK_") and (not isinstance(value, int) or value < 16 or 128 % value):
            p.append(f"train.flex_kernel_options.{key} must divide the BlockMask's 128-token tiles "
                     f"(16, 32, 64 or 128), got {value!r}")
        elif name in ("num_warps", "num_stages") and (type(value) is not int or value < 1):
            p.append(f"train.flex_kernel_options.{key} must be a positive integer, got {value!r}")
        elif name in FLEX_KERNEL_SWITCHES and not isinstance(value, bool):
            p.append(f"train.flex_kernel_options.{key} must be true or false, got {value!r}")
    return p


def runs_whole_target(labels: str) -> bool:
    """Whether objective.labels needs the target past its last tapped layer (its lm_head or
    its final hidden state)."""
    return labels in ("target", "distill")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


# --------------------------------------------------------------------------- resume

# Settings a resumed run cannot change: the drafter's architecture and the target it reads, the
# data and the batches it is cut into (the samples, their order and shapes), and the seed those
# are drawn from. A dotted name or a section prefix ending in ".". Every other setting (the
# optimizer, max_steps / epochs / max_time_s, logging, evaluation, checkpoints, the device,
# compilation, faults) may change on resume and applies from the resumed step; the global
# batch (drafter ranks x train.grad_accum) is checked on its own, as it may be reached another way.
RESUME_FIXED = ("drafter.", "target.path", "data.paths", "data.max_length", "data.overlong", "data.max_record_bytes",
                "data.limit", "data.validation", "data.validation_seed", "data.token_budget", "data.max_batch_size",
                "data.num_buckets", "data.bucket_boundaries", "train.seed")
# Settings that say where the run is, not what it trains.
RESUME_IGNORED = ("output_dir",)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "flex_kernel_options":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@dataclass(frozen=True)
class SettingsChange:
    """One setting that differs between a checkpoint's config (`saved`) and this run's (`now`)."""

    name: str
    saved: Any
    now: Any

    @property
    def fixed(self) -> bool:
        return any(self.name == f or (f.endswith(".") and self.name.startswith(f)) for f in RESUME_FIXED)

    def __str__(self) -> str:
        return f"{self.name} {self.saved!r} -> {self.now!r}"


def settings_changes(saved: dict, now: dict) -> list[SettingsChange]:
    """The settings (dotted names) whose values differ between a saved config tree (a
    checkpoint's config.yaml) and this run's (`to_dict`), in the order of this run's tree. A
    setting the saved tree lacks (written by an earlier version) counts as its default."""
    defaults = _flatten(to_dict(Config()))
    old, new = _flatten(saved), _flatten(now)
    return [SettingsChange(name, old.get(name, defaults.get(name)), value) for name, value in new.items()
            if name not in RESUME_IGNORED and old.get(name, defaults.get(name)) != value]
