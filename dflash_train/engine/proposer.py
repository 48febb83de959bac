"""What proposes the tokens a speculative cycle verifies: the `Proposer` protocol and the DFlash
drafter as one (`DFlashProposer`).

A proposer gets, every cycle, each live row's committed ids, its anchor (the position of its
last committed token) and the target's tapped features of the committed positions it has not
seen yet, and returns B-1 proposed tokens per row; rows that finish leave (`keep_rows`). The
DFlash proposer runs the drafter once per cycle on [anchor token, MASK x (B-1)] of every row
with that new context and takes the argmax of the target's lm_head over its output. Its keys
and values live in its own StaticCache (column p holds each row's context position p); its
block step and its write of a prompt's context run on decode.py's engine (row and width
buckets, CUDA graphs on a GPU, eager on CPU). The decoder fuses its block step with the
target's verify step into one captured cycle (decoder.Decoder).

Shape legend: R rows, S committed tokens, T new context tokens, F = n*H tapped features,
B block size, W key columns read by a forward.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from dflash_train.core.attention import additive_mask, causal_position_mask
from dflash_train.core.drafter import FULL_ATTENTION, SLIDING_ATTENTION, DrafterCache
from dflash_train.engine.decode import PREFILL_GRAPH_ROWS, StaticCache, pick, row_buckets, width_buckets
from dflash_train.engine.graphs import Graphs
from dflash_train.engine.fusion import KINDS, fuse_kernels


class Proposer(Protocol):
    """What speculative decoding asks for proposals of R rows. `reset(rows, capacity)` starts up
    to `rows` new sequences of at most `capacity` positions. `propose_batch` gets the committed
    ids [R, S] (row i's ids up to its anchor at position anchor_R[i]; what lies past it is
    undefined), the tapped features of each row's committed positions not seen yet [R, T, F],
    right-padded: row i's first context_len_R[i] entries are positions anchor_R[i] -
    context_len_R[i] .. anchor_R[i] - 1 (None when `target_layer_ids` is empty), and
    max(anchor_R) as a host int; it returns [R, B-1] ids. `keep_rows(index_R)` (a host tensor):
    later calls see only these rows of the earlier ones, in this order."""

    block_size: int
    target_layer_ids: list[int]

    def reset(self, rows: int, capacity: int) -> None: ...

    def propose_batch(self, sequence_ids_RS: torch.Tensor, anchor_R: torch.Tensor, context_RTF: torch.Tensor | None,
                      context_len_R: torch.Tensor, max_anchor: int) -> torch.Tensor: ...

    def keep_rows(self, index_R: torch.Tensor) -> None: ...


class DFlashProposer:
    """The DFlash drafter as a proposer. `propose_batch` runs the drafter's block step for R
    rows in one forward on a StaticCache whose column p holds each row's context position p: a
    row's block attends to columns < anchor + B (sliding layers: causal and within the window);
    the block's keys, written at its own positions, are overwritten by the next cycle's context
    before anything can see them again. The step (drafter layers, the target's lm_head, argmax)
    is one Graphs key per row and width bucket; the first cycle of a sequence, whose context is
    the whole prompt, runs eagerly. On a GPU the drafter's norms run as one kernel each and its
    rotations as two (`kernels`: the kinds of engine/fusion.py, all by default; () for none).

    `propose` is the reference it is checked against: one sequence, a growing DrafterCache of
    all earlier context, the block's keys/values never kept; no engine."""

    def __init__(self, drafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, graphs: bool = True,
                 kernels: tuple[str, ...] = KINDS) -> None:
        fuse_kernels(drafter, kernels)
        self.drafter = drafter
        self.block_size = int(drafter.block_size)
        self.target_layer_ids = list(drafter.target_layer_ids)
        self.mask_token_id = int(drafter.mask_token_id)
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight
        self._new_cache = DrafterCache
        self.cache = DrafterCache()
        self.device = embed_weight.device
        self.graphs = Graphs(self.device, graphs)
        self.row_cache: StaticCache | None = None
        self.rows: list[int] = []
        self.widths: list[int] = []

    @classmethod
    def for_target(cls, drafter, model, graphs: bool = True, kernels: tuple[str, ...] = KINDS) -> "DFlashProposer":
        """Uses the target's frozen embedding and lm_head (tied or not)."""
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        return cls(drafter, embed, head.weight if head is not None else embed, graphs=graphs, kernels=kernels)

    def reset(self, rows: int = 1, capacity: int = 0) -> None:
        self.cache = self._new_cache()
        if self.row_cache is None or self.row_cache.rows < rows or self.row_cache.capacity < capacity:
            if self.row_cache is not None:  # grown, never shrunk: a caller's row buckets stay valid
                rows, capacity = max(rows, self.row_cache.rows), max(capacity, self.row_cache.capacity)
            self.row_cache = StaticCache(rows, max(capacity, 2 * self.block_size + 2))
            self.rows, self.widths = row_buckets(rows), width_buckets(self.row_cache.capacity)
            self.graphs.clear()

    def propose(self, sequence_ids_1S: torch.Tensor, context_1TF: torch.Tensor | None) -> torch.Tensor:
        anchor_pos = sequence_ids_1S.shape[1] - 1
        start = self.cache.get_seq_length()
        assert context_1TF is not None and start + context_1TF.shape[1] == anchor_pos, "context must reach the anchor"
        B = self.block_size
        dtype = next(self.drafter.parameters()).dtype
        block_1B = torch.full((1, B), self.mask_token_id, dtype=torch.long, device=sequence_ids_1S.device)
        block_1B[:, 0] = sequence_ids_1S[:, -1]
        noise_emb = F.embedding(block_1B, self.embed_weight).to(dtype)
        position_ids = torch.arange(start, anchor_pos + B, device=sequence_ids_1S.device)[None]
        hidden_1BH = self.drafter(context_1TF.to(dtype), noise_emb, position_ids,
                                  past_key_values=self.cache, use_cache=True)
        self.cache.crop(anchor_pos)  # keep the context; the block's keys/values must not stay
        logits = hidden_1BH[0, 1:].to(self.lm_head_weight.dtype) @ self.lm_head_weight.t()
        return logits.argmax(dim=-1)

    def block_body(self, anchor_token_R, anchor_R, context_RTF, context_len_R, width: int) -> torch.Tensor:
        """The drafter's block step itself (no buckets, no graph): the proposals [R, B-1] of
        rows anchored at anchor_R (token anchor_token_R there), whose new context is the first
        context_len_R[i] of context_RTF[i] (positions anchor - context_len .. anchor - 1)."""
        return self._block_fn(width)(anchor_token_R, anchor_R, context_RTF, context_len_R)[0]

    def write_context(self, anchor_token_R, end_R, context_RTF, width: int) -> None:
        """The drafter's keys and values of positions 0..end_R[i]-1 of each row (features
        context_RTF[i, :end_R[i]]) into its cache, ahead of the block steps: one drafter forward
        anchored at end_R, whose block's keys land on columns end_R .. end_R + B - 1 (the next
        block step's context overwrites them before anything reads them). Not a block step: it
        proposes nothing. `width`: at least max(end_R) + B. On CUDA, up to PREFILL_GRAPH_ROWS
        rows (a prompt's first cycle at batch 1) it runs padded to its row and width buckets
        (padding rows anchored at 0 with no context, in free slots), replayed from a graph per
        (rows, context length, width) once the cache's buffers exist; eager at its own shape
        above that and on CPU (Graphs.buckets_small_steps)."""
        R, T = context_RTF.shape[:2]
        inputs = (anchor_token_R, end_R, context_RTF, end_R)
        Rb = pick(R, self.rows) if self.rows else R
        small = self.graphs.buckets_small_steps and self.widths and Rb <= PREFILL_GRAPH_ROWS
        if not small or width > self.widths[-1]:
            self._block_fn(width)(*inputs)
            return
        W = pick(int(width), self.widths)
        if Rb > R:
            inputs = tuple(torch.cat([t, t.new_zeros(Rb - R, *t.shape[1:])]) for t in inputs)
        fn = self._block_fn(W)
        if self.ready:
            self.graphs.run(("context", Rb, T, W), fn, *inputs)
        else:
            fn(*inputs)

    @property
    def ready(self) -> bool:
        """Whether the block step may be captured: its cache buffers exist (the first, eager,
        call allocates them on the current stream)."""
        return self.row_cache is not None and bool(self.row_cache.keys)

    def _block_fn(self, width: int):
        B, cache = self.block_size, self.row_cache
        window = getattr(self.drafter.config, "sliding_window", None)

        def fn(anchor_token_R, anchor_R, context_RTF, context_len_R):
            R, T = context_RTF.shape[:2]
            device = anchor_R.device
            j_T, k_B = torch.arange(T, device=device), torch.arange(B, device=device)
            ctx_pos_RT = anchor_R[:, None] - context_len_R[:, None] + j_T
            real_RT = j_T < context_len_R[:, None]
            block_pos_RB = anchor_R[:, None] + k_B
            columns = torch.cat([torch.where(real_RT, ctx_pos_RT, cache.trash), block_pos_RB], dim=1)
            position_ids = torch.cat([torch.where(real_RT, ctx_pos_RT, 0), block_pos_RB], dim=1)
            cache.bind(columns, width)
            block_RB = torch.full((R, B), self.mask_token_id, dtype=torch.long, device=device)
            block_RB[:, 0] = anchor_token_R
            dtype = next(self.drafter.parameters()).dtype
            noise_emb = F.embedding(block_RB, self.embed_weight).to(dtype)
            key_W = torch.arange(width, device=device)
            visible = {FULL_ATTENTION: (key_W < (anchor_R + B)[:, None])[:, None, None, :]}  # context + whole block
            if window:
                visible[SLIDING_ATTENTION] = causal_position_mask(block_pos_RB, width, window)
            masks = {kind: additive_mask(mask, dtype) for kind, mask in visible.items()}
            hidden_RBH = self.drafter(context_RTF.to(dtype), noise_emb, position_ids, attention_mask=masks,
                                      past_key_values=cache, use_cache=True)
            logits = hidden_RBH[:, 1:].to(self.lm_head_weight.dtype) @ self.lm_head_weight.t()
            return (logits.argmax(dim=-1),)
        return fn

    def propose_batch(self, sequence_ids_RS: torch.Tensor, anchor_R: torch.Tensor, context_RTF: torch.Tensor | None,
                      context_len_R: torch.Tensor, max_anchor: int) -> torch.Tensor:
        assert context_RTF is not None, "the DFlash drafter needs the target's features"
        if self.row_cache is None:
            self.reset(anchor_R.shape[0], int(max_anchor) + 2 * self.block_size + 2)
        R, T = context_RTF.shape[:2]
        B = self.block_size
        anchor_token_R = sequence_ids_RS.gather(1, anchor_R[:, None])[:, 0]
        if T > B or not self.ready:  # a first cycle (the whole prompt is new context): eager
            return self.block_body(anchor_token_R, anchor_R, context_RTF, context_len_R, int(max_anchor) + B)
        if T < B:
            context_RTF = torch.cat([context_RTF, context_RTF.new_zeros(R, B - T, context_RTF.shape[2])], dim=1)
        Rb, W = pick(R, self.rows), pick(int(max_anchor) + B, self.widths)
        inputs = (anchor_token_R, anchor_R, context_RTF, context_len_R)
        if Rb > R:  # padding rows: no context, anchored in the trash column's shadow at position 0
            inputs = tuple(torch.cat([t, t.new_zeros(Rb - R, *t.shape[1:])]) for t in inputs)
        (proposals,) = self.graphs.run(("draft", Rb, W), self._block_fn(W), *inputs)
        return proposals[:R]

    def keep_rows(self, index_R: torch.Tensor) -> None:
        if self.row_cache is not None:
            self.row_cache.keep_rows(index_R)
