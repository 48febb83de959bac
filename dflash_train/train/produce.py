"""The target side of a step: a data batch -> target capture -> pack -> noise -> one `Shipment`.

Owns `Shipment`, the one form in which a micro-batch reaches the drafter step, whether it was
made in the same process (colocated) or received from a target rank (transport.py); `pack`,
which drops the padding of a target batch and lays its rows end to end; `SidePacker`, which runs
`pack` on a side CUDA stream; `FeatureNoise`, the training noise on the target's features and
its random stream; and `Producer`, which turns a global micro-batch index into its shipment.

Feature noise is drawn here only, from a generator that is a pure function of (seed, global
micro-batch index), so any rank that handles micro-batch g, and a resumed run, draws the same
noise. With split fc layers (`topology.split_fc`) the tapped layers travel unconcatenated and
`context_features` concatenates and noises them on the drafter's side, with the same generator:
the same numbers either way.

With `objective.labels=distill` the shipment also carries the target's final hidden state,
shifted so that position p holds the state that predicts token p (the drafter side applies the
frozen lm_head to it chunk by chunk in the loss): [T, H] instead of [T, V] logits.

Shape legend: b rows, L padded length, T packed tokens (data.token_budget), F = n*H concatenated
tap width, H one tap's width (and the target's hidden size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dflash_train.core.masks import DOC_ALIGN, NOISE_STREAM, anchor_count, document_starts, step_generator


def add_feature_noise(
    features: torch.Tensor, kind: str, std: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Training-only regulariser on captured target features: U[-std, std] ("uniform") or
    N(0, std^2) ("gaussian"); "none" or std == 0 returns the input unchanged. The noise is drawn
    in float32 straight at its scale (one kernel) and added in one more, each sum rounded to the
    features' dtype once: two passes over [T, F] instead of six (the draw, three scalings, a cast
    and the sum)."""
    if kind not in ("uniform", "gaussian", "none"):
        raise ValueError(f"noise kind must be 'uniform', 'gaussian' or 'none', got {kind!r}")
    if kind == "none" or std == 0:
        return features
    noise = torch.empty(features.shape, dtype=torch.float32, device=features.device)
    if kind == "uniform":
        noise.uniform_(-std, std, generator=generator)
    else:
        noise.normal_(0.0, std, generator=generator)
    return torch.add(features, noise, out=torch.empty_like(features))


@dataclass(frozen=True)
class FeatureNoise:
    """`objective.noise` on the [T, F] features of global micro-batch `index`."""

    kind: str
    std: float
    seed: int
    device: torch.device

    def __call__(self, features_TF: torch.Tensor, index: int) -> torch.Tensor:
        if self.kind == "none" or self.std == 0:
            return features_TF
        generator = step_generator(self.seed, index, NOISE_STREAM, device=self.device)
        return add_feature_noise(features_TF, self.kind, self.std, generator)


@dataclass
class Shipment:
    """One packed micro-batch as the drafter step consumes it (device tensors, except the
    statistics), or, when the target forward raised on it, a failed one without tensors."""

    index: int  # global micro-batch index g
    failed: bool  # the target forward raised on this batch: nothing to train on
    features: torch.Tensor | list[torch.Tensor] | None  # [T, F] noised, or per tap [T, H] (split fc)
    input_ids_T: torch.Tensor | None = None
    loss_mask_T: torch.Tensor | None = None  # bool
    labels_T: torch.Tensor | None = None  # what the drafter must produce at each position
    doc_lengths: torch.Tensor | None = None  # one document per batch row
    target_hidden_TH: torch.Tensor | None = None  # distill: the target's final state predicting p
    num_tokens: int = 0  # real packed tokens (before padding up to T)
    padded_tokens: int = 0  # rows x L of the target batch
    rows: int = 0
    sum_seq_len: int = 0
    max_seq_len: int = 0
    epoch: int = 0
    sender_wait_us: int = 0  # the producing target rank's cumulative send wait (transport.py)
    # The number of real anchors sample_anchors will draw for this micro-batch (masks.anchor_count),
    # known on the host so that the drafter step needs no host sync; None: unknown, it is
    # counted on the device.
    anchor_count: int | None = None
    # The documents' placement in the row (masks.document_starts): 1, back to back; A, each at a
    # multiple of A (produce.place_documents).
    doc_align: int = 1

    @classmethod
    def failure(cls, index: int, batch) -> "Shipment":
        return cls(index, True, None, **batch_stats(batch))


def batch_stats(batch) -> dict:
    """The statistics of a target batch that travel with its shipment (host integers)."""
    return dict(padded_tokens=batch.input_ids.numel(), rows=batch.batch_size, epoch=batch.epoch,
                sum_seq_len=int(batch.lengths.sum()), max_seq_len=batch.max_seq_len)


def place_documents(lengths: list[int], pad_to: int) -> tuple[int, list[int]]:
    """Where `pack` lays a batch's rows: (align, the start of each). Each row starts at a
    multiple of masks.DOC_ALIGN when all of them then fit in `pad_to` tokens (the unsupervised
    gaps between them belong to no block's context: the mask rule sees documents, not the gaps;
    flex attention then meets no tile that straddles two documents' starts), else back to back
    (align 1). A rule of the lengths and `pad_to` alone, so every rank that packs a batch places
    it alike. Host-side."""
    doc_lengths = torch.tensor(lengths, dtype=torch.long)
    starts = document_starts(doc_lengths, DOC_ALIGN)
    if lengths and int(starts[-1]) <= pad_to:
        return DOC_ALIGN, starts[:-1].tolist()
    return 1, document_starts(doc_lengths)[:-1].tolist()


def pack_index(lengths: list[int], padded_len: int) -> torch.Tensor:
    """Flat indices of the real tokens of a right-padded [b, padded_len] batch (host-side)."""
    return torch.cat([torch.arange(r * padded_len, r * padded_len + n) for r, n in enumerate(lengths)])


def previous_index(lengths: list[int], padded_len: int) -> torch.Tensor:
    """`pack_index` shifted back one position inside each row (a row's first position keeps
    its own index): where the state that predicts each real token sits (host-side)."""
    return torch.cat([(torch.arange(n) - 1).clamp(min=0) + r * padded_len for r, n in enumerate(lengths)])


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to `device` without making the host wait. On CUDA the copy goes
    through pinned memory: a copy from pageable memory may return only once the stream has
    reached it, i.e. after the work queued before it (a profile of the smollm2 bench found the
    main thread waiting in one such copy in `pack`), while a pinned one is queued
    and returns at once (the caching host allocator keeps the pinned block until the copy is done)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pack(batch, index: int, features_bLF, head_out: torch.Tensor | None, pad_to: int,
         noise: FeatureNoise | None, input_ids_bL: torch.Tensor | None = None) -> Shipment:
    """Drop the padding of `batch` (global micro-batch `index`), lay its rows in one packed row
    padded with zeros to `pad_to` tokens (at least the real count; the producer passes the token
    budget, so every packed row has one shape), each row at a multiple of masks.DOC_ALIGN where
    they fit, else end to end (`place_documents`; the shipment's `doc_align` says which), and
    add `noise` to the features. `features_bLF` may be a list of per-tap [b, L, H] tensors
    (split fc layers): each is packed alone and no noise is added (`context_features` adds it
    on the drafter side).
    `head_out` is what the target returned past its taps (target.Target.capture): None (the
    labels are the data), its greedy tokens [b, L] (the labels), or its final hidden state
    [b, L, H] (distillation: shipped as `target_hidden_TH`, the labels stay the data).
    `input_ids_bL`: the batch's ids already on the features' device (the ones the target read),
    so that they are not copied again."""
    split = isinstance(features_bLF, (list, tuple))
    parts = list(features_bLF) if split else [features_bLF]
    device = parts[0].device
    b, L, _ = parts[0].shape
    lengths = batch.lengths.tolist()
    flat = to_device(pack_index(lengths, L), device)
    T = flat.numel()
    T_pad = max(T, pad_to)
    align, starts = place_documents(lengths, T_pad)
    # Where each real token goes: [T] packed positions, in the order of `flat`.
    place = to_device(torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]), device)

    def packed(values_X: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """`fill` ([T_pad, ...], zeros) with the real tokens' rows of `values_X` ([b * L, ...])."""
        return fill.index_copy_(0, place, values_X.index_select(0, flat))

    packed_parts = []
    for part in parts:
        F = part.shape[-1]
        packed_parts.append(packed(part.reshape(b * L, F), torch.zeros(T_pad, F, dtype=part.dtype, device=device)))
    feats = packed_parts if split or noise is None else noise(packed_parts[0], index)
    if input_ids_bL is None:
        input_ids_bL = to_device(batch.input_ids, device)
    ids = packed(input_ids_bL.reshape(-1), torch.zeros(T_pad, dtype=torch.long, device=device))
    mask = packed(to_device(batch.loss_mask, device).reshape(-1).to(torch.bool),
                  torch.zeros(T_pad, dtype=torch.bool, device=device))
    greedy_bL = head_out if head_out is not None and not head_out.is_floating_point() else None
    if greedy_bL is None:
        labels = ids
    else:
        # The target's prediction for position p is its argmax at p - 1 (same row).
        shifted = torch.cat([input_ids_bL[:, :1], greedy_bL[:, :-1]], dim=1)
        labels = packed(shifted.reshape(-1), torch.zeros_like(ids))
    target_hidden = None
    if head_out is not None and head_out.is_floating_point():
        # Position p gets the state at p - 1 (same row), which predicts token p; a document's
        # first position is never a block target and gets its own state.
        previous = to_device(previous_index(lengths, L), device)
        target_hidden = torch.zeros(T_pad, head_out.shape[-1], dtype=head_out.dtype, device=device)
        target_hidden.index_copy_(0, place, head_out.reshape(b * L, -1).index_select(0, previous))
    doc_lengths = to_device(torch.tensor(lengths, dtype=torch.long), device)
    return Shipment(index, False, feats, ids, mask, labels, doc_lengths, target_hidden, doc_align=align,
                    num_tokens=T, **batch_stats(batch))


def context_features(shipment: Shipment, noise: FeatureNoise) -> torch.Tensor:
    """The drafter's [T, F] context features of a shipment: as shipped, or (split fc layers) the
    per-tap tensors concatenated, then noised exactly as `pack` would have on the target side
    (same shape, same generator)."""
    if not isinstance(shipment.features, (list, tuple)):
        return shipment.features
    return noise(torch.cat(list(shipment.features), dim=-1), shipment.index)


class SidePacker:
    """Runs `pack` on a side CUDA stream (a plain call on CPU).

    Stream safety: the side stream waits for the producer of the features; the consumer stream
    waits for the side stream; inputs are recorded on the side stream and outputs on the
    consumer stream, so the caching allocator never hands their memory to other work while a
    stream that uses them is still running.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, batch, index: int, features_bLF, head_out, pad_to: int,
                 noise: FeatureNoise | None, input_ids_bL: torch.Tensor | None = None) -> Shipment:
        if self.stream is None:
            return pack(batch, index, features_bLF, head_out, pad_to, noise, input_ids_bL)
        parts = list(features_bLF) if isinstance(features_bLF, (list, tuple)) else [features_bLF]
        main = torch.cuda.current_stream(parts[0].device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            for t in (*parts, head_out, input_ids_bL):
                if t is not None:
                    t.record_stream(self.stream)
            shipment = pack(batch, index, features_bLF, head_out, pad_to, noise, input_ids_bL)
        main.wait_stream(self.stream)
        out_feats = shipment.features if isinstance(shipment.features, list) else [shipment.features]
        for t in (*out_feats, shipment.input_ids_T, shipment.loss_mask_T, shipment.labels_T, shipment.doc_lengths,
                  shipment.target_hidden_TH):
            if t is not None:
                t.record_stream(main)
        return shipment


@dataclass(frozen=True)
class Packing:
    """How a target rank turns its batches into shipments."""

    device: torch.device
    pad_to: int
    """Packed rows are padded to this many tokens (data.token_budget)."""
    split_fc: bool = False
    """topology.split_fc: the tapped layers travel unconcatenated, noise added on the drafter side."""
    micro_per_step: int = 1
    num_anchors: int | None = None
    """objective.num_anchors: each shipment carries its anchor count, counted on the host."""


class Producer:
    """The target role of one rank: global micro-batch index -> its `Shipment`.

    `target` is anything with `capture(ids, concat=True) -> (features, None | greedy tokens |
    final hidden state)` (target.Target; benchmarks pass stand-ins). A target forward that
    raises (out of memory on an unusual shape, ...) yields a failed shipment: logged with the
    batch's shape, counted by the drafter step that consumes it. The data position moves past
    it, so a resumed run skips it too. With `num_anchors` (objective.num_anchors) each shipment
    carries its anchor count, counted on the host from the batch (masks.anchor_count).

    A tensor-parallel target (topology.target_tp) runs only with every rank of its group: `turns`
    (colocated: dist.Dist.target_turns) maps micro-batch g to the micro-batches whose forwards
    the group runs together when g is due, in the same order on every member; this rank keeps g's
    and only joins the others' (`join`). Every rank reads any batch from the stream alone."""

    def __init__(self, target, stream, packing: Packing, *, noise: FeatureNoise, faults, timer, log,
                 turns: Callable[[int], list[int]] | None = None) -> None:
        self.target, self.stream, self.device = target, stream, packing.device
        self.turns = turns
        self.noise, self.split_fc, self.pad_to = noise, packing.split_fc, packing.pad_to
        self.num_anchors = packing.num_anchors
        self.micro_per_step = packing.micro_per_step
        self.faults, self.timer, self.log = faults, timer, log
        self.packer = SidePacker(packing.device)

    def __call__(self, index: int) -> Shipment:
        self.timer.mark("data")
        shipment = None
        for g in self.turns(index) if self.turns is not None else [index]:
            if g == index:
                shipment = self.produce(index, self.stream[index])
            else:
                self.join(g)
        return shipment

    def join(self, index: int) -> None:
        """Take part in the target forward of micro-batch `index`, which another rank of this
        rank's target group makes: this rank's shards compute their share, the output is dropped."""
        self.timer.mark("target")
        self.capture(index, self.stream[index])

    def produce(self, index: int, batch) -> Shipment:
        self.timer.mark("target")
        captured = self.capture(index, batch)
        if captured is None:
            return Shipment.failure(index, batch)
        features, head_out, ids = captured
        self.timer.mark("pack")
        shipment = self.packer(batch, index, features, head_out, self.pad_to, None if self.split_fc else self.noise,
                               input_ids_bL=ids)
        if self.num_anchors is not None and not shipment.failed:
            shipment.anchor_count = anchor_count(batch.loss_mask, batch.lengths, self.num_anchors)
        return shipment

    def capture(self, index: int, batch):
        """The target on `batch`: (features, head_out, the batch's ids on the device), or None
        where the forward failed (logged)."""
        step = index // self.micro_per_step + 1  # the 1-based optimizer step that trains on it
        try:
            self.faults.target_forward(step)
            ids = to_device(batch.input_ids, self.device)
            captured = self.forward(ids)
        except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
            failure = f"{type(err).__name__}: {err}"
        else:
            return (*captured, ids)  # the ids on the device go on to `pack`
        # Outside the except block: the traceback (and the tensors its frames hold) is gone.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.log(f"step {step}: target forward failed on batch of shape {tuple(batch.input_ids.shape)}: "
                 f"{failure}; batch skipped")
        return None

    def warm_up(self, shapes: list[tuple[int, int]]) -> None:
        """The target once on every batch shape of the plan (`shapes`), with the concat flag its
        captures use: on CUDA, allocator, kernels (and compiled graphs) and any out-of-memory
        surface before the first step; a target.GraphedTarget also captures its CUDA graphs of
        them here."""
        if hasattr(self.target, "prepare"):
            self.target.prepare(shapes, concat=not self.split_fc)
            return
        for rows, length in shapes:
            self.forward(torch.zeros(rows, length, dtype=torch.long, device=self.device))

    def forward(self, ids: torch.Tensor):
        """The target's capture of `ids`: per-tap features with split fc layers, else concatenated
        (stand-in targets of the benchmarks take no concat flag)."""
        return self.target.capture(ids, concat=False) if self.split_fc else self.target.capture(ids)
