"""Anchors, block layout and the one attention-mask rule of DFlash training.

Owns: document ids of a packed row, the anchor rule (`anchor_candidates`), its host-side count
(`packed_anchor_count`, `anchor_count`), per-document anchor sampling, the layout of the draft
blocks (inputs, rope positions, labels, loss weights), and the mask rule. The rule is written
once, as a flex-attention `mask_mod` over tensors; the dense boolean mask (CPU, sdpa), the flex
`BlockMask` (CUDA; the kernel applies the rule inside partial tiles) and the tests all evaluate
that same function. Only the BlockMask's tile index is derived separately, from the layout, and
tested against `create_block_mask`'s evaluation of the rule on every pair.

Layout of one drafter forward on a packed row of T tokens with N blocks of B tokens:
queries are the N*B block tokens (block n at rows n*B .. n*B+B-1); keys are
[T context features ; N*B block tokens]. A block whose anchor sits at packed position a
predicts the tokens at a+1 .. a+B-1 of the same document.

Shape legend: T packed tokens, N blocks, B block size, K = B - 1 predicted positions per block,
Q = N*B query rows, KV = T + Q key columns, R = query rows padded to whole BlockMask tiles,
J = key tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Layer kinds, as Hugging Face configs name them in `layer_types`.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


# Where a packed row has room, produce.pack starts every document at a multiple of this: the
# BlockMask's tile (`layout_block_mask`), so no key tile holds the end of one document and the
# start of the next: fewer partial tiles for the flex kernels to mask (docs/PERFORMANCE.md).
DOC_ALIGN = 128


def document_starts(doc_lengths: torch.Tensor, align: int = 1) -> torch.Tensor:
    """Packed start offset of each document, and one extra entry: the end of the last.

    `align` is the row's placement (produce.pack's, carried as Shipment.doc_align): 1, the
    documents back to back; A > 1, each document starts at a multiple of A, and the positions
    between a document's end and the next one's start are an unsupervised gap counted with the
    document before it (no anchor, no visible key, no loss there)."""
    doc_lengths = doc_lengths.to(torch.long)
    strides = doc_lengths if align <= 1 else (doc_lengths + (align - 1)) // align * align
    starts = torch.cat([doc_lengths.new_zeros(1), torch.cumsum(strides, 0)])
    if align > 1 and doc_lengths.numel():
        starts[-1] = starts[-2] + doc_lengths[-1]  # the last document's end, no gap after it
    return starts


def document_ids(doc_lengths: torch.Tensor, total_len: int | None = None, align: int = 1) -> torch.Tensor:
    """Document index of every packed position (`align`: the row's placement, see
    `document_starts`; a gap belongs to the document before it).

    Positions past the last document's end (padding up to a bucketed `total_len`) get the id
    `len(doc_lengths)`, a document of their own that no anchor belongs to. With `total_len`
    the ids are a `searchsorted` of the positions in the documents' starts (zero-length
    documents hold no position, as with `repeat_interleave`): no host sync, since the output
    size is known on the host. Documents reaching past `total_len` raise a ValueError only when
    `doc_lengths` is on the CPU; on another device that check (a host sync) is skipped and the
    ids are those of the first `total_len` positions. Without `total_len`: the documents back
    to back, `repeat_interleave` of the lengths.
    """
    doc_lengths = doc_lengths.to(torch.long)
    num_docs = doc_lengths.numel()
    device = doc_lengths.device
    if total_len is None:
        if align > 1:
            raise ValueError("document_ids: an aligned placement needs total_len")
        return torch.repeat_interleave(torch.arange(num_docs, device=device, dtype=torch.long), doc_lengths)
    starts = document_starts(doc_lengths, align)
    if device.type == "cpu" and num_docs and int(starts[-1]) > total_len:
        raise ValueError(f"documents reach position {int(starts[-1])}, past total_len={total_len}")
    positions = torch.arange(total_len, device=device, dtype=torch.long)
    ids = torch.searchsorted(starts[1:-1], positions, right=True)
    return torch.where(positions >= starts[-1], num_docs, ids)


NOISE_STREAM, ANCHOR_STREAM = 0, 1  # independent random streams of one micro-batch


def step_generator(seed: int, step: int, stream: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for the random draws of one micro-batch, a pure function of (seed, global
    micro-batch index `step`, `stream`): a resumed run, and any rank that handles the micro-batch,
    draws exactly what an uninterrupted single-process run would. Feature noise and anchors use
    separate streams, so noise drawn on a target rank leaves the drafter's anchors unchanged."""
    gen = torch.Generator(device=device)
    # Mix the three integers into one 63-bit seed (splitmix-style constants).
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) % (2**63 - 1)
    gen.manual_seed(mixed)
    return gen


def anchor_candidates(sup_T: torch.Tensor, doc_T: torch.Tensor) -> torch.Tensor:
    """The anchor rule: bool [T], True at the positions a block may be anchored at. Position p
    is a candidate when p and p + 1 are supervised and in the same document (the last position
    never is: it has no successor)."""
    sup_T = sup_T.to(torch.bool)
    valid_T = torch.zeros_like(sup_T)
    valid_T[:-1] = sup_T[:-1] & sup_T[1:] & (doc_T[:-1] == doc_T[1:])
    return valid_T


def packed_anchor_count(loss_mask_T: torch.Tensor, doc_lengths: torch.Tensor, num_anchors: int,
                        align: int = 1) -> int:
    """The number of real anchors `sample_anchors` draws for a packed row (its documents placed
    by `align`, see `document_starts`, then padding, which holds none): the sum over documents
    of min(num_anchors, the document's `anchor_candidates`). Host-side (CPU tensors)."""
    doc_lengths = doc_lengths.to(torch.long)
    num_docs = doc_lengths.numel()
    doc_T = document_ids(doc_lengths, loss_mask_T.numel(), align)
    valid_T = anchor_candidates(loss_mask_T, doc_T)
    per_doc = torch.bincount(doc_T[valid_T], minlength=num_docs + 1)[:num_docs]
    return int(per_doc.clamp(max=num_anchors).sum())


def anchor_count(loss_mask_bL: torch.Tensor, lengths_b: torch.Tensor, num_anchors: int) -> int:
    """`packed_anchor_count` of the packed row made from a padded batch (one document per row:
    row r holds lengths_b[r] tokens, its mask loss_mask_bL[r, :lengths_b[r]]), counted with the
    rows end to end: a document's candidates do not depend on where produce.pack places it.
    Host-side, on the batch's CPU tensors, so that the drafter step knows its anchor count
    without a host sync (`sample_anchors(count=...)`)."""
    lengths_b = lengths_b.to(torch.long)
    L = loss_mask_bL.shape[1]
    real_bL = torch.arange(L)[None, :] < lengths_b[:, None]
    return packed_anchor_count(loss_mask_bL.to(torch.bool)[real_bL], lengths_b, num_anchors)  # rows end to end


def sample_anchors(
    loss_mask_T: torch.Tensor,
    doc_lengths: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    pad_to_multiple: int = 1,
    buckets_per_doubling: int = 0,
    return_count: bool = False,
    count: int | None = None,
    align: int = 1,
):
    """Sample up to `num_anchors` anchors per document, uniformly without replacement, among
    the document's `anchor_candidates` (supervised positions whose next position is supervised
    and in the same document).

    Sampling is per document (never per row), so short documents packed next to long ones
    keep their share. Returns sorted packed positions [N]; with `pad_to_multiple` > 1 the
    list is padded with -1 (blocks that see nothing but themselves and carry no loss) to a
    multiple of it; with `buckets_per_doubling` s >= 1 further up to the next of s sizes per
    doubling (`padded_anchor_count`), which keeps the set of shapes the drafter and the mask are
    compiled for to a handful. The real anchors come first, the padding after them. A row with
    no valid anchor returns padding blocks only. With `return_count`: (anchors, the number of
    real ones, a host int).

    `count`: the number of real anchors, known on the host (`anchor_count` of the batch the
    row was packed from). With it nothing waits for the device (`nonzero_static` to the padded
    size); without it the count is read off the device (a host sync). Same anchors either way.
    `align`: the row's placement of its documents (`document_starts`).
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    device = loss_mask_T.device
    T = loss_mask_T.numel()
    doc_lengths = doc_lengths.to(device)
    doc_T = document_ids(doc_lengths, T, align)
    valid_T = anchor_candidates(loss_mask_T, doc_T)
    # Random key in [0, 1) per valid position, 2 for invalid ones; sorting by doc + key/4
    # groups documents in order and shuffles each document's valid positions first.
    key_T = torch.rand(T, generator=generator, device=device, dtype=torch.float64)
    key_T = torch.where(valid_T, key_T, torch.full_like(key_T, 2.0))
    order_T = torch.argsort(doc_T.to(torch.float64) + key_T / 4.0)
    # starts[d] for d in 0..D (D: the padding past the last document), every id doc_T holds;
    # each document's positions (its gap included) are contiguous, so these are the starts of
    # bincount(doc_T), with no sync.
    starts = document_starts(doc_lengths, align)
    rank_T = torch.arange(T, device=device) - starts[doc_T[order_T]]
    chosen_T = torch.zeros_like(valid_T)
    chosen_T[order_T] = valid_T[order_T] & (rank_T < num_anchors)
    # The real count: known on the host (`count`), or read off the device (a host sync). It
    # decides the drafter's shape for this step; nonzero_static pads with -1 up to it.
    n = count if count is not None else int(chosen_T.sum())
    # A row without any valid anchor still yields one (padding) block, so every step has a
    # well-formed, if lossless, drafter forward instead of a zero-length attention.
    size = padded_anchor_count(n, pad_to_multiple, buckets_per_doubling)
    anchors_N = torch.nonzero_static(chosen_T, size=size, fill_value=-1).flatten()
    return (anchors_N, n) if return_count else anchors_N


def padded_anchor_count(n: int, multiple: int, buckets_per_doubling: int = 0) -> int:
    """How many anchors `n` are padded to: at least one block and a multiple of `multiple`
    (m multiples); with `buckets_per_doubling` s >= 1, m is further raised to the next of s
    evenly spaced sizes per doubling: for 2^k < m <= 2^(k+1), a multiple of 2^k / s (s a power
    of two; sizes up to s multiples are kept as they are). s = 1 gives powers of two (up to
    half of the blocks wasted); s = 4 wastes at most a fifth for 4 times as many shapes."""
    multiple = max(1, multiple)
    m = max(1, -(-n // multiple))
    s = int(buckets_per_doubling)
    if s >= 1 and m > s:
        step = max(1, (1 << (m - 1).bit_length()) // (2 * s))  # 2^k / s with 2^k < m <= 2^(k+1)
        m = -(-m // step) * step
    return multiple * m


@dataclass
class BlockLayout:
    """Everything about the N blocks of one packed row that does not depend on the model.

    Built once per step by `build_layout`, shared by the mask, the drafter inputs and the loss.
    """

    block_size: int
    num_ctx: int  # T
    doc_T: torch.Tensor  # document id per packed position
    anchors_N: torch.Tensor  # packed anchor position, -1 for padding blocks
    block_pos_NB: torch.Tensor  # packed position each block token stands for
    rope_ctx_T: torch.Tensor  # in-document position of every context token
    rope_block_NB: torch.Tensor  # in-document position of every block token
    valid_NB: torch.Tensor  # bool: a supervised target inside the anchor's document (k >= 1)

    @property
    def num_blocks(self) -> int:
        return self.anchors_N.numel()

    def position_ids(self) -> torch.Tensor:
        """Rope positions [1, T + N*B] in the drafter's calling convention (context, then blocks)."""
        return torch.cat([self.rope_ctx_T, self.rope_block_NB.flatten()])[None]

    def block_input_ids(self, input_ids_T: torch.Tensor, mask_token_id: int) -> torch.Tensor:
        """Block inputs [N*B]: the anchor's own token, then B-1 mask tokens."""
        ids_NB = torch.full_like(self.block_pos_NB, mask_token_id)
        ids_NB[:, 0] = input_ids_T[self.anchors_N.clamp(min=0)]
        return ids_NB.flatten()

    def labels(self, labels_T: torch.Tensor) -> torch.Tensor:
        """Targets [N*B]: `labels_T` read at each block position (0 where out of range).

        `labels_T[p]` is the token the drafter must produce at packed position p: the data
        token itself (paper default) or the target's greedy prediction for p.
        """
        pos_NB = self.block_pos_NB.clamp(0, self.num_ctx - 1)
        return torch.where(self.valid_NB, labels_T[pos_NB], torch.zeros_like(pos_NB)).flatten()

    def rows(self, values_TX: torch.Tensor) -> torch.Tensor:
        """`values_TX` [T, X] read at each block position: [N*B, X] (rows out of range read a
        clamped position; they carry no loss)."""
        return values_TX[self.block_pos_NB.clamp(0, self.num_ctx - 1).flatten()]

    @property
    def ctx_start_N(self) -> torch.Tensor:
        """Packed start of each block's anchor document (the first context key it may see);
        for padding blocks the anchor itself (-1), an empty range."""
        return self.anchors_N - self.rope_block_NB[:, 0]

    def visible_pairs(self, sliding_window: int | None = None) -> torch.Tensor:
        """Visible (query, key) pairs of the real blocks under the mask rule (a device scalar):
        the attention work a mask-aware kernel must do. Padding blocks are not counted."""
        real_N = self.anchors_N >= 0
        offsets_N = torch.where(real_N, self.rope_block_NB[:, 0], torch.zeros_like(self.anchors_N))
        return visible_pairs(offsets_N, real_N.sum(), self.block_size, sliding_window)

    def mask_mod(self, sliding_window: int | None = None) -> MaskMod:
        """The mask rule for this layout (see `block_mask_mod`)."""
        return block_mask_mod(self.anchors_N, self.ctx_start_N, self.num_ctx, self.block_size, sliding_window)


def visible_pairs(ctx_offsets_N: torch.Tensor, num_real_blocks, block_size: int,
                  sliding_window: int | None = None) -> torch.Tensor:
    """The number of (query, key) pairs `block_mask_mod` allows, counted in closed form.

    `ctx_offsets_N` is, per block, its anchor's offset in its document (a - document start:
    the number of context keys before the anchor); padding blocks must carry 0 and are
    excluded by `num_real_blocks`. Row q of a block with offset o sees min(o, W - 1 - q)
    context keys under a window W (o without one) and its block's B keys (q + 1 under a
    window: causal). No host sync: the result stays on the offsets' device.
    """
    B = block_size
    offsets_N = ctx_offsets_N.to(torch.long)
    if sliding_window is None:
        return B * offsets_N.sum() + num_real_blocks * (B * B)
    reach_B = (sliding_window - 1 - torch.arange(B, device=offsets_N.device)).clamp(min=0)
    ctx = torch.minimum(offsets_N[:, None], reach_B[None, :]).sum()
    return ctx + num_real_blocks * (B * (B + 1) // 2)


def build_layout(
    anchors_N: torch.Tensor,
    loss_mask_T: torch.Tensor,
    doc_lengths: torch.Tensor,
    block_size: int,
    align: int = 1,
) -> BlockLayout:
    """Lay out one block per anchor. Block positions past the anchor's document end are cut:
    they stay in the block (as mask tokens) but carry no loss. `align`: the row's placement of
    its documents (`document_starts`)."""
    device = anchors_N.device
    T = loss_mask_T.numel()
    doc_lengths = doc_lengths.to(device=device, dtype=torch.long)
    doc_T = document_ids(doc_lengths, T, align)
    # starts[d] for d in 0..D, where d = D is the padding past the last document; ends alike
    # (a document's end is the next one's start: its gap, unsupervised, carries no loss).
    starts = document_starts(doc_lengths, align)
    ends = torch.cat([starts[1:], starts.new_full((1,), T)])
    pad_N = anchors_N < 0
    a_N = anchors_N.clamp(min=0)
    offsets_B = torch.arange(block_size, device=device)
    pos_NB = a_N[:, None] + offsets_B[None, :]
    start_N = starts[doc_T[a_N]]
    end_N = ends[doc_T[a_N]]
    sup_NB = loss_mask_T.to(torch.bool)[pos_NB.clamp(max=T - 1)]
    valid_NB = (
        (offsets_B[None, :] >= 1) & (pos_NB < end_N[:, None]) & sup_NB & ~pad_N[:, None]
    )
    rope_ctx_T = torch.arange(T, device=device) - starts[doc_T]
    rope_block_NB = pos_NB - start_N[:, None]
    return BlockLayout(
        block_size=block_size,
        num_ctx=T,
        doc_T=doc_T,
        anchors_N=anchors_N,
        block_pos_NB=pos_NB,
        rope_ctx_T=rope_ctx_T,
        rope_block_NB=rope_block_NB,
        valid_NB=valid_NB,
    )


def block_mask_mod(
    anchors_N: torch.Tensor,
    ctx_start_N: torch.Tensor,
    num_ctx: int,
    block_size: int,
    sliding_window: int | None = None,
) -> MaskMod:
    """THE mask rule. Query row q belongs to block n = q // B (offset q % B, anchor a = anchors_N[n],
    its document starting at packed position s = ctx_start_N[n]).

    A context key at packed position p is visible iff it is in the anchor's document and p < a
    (strictly: the target's feature at the anchor itself is not available at inference); the
    documents of a packed row are contiguous, so that is s <= p < a. A block key is visible iff it
    belongs to the same block: bidirectional, or causal under a sliding window W, where context
    keys must also satisfy p > a + (q % B) - W. No other block is ever visible. Padding blocks
    (anchor -1) see only themselves.

    Written as two ranges per row, read with gathers on the query side only: inside a partial
    tile the flex kernels evaluate it per (query, key) pair, in the forward and twice in the
    backward. Gathering the document of every key instead was measured slower in both
    (docs/PERFORMANCE.md).
    """
    T = int(num_ctx)
    B = block_size
    anchors_N = anchors_N.to(torch.int32)
    ctx_start_N = ctx_start_N.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        block_q = q_idx // B
        anchor = anchors_N[block_q]
        ctx_ok = (kv_idx >= ctx_start_N[block_q]) & (kv_idx < anchor)  # anchor <= T - 1: context only
        blk_lo = T + block_q * B
        blk_ok = (kv_idx >= blk_lo) & (kv_idx < blk_lo + B)
        if sliding_window is not None:
            q_off = q_idx % B
            ctx_ok = ctx_ok & (kv_idx > anchor + q_off - sliding_window)
            blk_ok = blk_ok & (kv_idx - blk_lo <= q_off)
        return ctx_ok | blk_ok

    return mask_mod


def dense_mask(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device | str) -> torch.Tensor:
    """Evaluate a mask rule on every (query, key) pair: bool [q_len, kv_len], True = visible."""
    q_idx = torch.arange(q_len, device=device)[:, None]
    kv_idx = torch.arange(kv_len, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(zero, zero, q_idx, kv_idx)


def flex_block_mask(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device | str, block: int = 128):
    """A flex-attention BlockMask of a rule by evaluating it on every (query, key) pair
    (`create_block_mask`, compiled on CUDA): the reference `layout_block_mask` is tested
    against. Training does not use it: over ~1e5 x ~1e5 pairs it cost a fifth of a step."""
    compiled = torch.device(device).type == "cuda"
    return create_block_mask(
        mask_mod, None, None, q_len, kv_len, device=device, BLOCK_SIZE=block, _compile=compiled
    )


def layout_block_mask(layout: BlockLayout, sliding_window: int | None = None, block: int = 128):
    """The flex-attention BlockMask of `layout.mask_mod(sliding_window)`, with its tiles read
    off the layout instead of found by evaluating the rule on all Q x KV pairs.

    Under the rule every query row (block n, offset k, anchor a) sees two contiguous key
    ranges: context [s, a - 1] (s its document's start, raised to a + k - W + 1 under a window
    W) and its own block [T + nB, T + nB + B - 1] (to T + nB + k under a window). A tile of
    `block` rows x `block` keys is kept iff some row's range meets it, and is full iff every
    row of the tile (all inside Q) has the whole tile inside one of its ranges: the same
    partial and full tiles `create_block_mask` finds (tested against it). Flex applies the
    rule (`mask_mod`) inside partial tiles and skips it in full ones, so the rule stays the
    one definition and this is only its sparse index. Tensor ops on the layout's device: no
    host sync, no loop over tiles; the tile grid is [ceil(Q/block), ceil(KV/block)].
    """
    B, T, N = layout.block_size, layout.num_ctx, layout.num_blocks
    Q, KV = N * B, T + N * B
    device = layout.anchors_N.device
    nq, nkv = -(-Q // block), -(-KV // block)
    rows_R = torch.arange(nq * block, device=device)  # R = query rows padded to whole tiles
    n_R = (rows_R // B).clamp(max=N - 1)
    k_R = rows_R % B
    a_R = layout.anchors_N[n_R]
    in_q_R = rows_R < Q
    ctx_lo_R = layout.ctx_start_N[n_R]  # the rule's own range: document start .. anchor - 1
    ctx_hi_R = a_R - 1
    blk_lo_R = T + n_R * B
    blk_hi_R = blk_lo_R + (B - 1)
    if sliding_window is not None:
        ctx_lo_R = torch.maximum(ctx_lo_R, a_R + k_R - (sliding_window - 1))
        blk_hi_R = blk_lo_R + k_R
    ranges = [(ctx_lo_R, ctx_hi_R, in_q_R & (a_R >= 0)), (blk_lo_R, blk_hi_R, in_q_R)]
    # Empty ranges (padding rows and blocks, anchors at a document start) become [KV, -1].
    ranges = [
        (torch.where(ok & (hi >= lo), lo, KV), torch.where(ok & (hi >= lo), hi, -1)) for lo, hi, ok in ranges
    ]

    # Kept tiles: per row, +1 at the first tile of each range and -1 past its last, summed
    # over the rows of a query tile and accumulated along the keys (a difference array).
    diff = torch.zeros(nq * (nkv + 1), dtype=torch.int32, device=device)
    row_base_R = (rows_R // block) * (nkv + 1)
    for lo_R, hi_R in ranges:
        ok_R = (hi_R >= lo_R).to(torch.int32)
        diff.index_add_(0, row_base_R + (lo_R // block).clamp(0, nkv), ok_R)
        diff.index_add_(0, row_base_R + (hi_R // block + 1).clamp(0, nkv), -ok_R)
    kept = diff.view(nq, nkv + 1).cumsum(dim=-1)[:, :nkv] > 0
    # Full tiles: inside the intersection of one kind of range over the tile's rows.
    j_J = torch.arange(nkv, device=device)
    full = torch.zeros(nq, nkv, dtype=torch.bool, device=device)
    for lo_R, hi_R in ranges:
        lo_q = lo_R.view(nq, block).amax(dim=-1)
        hi_q = hi_R.view(nq, block).amin(dim=-1)
        full |= (j_J[None, :] * block >= lo_q[:, None]) & ((j_J[None, :] + 1) * block - 1 <= hi_q[:, None])
    partial = kept & ~full

    def ordered(tiles):
        """flex's layout: per query tile the count, then the kept key tiles in ascending order
        followed by the others (a stable descending argsort, done as one scatter)."""
        ones = tiles.to(torch.int64)
        num = ones.sum(dim=-1)
        slot = torch.where(tiles, ones.cumsum(-1) - 1, num[:, None] + (1 - ones).cumsum(-1) - 1)
        idx = torch.empty_like(slot).scatter_(-1, slot, j_J.expand_as(slot))
        return num.to(torch.int32)[None, None], idx.to(torch.int32)[None, None]

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
        mask_mod=layout.mask_mod(sliding_window), seq_lengths=(Q, KV),
    )


def build_attention_masks(
    layout: BlockLayout,
    layer_types: list[str],
    sliding_window: int | None,
    backend: str,
) -> dict[str, object]:
    """One mask per kind of layer present ("full_attention", "sliding_attention"), built once
    per step and shared by every layer of that kind. backend: "flex" -> BlockMask (tiles read
    off the layout, `layout_block_mask`), "sdpa" -> dense bool [Q, KV]."""
    if backend not in ("flex", "sdpa"):
        raise ValueError(f"attention backend must be 'flex' or 'sdpa', got {backend!r}")
    q_len = layout.num_blocks * layout.block_size
    kv_len = layout.num_ctx + q_len
    device = layout.anchors_N.device
    masks: dict[str, object] = {}
    for kind in dict.fromkeys(layer_types):
        window = sliding_window if kind == SLIDING_ATTENTION else None
        if backend == "flex":
            masks[kind] = layout_block_mask(layout, window)
        else:
            masks[kind] = dense_mask(layout.mask_mod(window), q_len, kv_len, device)
    return masks
