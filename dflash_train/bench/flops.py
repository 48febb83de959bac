"""Useful work of a training step: the FLOP formula behind MFU, counting what a step did
(samples, context tokens, real blocks, visible attention pairs, loss rows, bytes on the wire)
without adding work to it, and the chips' dense bf16 peaks. Used by the training benches
(training.py, distributed.py); docs/PERFORMANCE.md states the formula.

Shape legend: b rows, L padded length, T packed tokens, N blocks, B block size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_train.core.masks import FULL_ATTENTION, packed_anchor_count, visible_pairs
from dflash_train.train.transport import HEADER_LEN

# Dense bf16 tensor-core peak (FLOP/s, no sparsity), matched against torch.cuda.get_device_name.
PEAK_BF16_FLOPS = (("H200", 989.4e12), ("H100 80GB HBM3", 989.4e12), ("A100", 312e12))


@dataclass(frozen=True)
class Shape:
    """The matmul shape of a decoder layer stack."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> "Shape":
        heads = int(config.num_attention_heads)
        return cls(int(config.hidden_size), int(config.intermediate_size), heads,
                   int(getattr(config, "num_key_value_heads", None) or heads),
                   int(getattr(config, "head_dim", None) or config.hidden_size // heads), int(config.vocab_size))

    @property
    def qo_mlp_params(self) -> int:
        """Weights applied to query tokens only in a drafter layer: q, o, gate, up, down."""
        return 2 * self.hidden * self.heads * self.head_dim + 3 * self.hidden * self.intermediate

    @property
    def kv_params(self) -> int:
        return 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def pair_flops(self) -> int:
        """FLOPs of one visible (query, key) pair in one layer: QK^T and PV over all heads."""
        return 4 * self.heads * self.head_dim


@dataclass
class WorkCount:
    """What the timed steps did, in the units the FLOP formula needs (host numbers)."""

    samples: int = 0
    sample_lengths: list[int] = field(default_factory=list)  # real tokens of every sample
    context_tokens: int = 0  # real tokens through the target, the drafter's context
    padded_tokens: int = 0  # tokens of the padded target batches
    block_rows: int = 0  # query rows of real (not padding) blocks
    attention_pairs: int = 0  # visible (query, key) pairs, summed over drafter layers
    loss_rows: int = 0  # block rows that carry loss (lm_head rows)


def useful_flops(work: WorkCount, target: Shape, target_layers: int, target_lm_head: bool,
                 drafter: Shape, drafter_layers: int, num_taps: int, target_ran: bool = True,
                 distill: bool = False) -> dict[str, float]:
    """Useful FLOPs of the counted work, by component (matmuls only; 2 FLOPs per
    multiply-add). Padding tokens, padding blocks and masked-out attention pairs are not
    counted; frozen weights get no weight-gradient FLOPs.

    - target_forward: per sample of length l, per layer run, 2 * (qo_mlp + kv params) * l for
      the linears plus pair_flops * l(l+1)/2 for causal attention; 2 * H * V * l more when the
      target runs to its lm_head (labels=target).
    - drafter_forward: fc 2 * (n*H) * H per context token; per layer, q/o/MLP linears on block
      rows, k/v linears on context + block rows, pair_flops per visible pair.
    - drafter_backward: twice the forward, except fc: its input (the target's features) needs
      no gradient, so only its weight gradient (1x) counts.
    - lm_head: the frozen lm_head forward and its input gradient on loss rows, 4 * H * V each;
      with distillation (`distill`) 2 * H * V more per loss row: the target's logits, recomputed
      from its final hidden state.
    """
    t, d = target, drafter
    lengths = np.asarray(work.sample_lengths, dtype=np.float64)
    target_fwd = 0.0
    if target_ran:
        per_layer = 2.0 * (t.qo_mlp_params + t.kv_params) * lengths.sum() + t.pair_flops * (lengths * (lengths + 1) / 2).sum()
        target_fwd = target_layers * per_layer + (2.0 * t.hidden * t.vocab * lengths.sum() if target_lm_head else 0.0)
    fc = 2.0 * num_taps * d.hidden * d.hidden * work.context_tokens
    layers = drafter_layers * (2.0 * d.qo_mlp_params * work.block_rows
                               + 2.0 * d.kv_params * (work.context_tokens + work.block_rows))
    attention = float(d.pair_flops) * work.attention_pairs
    drafter_fwd = fc + layers + attention
    return {
        "target_forward": target_fwd,
        "drafter_forward": drafter_fwd,
        "drafter_backward": 2.0 * (layers + attention) + fc,
        "lm_head": (6.0 if distill else 4.0) * d.hidden * d.vocab * work.loss_rows,
    }


def wire_bytes(s) -> int:
    """Bytes of one shipment between ranks (transport.py's wire format): the header, and unless
    the target failed, the features (and with distillation the target's final hidden state),
    the [3, T] int64 ids / loss mask / labels and the int64 document lengths."""
    total = 8 * HEADER_LEN
    if not s.failed:
        parts = s.features if isinstance(s.features, list) else [s.features]
        if s.target_hidden_TH is not None:
            parts = [*parts, s.target_hidden_TH]
        total += sum(p.numel() * p.element_size() for p in parts)
        total += 8 * (3 * s.input_ids_T.numel() + s.doc_lengths.numel())
    return total


class WorkCounter:
    """Collects a step's work for the FLOP count without adding work to the step: the
    shipments it trained on (`watch`) and, through a forward pre-hook on the drafter, views of
    the rope positions of its block rows, whose first column is each anchor's offset in its
    document (0 for padding blocks): the context keys its rows see (masks.visible_pairs)."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.offsets: list[torch.Tensor] = []
        # (real anchors, or the loss mask to count them from; doc_lengths; padded_tokens; rows;
        # the row's placement of its documents, doc_align)
        self.shipments: list[tuple] = []
        self.bytes_sent = 0  # of the shipments watched, as they travel between ranks
        self.handle = drafter.register_forward_pre_hook(self._hook, with_kwargs=True)

    def watch(self, shipments):
        """Pass a step's shipments through (`train.loop.take_step(run, counter.watch)`), keeping what
        the count needs of every trained shipment: its anchor count as it travels with it (a
        device copy of its loss mask where the count is unknown), device copies without a host
        sync (a drafter rank's receive buffers are reused by the next batch), and the bytes each
        shipment takes on the wire."""
        for s in shipments:
            self.bytes_sent += wire_bytes(s)
            if not s.failed:
                real = s.anchor_count if s.anchor_count is not None else s.loss_mask_T.clone()
                self.shipments.append((real, s.doc_lengths.clone(), s.padded_tokens, s.rows, s.doc_align))
            yield s

    def _hook(self, module, args, kwargs) -> None:
        features = args[0] if args else kwargs["target_hidden"]
        position_ids = args[2] if len(args) > 2 else kwargs["position_ids"]
        self.offsets.append(position_ids[0, features.shape[1]:].view(-1, module.block_size)[:, 0])

    def reset(self) -> None:
        self.offsets.clear()
        self.shipments.clear()
        self.bytes_sent = 0

    def count(self, num_anchors: int, loss_rows: int) -> WorkCount:
        B = self.drafter.block_size
        config = self.drafter.config
        kinds = {kind: config.layer_types.count(kind) for kind in set(config.layer_types)}
        work = WorkCount(loss_rows=loss_rows)
        # (sample lengths, padded target tokens, rows, real anchors) of every micro-batch
        micro = []
        for real, docs, padded, rows, align in self.shipments:  # host syncs: after timing
            docs = docs.cpu()
            if isinstance(real, torch.Tensor):  # the loss mask of a shipment without its count
                real = packed_anchor_count(real.cpu(), docs, num_anchors, align)
            micro.append((docs, padded, rows, real))
        assert len(self.offsets) == len(micro), "one drafter forward per micro-batch"
        pairs = []
        for (lengths, padded, rows, real), offsets_N in zip(micro, self.offsets):
            work.samples += rows
            work.sample_lengths += lengths.tolist()
            work.context_tokens += int(lengths.sum())
            work.padded_tokens += padded
            work.block_rows += real * B
            for kind, num_layers in kinds.items():
                window = None if kind == FULL_ATTENTION else config.sliding_window
                pairs.append(num_layers * visible_pairs(offsets_N, real, B, window))
        work.attention_pairs = int(torch.stack(pairs).sum()) if pairs else 0  # host sync: after timing
        return work


def peak_flops(device: torch.device, given_tflops: float | None) -> float | None:
    if given_tflops is not None:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)
