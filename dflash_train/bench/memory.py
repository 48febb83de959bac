"""The memory planner (`dflash-train plan`): per-GPU memory of a training layout, from the target's
config.json and the run's settings, before anything loads.

Owns: the target's parameters counted from its config (dense and mixture-of-experts decoders of
the Llama, Mistral, Qwen2/3 and Mixtral families, every expert counted; another family is counted
on a meta-device model), the drafter's from the drafter settings, the largest micro-batch of a run
(`MicroBatch`: the worst case the batch plan allows, or a bench workload's own batches), and per
GPU of a `Layout` (colocated or disaggregated, the target tensor-parallel over `target_tp` GPUs,
the drafter replicated or sharded with FSDP) the bytes of the target's shard, its forward on one
micro-batch, the drafter's weights, gradients and AdamW state, and the drafter step's activations
(`plan_memory`); then the candidate layouts of N GPUs planned and ordered, those that fit first
(`plan_layouts`), and the check a run could make before it loads (`check_fits`).

The activation terms are counted from the tensors the step keeps (core/drafter.py, core/loss.py,
train/produce.py) and scaled by constants fixed on the project's measured peaks
(`ACTIVATION_SCALE`). The figures are torch's `max_memory_allocated`, what the bench and the
training log report as `peak_memory_gib`; the usable memory of a GPU leaves room for what that
figure does not count (`usable_bytes`). Nothing here loads weights or touches a GPU.

Shape legend: T packed context tokens, N blocks, B block size, Q = N*B query tokens, S = T + Q
key/value tokens, H hidden size, I MLP width, V vocabulary, P parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from transformers import AutoModelForCausalLM

from dflash_train.bench.flops import Shape
from dflash_train.bench.workloads import WORKLOADS, synthetic_dataset
from dflash_train.core.config import Config, ConfigError, runs_whole_target
from dflash_train.core.drafter import default_target_layer_ids
from dflash_train.core.errors import InputError
from dflash_train.core.masks import anchor_count, padded_anchor_count
from dflash_train.core.target import tensor_parallel_problems
from dflash_train.data.batching import PAD_MULTIPLE, BatchStream
from dflash_train.train.loop import batch_plan

GIB = 2**30
BF16, FP32 = 2, 4
# The drafter's master weights and AdamW's two moments are float32 (train/loop.py
# trainable_drafter, train/step.py), always held; its float32 gradients exist from the first
# backward of a step to the optimizer step (zero_grad(set_to_none=True)); under autocast each
# matmul keeps the bf16 copy of its weight for the backward.
DRAFTER_STATE_BYTES = 3 * FP32
GRADIENT_BYTES = FP32
AUTOCAST_COPY_BYTES = BF16
# Model families whose parameters are counted from their config fields; others on a meta model.
COUNTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
# Of a GPU's memory, what `max_memory_allocated` never sees: the CUDA context and NCCL's buffers
# (a fixed amount), and the caching allocator's reserved but unallocated blocks (a share).
CONTEXT_GIB = 1.5
FRAGMENTATION = 0.05
TIGHT = 0.9  # a plan above this share of the usable memory is "tight"


# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class DecoderShape:
    """The parameter shapes of a decoder stack (a target, or a drafter's layers)."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    sparse: tuple[bool, ...] = ()
    """Per layer: its MLP is the mixture of experts (else dense, `intermediate` wide)."""

    @classmethod
    def of(cls, config) -> "DecoderShape":
        """The shape of a transformers config (its text part)."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        kind, base = str(getattr(c, "model_type", "")), Shape.of(c)  # the matmul widths, as the FLOP count reads them
        layers = int(c.num_hidden_layers)
        experts = int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0)
        qwen2 = kind in ("qwen2", "qwen2_moe")
        return cls(kind, base.hidden, base.intermediate, layers, base.heads, base.kv_heads, base.head_dim, base.vocab,
                   tied=bool(getattr(c, "tie_word_embeddings", False)),
                   qkv_bias=qwen2 or bool(getattr(c, "attention_bias", False)),
                   o_bias=not qwen2 and bool(getattr(c, "attention_bias", False)),
                   qk_norm=kind in ("qwen3", "qwen3_moe"), mlp_bias=bool(getattr(c, "mlp_bias", False)),
                   experts=experts, experts_per_token=int(getattr(c, "num_experts_per_tok", 0) or 0),
                   expert_intermediate=int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size),
                   shared_expert_intermediate=int(getattr(c, "shared_expert_intermediate_size", 0) or 0),
                   sparse=sparse_layers(c, layers, experts))

    @property
    def attention_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (2 * self.hidden * q + 2 * self.hidden * kv + (q + 2 * kv) * self.qkv_bias
                + self.hidden * self.o_bias + 2 * self.head_dim * self.qk_norm)

    def mlp_params(self, layer: int) -> int:
        H = self.hidden
        if not (self.sparse and self.sparse[layer]):
            return 3 * H * self.intermediate + (2 * self.intermediate + H) * self.mlp_bias
        shared = 3 * H * self.shared_expert_intermediate + H if self.shared_expert_intermediate else 0
        return self.experts * (H + 3 * H * self.expert_intermediate) + shared

    def layer_params(self, layer: int) -> int:
        return self.attention_params + self.mlp_params(layer) + 2 * self.hidden

    def head_params(self) -> int:
        """Embedding and lm_head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)


def sparse_layers(c, layers: int, experts: int) -> tuple[bool, ...]:
    """Which layers' MLP is the mixture of experts: every one (Mixtral), or as Qwen's MoE configs
    say (decoder_sparse_step, mlp_only_layers); none for a dense model."""
    if not experts:
        return ()
    step = int(getattr(c, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(c, "mlp_only_layers", None) or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


@dataclass(frozen=True)
class TargetModel:
    """The target as the planner sees it: its shape, and its exact parameter count per layer
    (from the fields for COUNTED_FAMILIES, else from a meta-device model: no weights)."""

    shape: DecoderShape
    layer_params: tuple[int, ...]
    head_params: int
    other_params: int
    """Final norm (and whatever a meta-counted family has outside its layers and heads)."""
    config: object = field(default=None, compare=False, repr=False)
    """The transformers config it was counted from (tensor-parallel checks read it)."""

    @classmethod
    def of(cls, config) -> "TargetModel":
        shape = DecoderShape.of(config)
        if shape.model_type in COUNTED_FAMILIES:
            return cls(shape, tuple(shape.layer_params(i) for i in range(shape.layers)), shape.head_params(),
                       shape.hidden, config)
        return meta_counted(config, shape)

    def parameters(self, kept_layers: int | None = None) -> int:
        """Every parameter with the first `kept_layers` layers (default: all), the embedding,
        final norm and lm_head included."""
        kept = self.shape.layers if kept_layers is None else kept_layers
        return self.head_params + self.other_params + sum(self.layer_params[:kept])


def meta_counted(config, shape: DecoderShape) -> TargetModel:
    """Per-layer parameter counts of a family the fields do not describe, read off a model built
    on the meta device (shapes only: nothing is allocated or loaded)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = [0] * shape.layers
    heads = other = 0
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    head_ids = {id(embed.weight)} | ({id(head.weight)} if head is not None else set())
    for name, p in model.named_parameters():
        index = layer_index(name)
        if id(p) in head_ids:
            heads += p.numel()
        elif index is not None and index < shape.layers:
            layers[index] += p.numel()
        else:
            other += p.numel()
    return TargetModel(shape, tuple(layers), heads, other, config)


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter name belongs to (`...layers.7.mlp...` -> 7), or None."""
    parts = name.split(".")
    for before, part in zip(parts, parts[1:]):
        if before == "layers" and part.isdigit():
            return int(part)
    return None


@dataclass(frozen=True)
class DrafterModel:
    """The drafter the settings build for the target (core/drafter.py build_drafter_config)."""

    shape: DecoderShape
    taps: tuple[int, ...]
    """The tapped target layers."""

    @classmethod
    def of(cls, target: DecoderShape, cfg: Config) -> "DrafterModel":
        d = cfg.drafter
        try:
            taps = d.target_layer_ids or default_target_layer_ids(target.layers, d.num_taps or d.num_layers)
        except ValueError as err:
            raise ConfigError([f"drafter.num_taps: {err}"]) from err
        bad = [i for i in taps if not 0 <= i < target.layers - 1]
        if bad:
            raise ConfigError([f"drafter.target_layer_ids: {bad} are not layers of the target that can be tapped "
                               f"(0 to {target.layers - 2}); choose others or leave it unset"])
        shape = DecoderShape("dflash", target.hidden, int(d.intermediate_size or target.intermediate), d.num_layers,
                             target.heads, target.kv_heads, target.head_dim, target.vocab, qk_norm=True)
        return cls(shape, tuple(int(i) for i in taps))

    @property
    def fc_params(self) -> int:
        return len(self.taps) * self.shape.hidden ** 2

    def parameters(self) -> int:
        """Every parameter: fc over the taps, the layers, hidden_norm and the final norm (the
        target's embedding and lm_head are not the drafter's)."""
        s = self.shape
        return self.fc_params + sum(s.layer_params(i) for i in range(s.layers)) + 2 * s.hidden


# --------------------------------------------------------------------------- micro-batches


@dataclass(frozen=True)
class MicroBatch:
    """The largest micro-batch of a run, in the sizes that set its memory."""

    target_tokens: int
    """Rows x padded length of the largest target batch (at most data.token_budget)."""
    context_tokens: int
    """Tokens of the packed row the drafter reads (data.token_budget: every row is padded to it)."""
    blocks: int
    """Blocks of the packed row, padded as the step pads them (train.anchor_multiple, buckets)."""
    real_blocks: int
    """Of which real: what the loss scores (at least one lm_head chunk's worth)."""
    source: str
    """How the sizes were found, in words."""
    supervised_share: float = 1.0
    """The worst case's share of supervised tokens in a sample (worst_case_micro_batch)."""


def worst_case_micro_batch(cfg: Config, supervised_share: float = 1.0) -> MicroBatch:
    """The largest micro-batch the batch plan allows on any data: for each bucket length L a batch
    may have (data.bucket_boundaries, else every multiple of the derived boundaries' rounding up to
    data.max_length), min(max_batch_size, token_budget // L) samples of L tokens, each with
    min(num_anchors, candidates) anchors, where a sample of L tokens with `supervised_share` of
    them supervised has ceil(share * L) - 1 anchor candidates (a supervised position whose next
    one is supervised)."""
    d, o, t = cfg.data, cfg.objective, cfg.train
    longest = -(-d.max_length // PAD_MULTIPLE) * PAD_MULTIPLE
    lengths = d.bucket_boundaries or range(PAD_MULTIPLE, longest + 1, PAD_MULTIPLE)
    best_blocks = best_tokens = 0
    for L in lengths:
        rows = min(d.max_batch_size, d.token_budget // L)
        candidates = max(0, math.ceil(supervised_share * min(L, d.max_length)) - 1)
        best_blocks = max(best_blocks, rows * min(o.num_anchors, candidates))
        best_tokens = max(best_tokens, rows * L)
    blocks = padded_anchor_count(best_blocks, t.anchor_multiple, t.anchor_buckets_per_doubling)
    share = f", {supervised_share:g} of each sample supervised" if supervised_share < 1 else ""
    return MicroBatch(min(best_tokens, d.token_budget), d.token_budget, blocks, best_blocks,
                      f"the worst case of the batch plan{share}", supervised_share)


def bench_micro_batch(workload: str, cfg: Config, warmup: int | None = None, steps: int | None = None) -> MicroBatch:
    """The largest of the micro-batches a one-process `dflash-train bench --workload NAME` times
    (those after its warm-up; the bench's peak is read over them), from its synthetic data."""
    wl = WORKLOADS[workload]
    dataset = synthetic_dataset(wl, cfg.drafter.mask_token_id, cfg.train.seed)
    stream = BatchStream(dataset, batch_plan(cfg, dataset["length"]))
    per_step = cfg.train.grad_accum
    first = (warmup if warmup is not None else wl.warmup if wl.warmup is not None
             else stream.plan.num_batches) * per_step
    real = tokens = 0
    for g in range(first, first + (steps or wl.steps) * per_step):
        batch = stream[g]
        real = max(real, anchor_count(batch.loss_mask, batch.lengths, cfg.objective.num_anchors))
        tokens = max(tokens, batch.input_ids.numel())
    blocks = padded_anchor_count(real, cfg.train.anchor_multiple, cfg.train.anchor_buckets_per_doubling)
    return MicroBatch(tokens, cfg.data.token_budget, blocks, real, f"the timed batches of the {workload} bench")


# --------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class SavedBytes:
    """Bytes the drafter's autograd keeps per layer for one token, by the width they scale with
    (bf16 activations are 2 bytes an element, float32 ones 4)."""

    query_hidden: float
    """x H per query token: the layer's input and the residual after attention (the norms'
    inputs), their normed outputs (the projections' inputs) where they are kept."""
    query_heads: float
    """x Hq*Dh per query token: q before its norm, q after rope (attention's input), the
    attention output (o_proj's input)."""
    query_mlp: float
    """x I per query token: gate and up outputs, SiLU(gate) and the product where kept."""
    kv_hidden: float
    """x H per key/value token: [context ; block] as k_proj / v_proj read it."""
    kv_heads: float
    """x Hkv*Dh per key/value token: k before its norm, k after rope, v."""


# Compiled layers (train.compile): inductor keeps the layer's inputs and the matmuls' outputs and
# recomputes norms, rope and SiLU in the backward.
COMPILED_SAVED = SavedBytes(query_hidden=6, query_heads=6, query_mlp=6, kv_hidden=0, kv_heads=4)
# Eager layers: every op keeps its own inputs; the RMSNorm's float32 upcast (4 bytes) is kept
# besides its bf16 output, and rope keeps q, k and their rotations.
EAGER_SAVED = SavedBytes(query_hidden=16, query_heads=10, query_mlp=8, kv_hidden=2, kv_heads=10)
# The lm_head loss's live [chunk rows, V] buffers, in bytes per element: the Triton kernel writes
# the softmax over the bf16 logits in place; torch keeps the logits and a float32 log-softmax
# (then the bf16 softmax beside it); distillation holds float32 log p, log q and p at once.
LOSS_CHUNK_BYTES = {"triton": 2, "torch": 6, "compiled": 4, "distill": 14}
# One factor on every activation term (the layers, what the step keeps outside them, the transient
# buffers, the target forward), fixed on two measured peaks of the bench on one H100
# (docs/results/2026-12-06-layers-before-after-h100.md): smollm2 13.33 GiB and w2 (bf16) 53.56 GiB.
# Unscaled, the planner read 12.95 and 54.12 GiB (-2.9% / +1.0%); 1.01 splits the error between
# them (13.07 / 54.38 GiB, -1.9% / +1.5%). The saved-tensor bytes per element (COMPILED_SAVED,
# EAGER_SAVED) were counted on CPU with saved-tensor hooks on one drafter layer, eager and compiled
# by inductor, one width varied at a time. Checked, not fitted: paper (bf16) 60.08 GiB on one H200
# (docs/results/2026-12-04-baseline-beside-code-paper-bf16.md): 61.04, +1.6%.
ACTIVATION_SCALE = 1.01


@dataclass(frozen=True)
class StepBytes:
    """The drafter step's activations on one drafter rank, in bytes."""

    layers: float
    """What the drafter's layers keep for the backward (all layers)."""
    outside: float
    """What the step keeps outside the layers: the shipment's features (fc's input), the
    context (fc and hidden_norm), the block embeddings, the final hidden states, the loss's
    scored rows and their gradient."""
    transient: float
    """The larger of one lm_head loss chunk and one layer's backward buffers."""
    weight_copies: float
    """The bf16 copies of the drafter's weights autocast makes for its matmuls."""

    @property
    def total(self) -> float:
        return self.layers + self.outside + self.transient + self.weight_copies


def loss_chunk_kind(cfg: Config) -> str:
    """Which LOSS_CHUNK_BYTES a CUDA run's loss chunk takes (compilation.loss_kernel's rule)."""
    if cfg.objective.labels == "distill":
        return "distill"
    if cfg.train.loss_kernel in ("auto", "triton"):
        return "triton"
    return "compiled" if cfg.train.compile else "torch"


def drafter_step_bytes(drafter: DrafterModel, mb: MicroBatch, cfg: Config) -> StepBytes:
    """The activations of one drafter step on `mb` (the shapes of train/step.py forward)."""
    s, B = drafter.shape, cfg.drafter.block_size
    H, I, q, kv = s.hidden, s.intermediate, s.heads * s.head_dim, s.kv_heads * s.head_dim
    T, Q = mb.context_tokens, mb.blocks * B
    S = T + Q
    c = COMPILED_SAVED if cfg.train.compile else EAGER_SAVED
    per_layer = Q * (c.query_hidden * H + c.query_heads * q + c.query_mlp * I) + S * (c.kv_hidden * H + c.kv_heads * kv)
    # The loss scores at least one chunk's worth of blocks (step.py), B - 1 rows of each.
    chunk_rows = cfg.objective.lm_head_chunk_rows
    min_blocks = -(-max(1, chunk_rows) // (B - 1))
    scored = min(mb.blocks, max(mb.real_blocks, min_blocks)) * (B - 1)
    distill = cfg.objective.labels == "distill"
    norm_bytes = BF16 * 2 if cfg.train.compile else BF16 * 2 + FP32
    outside = (T * len(drafter.taps) * H * BF16 + T * H * norm_bytes + Q * H * (BF16 + norm_bytes)
               + scored * H * BF16 * (3 if distill else 2))
    chunk = min(chunk_rows, scored) * s.vocab * LOSS_CHUNK_BYTES[loss_chunk_kind(cfg)]
    # One layer's gradient buffers in the backward (the MLP's three [Q, I] and the residual's,
    # the attention's key/value gradients): an estimate, covered by ACTIVATION_SCALE's fit only.
    backward = BF16 * (Q * (3 * I + 4 * H) + S * (H + 2 * kv))
    return StepBytes(ACTIVATION_SCALE * s.layers * per_layer, ACTIVATION_SCALE * outside,
                     ACTIVATION_SCALE * max(chunk, backward), AUTOCAST_COPY_BYTES * drafter.parameters())


def target_forward_bytes(target: TargetModel, drafter: DrafterModel, mb: MicroBatch, cfg: Config, tp: int) -> float:
    """The peak of one target forward (no gradients, no key/value cache) on one rank of its
    tensor-parallel group: the residual stream and its normed copy, the tapped layers' outputs
    held until they are concatenated, and the larger of a layer's attention and MLP buffers
    (the MLP's gate, up and product; for a mixture of experts, the routed copies of each token);
    then packing the features into the drafter's row with the training noise (float32)."""
    s, taps = target.shape, len(drafter.taps)
    H, Tt = s.hidden, mb.target_tokens
    attention = (2 * s.heads + 2 * s.kv_heads) * s.head_dim / tp
    if s.experts:  # each token's routed copies and their expert activations, the float32 router logits
        mlp = s.experts_per_token * (H + 3 * s.expert_intermediate / tp) + s.experts * FP32 / BF16
        mlp += 3 * s.shared_expert_intermediate / tp
    else:
        mlp = 3 * s.intermediate / tp
    forward = Tt * BF16 * ((taps + 2) * H + max(attention, mlp))
    if runs_whole_target(cfg.objective.labels):  # its final state, and the greedy tokens' lm_head chunks
        forward += Tt * H * BF16 + (1024 * s.vocab * BF16 if cfg.objective.labels == "target" else 0)
    noised = cfg.objective.noise != "none" and cfg.objective.noise_std > 0 and not cfg.topology.split_fc
    features = taps * H * (Tt * BF16 + mb.context_tokens * (BF16 + (FP32 + BF16) * noised))
    return ACTIVATION_SCALE * max(forward, features)


def shipment_bytes(drafter: DrafterModel, mb: MicroBatch, cfg: Config) -> float:
    """One packed micro-batch as it travels (train/produce.py Shipment): the features, the ids,
    mask and labels, and for distillation the target's final state."""
    H, T = drafter.shape.hidden, mb.context_tokens
    distill = cfg.objective.labels == "distill"
    return T * (len(drafter.taps) * H * BF16 + 8 + 1 + 8 + H * BF16 * distill)


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """How the GPUs of a run are used (topology.mode, topology.num_target_ranks,
    topology.target_tp, train.fsdp)."""

    gpus: int
    """GPUs per node."""
    mode: str = "colocated"
    target_ranks: int | None = None
    """Disaggregated: the target ranks of each node (the others train the drafter)."""
    target_tp: int = 1
    """GPUs one target is split over (tensor parallel)."""
    fsdp: bool = False
    """The drafter's weights, gradients and optimizer state sharded over the drafter ranks."""
    nodes: int = 1

    @property
    def drafter_ranks(self) -> int:
        """Drafter ranks over all nodes."""
        per_node = self.gpus if self.mode == "colocated" else self.gpus - (self.target_ranks or 0)
        return per_node * self.nodes

    def name(self) -> str:
        where = "colocated" if self.mode == "colocated" else \
            f"disaggregated {self.target_ranks} target + {self.gpus - self.target_ranks} drafter"
        return f"{where}, target TP {self.target_tp}, drafter {'FSDP' if self.fsdp else 'replicated'}"

    def problems(self, target_config) -> list[str]:
        """Why this layout cannot run the target at all (not memory), in words: the trainer's
        own checks of the split (train/dist.py) and of the target's tensor-parallel plan
        (core/target.py tensor_parallel_problems)."""
        p, tp = [], self.target_tp
        group = self.gpus if self.mode == "colocated" else self.target_ranks
        if self.mode == "disaggregated" and self.gpus < 2:
            p.append(f"--target-ranks: a disaggregated layout needs a target and a drafter rank on each node, "
                     f"at least 2 GPUs, got --gpus {self.gpus}")
        elif self.mode == "disaggregated" and not (self.target_ranks and 1 <= self.target_ranks < self.gpus):
            p.append(f"--target-ranks must leave a drafter rank on each node: 1 to {self.gpus - 1}, "
                     f"got {self.target_ranks}")
        elif tp < 1 or group % tp:
            p.append(f"--target-tp {tp} must divide the {group} target GPUs of a node")
        elif target_config is not None:
            p += tensor_parallel_problems(target_config, tp, "--target-tp")
        return p


@dataclass(frozen=True)
class RankMemory:
    """One kind of GPU of a layout and what its peak is made of, in bytes."""

    role: str
    gpus: int
    """GPUs of this role per node."""
    target_weights: float = 0
    target_forward: float = 0
    """The target forward's own peak on this GPU (before the drafter step)."""
    drafter_states: float = 0
    """Drafter weights and AdamW's moments (this rank's shard with FSDP)."""
    drafter_grads: float = 0
    """The drafter's gradients (this rank's shard with FSDP)."""
    drafter_step: float = 0
    """The drafter step's own peak: activations, autocast's weight copies, FSDP's gathered layers."""
    optimizer: float = 0
    """What the optimizer stage adds to the gradients: the all-reduce's flat copy of them."""
    buffers: float = 0
    """Always held besides: shipments in flight, an evaluation's copy of the target."""
    graphs: bool = False
    """The target forward replays CUDA graphs, whose memory pool stays held under the step."""
    accumulated: float = 0
    """Held through a step's later micro-batches when it has several: the gradients (with FSDP
    unsharded, and the unsharded weights with them, until the last micro-batch's backward)."""

    @property
    def states(self) -> float:
        return self.drafter_states + self.drafter_grads

    @property
    def total(self) -> float:
        """The peak: what is always held, plus the largest of the stages that take turns (the
        target forward, the drafter step, the optimizer step), the target's graph pool held
        under all of them."""
        held = self.target_weights + self.drafter_states + self.buffers + self.target_forward * self.graphs
        grads = self.accumulated
        stages = (self.target_forward * (not self.graphs) + grads, self.drafter_step + grads,
                  self.drafter_grads + self.optimizer)
        return held + max(stages)


def usable_bytes(gpu_memory_gib: float) -> float:
    """Of a GPU of `gpu_memory_gib`, what the planned peaks may take."""
    return (gpu_memory_gib * (1 - FRAGMENTATION) - CONTEXT_GIB) * GIB


@dataclass(frozen=True)
class MemoryPlan:
    """A layout's per-GPU memory against the GPU's."""

    layout: Layout
    ranks: tuple[RankMemory, ...]
    usable: float
    """Bytes a GPU's peak may take (usable_bytes)."""
    problems: tuple[str, ...] = ()
    """Why the layout cannot run this target at all, whatever the memory."""

    @property
    def peak(self) -> float:
        return max(r.total for r in self.ranks)

    @property
    def verdict(self) -> str:
        if self.problems or self.peak > self.usable:
            return "does not fit"
        return "tight" if self.peak > TIGHT * self.usable else "fits"

    @property
    def fits(self) -> bool:
        return self.verdict != "does not fit"


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Planner:
    """What every layout of one run shares: the target, the drafter, the largest micro-batch and
    the settings (`Planner.of`); `plan(layout)` is one layout's MemoryPlan."""

    target: TargetModel
    drafter: DrafterModel
    micro_batch: MicroBatch
    cfg: Config
    gpu_memory_gib: float = 80.0

    @classmethod
    def of(cls, target_config, cfg: Config, micro_batch: MicroBatch | None = None,
           gpu_memory_gib: float = 80.0) -> "Planner":
        target = target_config if isinstance(target_config, TargetModel) else TargetModel.of(target_config)
        drafter = DrafterModel.of(target.shape, cfg)
        return cls(target, drafter, micro_batch or worst_case_micro_batch(cfg), cfg, gpu_memory_gib)

    @property
    def kept_layers(self) -> int:
        """Target layers a training target keeps: through the last tap, or all of them where the
        labels need its last layer (core/target.py Target)."""
        if runs_whole_target(self.cfg.objective.labels):
            return self.target.shape.layers
        return max(self.drafter.taps) + 1

    def target_weights(self, tp: int) -> float:
        """The bf16 target on one rank of its tensor-parallel group: the kept layers split over
        the group, the embedding and final norm whole; an untied lm_head split by vocabulary rows
        plus the whole copy gathered from it (core/target.py Target: the drafter's loss and block
        embeddings read whole weights)."""
        t = self.target
        heads = t.head_params
        if tp > 1 and not t.shape.tied:
            heads += t.head_params / 2 / tp
        return BF16 * (sum(t.layer_params[: self.kept_layers]) / tp + heads + t.other_params)

    def drafter_parts(self, layout: Layout) -> dict:
        """The drafter's fields of a RankMemory on one drafter rank: weights and AdamW state,
        gradients (sharded with FSDP), the step's activations (with FSDP, two layers gathered at
        once: the one computed and the one prefetched, float32 weights and their unreduced
        gradients), the optimizer stage (without FSDP over several ranks, the flat float32 copy
        of the gradients the all-reduce sends: train/dist.py), and what a step of several
        micro-batches holds through them (with FSDP on one rank, unsharded gradients and
        weights; over several it reduces and reshards after every micro-batch:
        train/sharding.py)."""
        P, fsdp = self.drafter.parameters(), layout.fsdp
        shards = layout.drafter_ranks if fsdp else 1
        step = drafter_step_bytes(self.drafter, self.micro_batch, self.cfg).total
        if fsdp:
            step += 2 * max(self.drafter.fc_params, self.drafter.shape.layer_params(0)) * (FP32 + GRADIENT_BYTES)
        accumulated = 0.0
        if self.cfg.train.grad_accum > 1 and not (fsdp and shards > 1):
            accumulated = (GRADIENT_BYTES + FP32) * P if fsdp else GRADIENT_BYTES * P
        flat = GRADIENT_BYTES * P if layout.drafter_ranks > 1 and not fsdp else 0.0
        return dict(drafter_states=DRAFTER_STATE_BYTES * P / shards, drafter_grads=GRADIENT_BYTES * P / shards,
                    drafter_step=step, optimizer=flat, accumulated=accumulated)

    def evaluation_copies(self, layout: Layout) -> float:
        """What the leader loads for evaluation during training: the whole target for served
        tau (eval.prompts); a training target for walked tau (data.validation) where the rank
        holds no whole one (a disaggregated drafter rank, a tensor-parallel target); with FSDP,
        the drafter's weights gathered whole (eval/during_training.py, train/sharding.py)."""
        e, cfg = self.cfg.eval, self.cfg
        if not e.every:
            return 0.0
        served = BF16 * self.target.parameters() if e.prompts is not None else 0.0
        own = layout.mode == "colocated" and layout.target_tp == 1
        walked = self.target_weights(1) if cfg.data.validation and not own else 0.0
        gathered = FP32 * self.drafter.parameters() if layout.fsdp else 0.0
        return served + walked + gathered

    def plan(self, layout: Layout) -> MemoryPlan:
        """The per-GPU memory of `layout`: one RankMemory per kind of GPU (colocated: one kind;
        disaggregated: target ranks and drafter ranks)."""
        cfg, mb, tp = self.cfg, self.micro_batch, layout.target_tp
        forward = target_forward_bytes(self.target, self.drafter, mb, cfg, tp)
        graphs = cfg.target.cuda_graphs and tp == 1  # a tensor-parallel target runs eagerly (train/loop.py)
        drafter, evaluation = self.drafter_parts(layout), self.evaluation_copies(layout)
        shipment = shipment_bytes(self.drafter, mb, cfg)
        if layout.mode == "colocated":  # with TP, a rank's own shipment waits through its group's other forwards
            ranks = (RankMemory("target + drafter", layout.gpus, self.target_weights(tp),
                                forward + shipment * (tp > 1), buffers=evaluation, graphs=graphs, **drafter),)
        else:
            producers = layout.target_ranks // tp * layout.nodes  # a target group's first rank packs and sends
            in_flight = math.ceil(cfg.topology.queue_depth * layout.drafter_ranks / producers)
            ranks = (RankMemory("target", layout.target_ranks, self.target_weights(tp), forward, graphs=graphs,
                                buffers=in_flight * shipment),
                     RankMemory("drafter", layout.gpus - layout.target_ranks, BF16 * self.target.head_params,
                                buffers=evaluation, **drafter))
        return MemoryPlan(layout, ranks, usable_bytes(self.gpu_memory_gib), tuple(layout.problems(self.target.config)))


def plan_memory(target_config, cfg: Config, layout: Layout, micro_batch: MicroBatch | None = None,
                gpu_memory_gib: float = 80.0) -> MemoryPlan:
    """The per-GPU memory of training `cfg` on `layout` for a target of `target_config` (a
    transformers config, or a TargetModel), its largest micro-batch `micro_batch` (default: the
    worst case the batch plan allows), on GPUs of `gpu_memory_gib`. Pure: reads nothing."""
    return Planner.of(target_config, cfg, micro_batch, gpu_memory_gib).plan(layout)


# --------------------------------------------------------------------------- layouts of N GPUs


def candidate_layouts(gpus: int, nodes: int = 1) -> list[Layout]:
    """The layouts of `gpus` GPUs per node: colocated with every target TP that divides the node,
    and disaggregated with every split of target and drafter ranks and every TP dividing the
    target ranks; each with the drafter replicated and, where there are several drafter ranks,
    sharded with FSDP."""
    layouts = []
    for tp in divisors(gpus):
        layouts += [Layout(gpus, "colocated", None, tp, fsdp, nodes) for fsdp in (False, True)
                    if not fsdp or gpus * nodes > 1]
    for k in range(1, gpus):
        for tp in divisors(k):
            layouts += [Layout(gpus, "disaggregated", k, tp, fsdp, nodes) for fsdp in (False, True)
                        if not fsdp or (gpus - k) * nodes > 1]
    return layouts


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def order_key(plan: MemoryPlan) -> tuple:
    """Layouts that fit first, then the tight ones, each in the order a run would try them:
    colocated (no GPU waits on another's stage), the smallest target TP (the least communication
    in its forward), the drafter replicated (no gathers per layer), the most drafter ranks; then
    those that do not fit, by their peak."""
    lay = plan.layout
    if not plan.fits:
        return (2, plan.peak)
    return (int(plan.verdict == "tight"), lay.mode != "colocated", lay.target_tp, lay.fsdp, -lay.drafter_ranks,
            plan.peak)


def plan_layouts(planner: Planner, gpus: int, nodes: int = 1) -> list[MemoryPlan]:
    """Every candidate layout of `gpus` GPUs per node that can run the target, planned, best
    first (order_key)."""
    plans = [planner.plan(layout) for layout in candidate_layouts(gpus, nodes)]
    return sorted((p for p in plans if not p.problems), key=order_key)


# The settings a refusal proposes to lower, in this order: fewer anchors per sample keeps the
# batches' shapes; a smaller token budget makes every batch smaller.
SHRINKABLE = (("objective", "num_anchors", 1), ("data", "token_budget", PAD_MULTIPLE))


def with_setting(cfg: Config, section: str, key: str, value: int) -> Config:
    """`cfg` with one setting changed (data.max_length lowered with a smaller data.token_budget)."""
    changed = {key: value}
    if key == "token_budget":
        changed["max_length"] = min(value, cfg.data.max_length)
    return replace(cfg, **{section: replace(getattr(cfg, section), **changed)})


def largest_fitting(planner: Planner, layout: Layout, section: str, key: str, step: int) -> int | None:
    """The largest value of setting `section.key` (a multiple of `step`, at most the run's) with
    which `layout` fits, the worst-case micro-batch made again for it; None when none does, or
    when the micro-batch is not the batch plan's worst case (a bench's own batches)."""
    if not planner.micro_batch.source.startswith("the worst case"):
        return None
    share = planner.micro_batch.supervised_share

    def fits(value: int) -> bool:
        cfg = with_setting(planner.cfg, section, key, value)
        return replace(planner, cfg=cfg, micro_batch=worst_case_micro_batch(cfg, share)).plan(layout).fits

    low, high = 0, getattr(getattr(planner.cfg, section), key) // step
    while low < high:  # the largest m with fits(m * step), by bisection (memory grows with the setting)
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle - 1)
    return low * step or None


def smaller_settings(planner: Planner, layout: Layout) -> list[str]:
    """The settings (one SHRINKABLE lowered as little as it must) with which `layout` fits."""
    found = []
    for section, key, step in SHRINKABLE:
        value = largest_fitting(planner, layout, section, key, step)
        if value:
            lower = (f" data.max_length={value}" if key == "token_budget" and value < planner.cfg.data.max_length
                     else "")
            found.append(f"{section}.{key}={value}{lower}")
    return found


# --------------------------------------------------------------------------- verdicts in words


def gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def peak_parts(rank: RankMemory) -> str:
    """The largest parts of a GPU's peak, in words."""
    parts = {"target weights": rank.target_weights, "target forward": rank.target_forward,
             "drafter weights, gradients and AdamW": rank.states, "drafter step": rank.drafter_step,
             "buffers and evaluation": rank.buffers}
    largest = sorted(((v, k) for k, v in parts.items() if v >= 0.05 * GIB), reverse=True)[:3]
    return ", ".join(f"{k} {gib(v)}" for v, k in largest)


def layout_flags(layout: Layout) -> str:
    """The `dflash-train plan` options that name a layout."""
    flags = [f"--target-tp {layout.target_tp}"]
    if layout.mode == "disaggregated":
        flags.append(f"--target-ranks {layout.target_ranks}")
    return " ".join(flags + (["--fsdp"] if layout.fsdp else []))


def refusal(planner: Planner, plan: MemoryPlan, named: bool = True) -> str:
    """One line: why `plan`'s layout does not fit (`named`: the layout asked for; else the
    lowest peak of all the layouts, none of which fits) and what would: another layout of the
    same GPUs, a smaller data.token_budget, or more GPUs."""
    lay = plan.layout
    if plan.problems:
        return f"{lay.name()}: {'; '.join(plan.problems)}"
    worst = max(plan.ranks, key=lambda r: r.total)
    need = (f"its {worst.role} GPUs need {gib(worst.total)} GiB each ({peak_parts(worst)}), over the "
            f"{gib(plan.usable)} GiB usable of a {planner.gpu_memory_gib:g} GiB GPU")
    if not named:
        return f"no layout of {gpus(lay)} fits these settings; the lowest peak, {lay.name()}: {need}; " \
               f"{what_fits(planner, lay)}"
    said = f"{lay.name()} on {gpus(lay)} does not fit: {need}"
    others = [p for p in plan_layouts(planner, lay.gpus, lay.nodes) if p.fits]
    smaller = smaller_settings(planner, lay)
    alone = f"; this layout fits with {' or with '.join(smaller)}" if smaller else ""
    if others:
        best = others[0]
        return f"{said}; {best.layout.name()} fits at {gib(best.peak)} GiB ({layout_flags(best.layout)}){alone}"
    return f"{said}; no layout of {gpus(lay)} fits these settings; {what_fits(planner, lay)}{alone}"


def gpus(layout: Layout) -> str:
    count = layout.gpus * layout.nodes
    return f"{count} GPU{'s' if count > 1 else ''}"


def what_fits(planner: Planner, layout: Layout) -> str:
    """Where no layout of `layout`'s GPUs fits these settings: the layout that fits with the
    least lowered (the most anchors per sample kept, else the largest token budget), and with
    what; or that none does."""
    best, most = None, (0, 0)
    for other in candidate_layouts(layout.gpus, layout.nodes):
        if other.problems(planner.target.config):
            continue
        kept = tuple(largest_fitting(planner, other, *shrink) or 0 for shrink in SHRINKABLE)
        if kept > most:
            best, most = other, kept
    if best is None:
        return ("none fits at any objective.num_anchors or data.token_budget: use more GPUs, or a smaller "
                "drafter (drafter.num_layers)")
    return (f"{best.name()} fits with {' or with '.join(smaller_settings(planner, best))} ({layout_flags(best)}; "
            f"with a smaller token budget, raise train.grad_accum to keep the batch), or use more GPUs")


def check_fits(target_config, cfg: Config, layout: Layout, micro_batch: MicroBatch | None = None,
               gpu_memory_gib: float = 80.0) -> MemoryPlan:
    """`plan_memory`, raising InputError (one line, with what would fit) when the layout does
    not fit: what a run can check before it loads anything."""
    planner = Planner.of(target_config, cfg, micro_batch, gpu_memory_gib)
    plan = planner.plan(layout)
    if not plan.fits:
        raise InputError(refusal(planner, plan))
    return plan


COLUMNS = ("layout", "GPUs", "target", "target fwd", "drafter states", "drafter step", "buffers", "peak", "verdict")


def table_rows(plans: list[MemoryPlan]) -> list[tuple[str, ...]]:
    """One row per kind of GPU of each plan (GiB), the layout named on its first row only."""
    rows = []
    for plan in plans:
        for i, r in enumerate(plan.ranks):
            rows.append((plan.layout.name() if i == 0 else "", f"{r.gpus} x {r.role}", gib(r.target_weights),
                         gib(r.target_forward), gib(r.states), gib(r.drafter_step), gib(r.buffers), gib(r.total),
                         plan.verdict if i == 0 else ""))
    return rows


def format_table(plans: list[MemoryPlan]) -> list[str]:
    """The plans as an aligned text table, a header line first."""
    rows = [COLUMNS, *table_rows(plans)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(COLUMNS))]
    right = range(2, len(COLUMNS) - 1)
    return ["  ".join(cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths)))
            .rstrip() for row in rows]


def plan_summary(planner: Planner) -> list[str]:
    """What every layout of the plan shares: the target, the drafter, the micro-batch, the GPU."""
    t, d, mb, cfg = planner.target, planner.drafter, planner.micro_batch, planner.cfg
    s = t.shape
    moe = f", {s.experts} experts ({s.experts_per_token} per token)" if s.experts else ""
    return [
        f"target: {s.model_type}, {t.parameters() / 1e9:.2f}B parameters{moe}; training keeps {planner.kept_layers} "
        f"of its {s.layers} layers ({t.parameters(planner.kept_layers) / 1e9:.2f}B, bf16)",
        f"drafter: {d.shape.layers} layers, {len(d.taps)} taps {list(d.taps)}, {d.parameters() / 1e9:.3f}B "
        f"parameters (float32 weights, gradients and AdamW)",
        f"micro-batch ({mb.source}): {mb.target_tokens} target tokens, a packed row of {mb.context_tokens} "
        f"tokens with {mb.blocks} blocks of {cfg.drafter.block_size} ({mb.blocks * cfg.drafter.block_size} "
        f"query tokens); train.compile={str(cfg.train.compile).lower()}, "
        f"train.grad_accum={cfg.train.grad_accum}",
        f"GPU: {planner.gpu_memory_gib:g} GiB, of which {gib(usable_bytes(planner.gpu_memory_gib))} usable by the "
        f"peaks below (GiB per GPU; 'peak' is the largest of the target forward, the drafter step and the "
        f"optimizer step over what is always held, not the sum of the columns)",
    ]
