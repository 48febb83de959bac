"""Speculative decoding against the target, and the statistics of what was accepted.

Owns DFlash speculative decoding exactly as REFERENCE.md section 2 describes, for R prompts at
once (batch 1 is one row): every cycle the drafter runs once on [last committed token,
MASK x (B-1)] of every live row with the context features it has not seen yet and proposes B-1
tokens (argmax); the target verifies every row's block in one forward and chooses its own token
at every position; the longest prefix of proposals equal to the target's tokens is accepted,
plus the target's own next token; the verify pass's tapped features of the committed positions
become the next context. Rows advance by their own acceptance; a finished row leaves.

Also owns target-only decoding (the reference speculative decoding must reproduce, and the
baseline of the speedup), the stop tokens of a tokenizer, and the acceptance statistics: tau
(mean of acceptance lengths over cycles), the paper's per-set tau (mean over turns of each
turn's mean) and the histogram of acceptance lengths 1..B. The acceptance count itself is
`loss.accepted_run_length`, the one function training metrics also use.

Both decoders run on decode.py's engine (`Decoder`: static position-addressed caches, shape
buckets, CUDA graphs on a GPU, eager on CPU), built once per process and reused across prompts.
Token choice is `sampling.choose`: the token committed at position p is always the target's own
choice at p (argmax, or the sample drawn at the position-hashed uniform number of (seed, p)),
conditioned on the committed prefix; proposals only decide how many of those one verify
forward yields. So at T = 0 the output is the target's greedy output, and at T > 0 target-only
sampling with the same seed gives the same tokens, not only the same distribution.

Shape legend: R rows, S committed tokens, T new context tokens, F = n*H tapped features,
B block size, V vocabulary, W key columns read by a forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import torch
import torch.nn.functional as F

from dflash_train.decode import (PREFILL_GRAPH_ROWS, Graphs, StaticCache, TargetSteps, pick, row_buckets,
                                 width_buckets)
from dflash_train.drafter import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_train.engine_attention import causal_position_mask
from dflash_train.loss import accepted_run_length
from dflash_train.slots import SlotDecoder
from dflash_train.sampling import choose
from dflash_train.target import LayerTaps


# --------------------------------------------------------------------------- token choice


def choose_tokens(logits_QV: torch.Tensor, positions: Sequence[int], temperature: float, seed: int,
                  top_p: float = 1.0) -> torch.Tensor:
    """sampling.choose for the logits [Q, V] of one sequence whose tokens are chosen at
    `positions` (logits at position q choose the token at q + 1), with one seed."""
    pos = torch.as_tensor(list(positions), dtype=torch.long, device=logits_QV.device)[None]
    seeds = torch.tensor([int(seed)], device=logits_QV.device)
    return choose(logits_QV[None], pos, seeds, temperature, top_p)[0]


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Ids that end a response: the tokenizer's and the generation config's eos, and the
    special token the chat template writes right after an assistant turn (e.g. <|im_end|>)."""
    ids = set()
    for eos in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if getattr(tokenizer, "chat_template", None):
        probe = "dflash-probe-answer"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}], tokenize=False
        )
        after = text[text.rfind(probe) + len(probe):]
        follow = tokenizer(after, add_special_tokens=False)["input_ids"]
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        specials |= {int(i) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if t.special}
        if follow and follow[0] in specials:
            ids.add(int(follow[0]))
    return sorted(int(i) for i in ids)


# --------------------------------------------------------------------------- proposers


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
    the whole prompt, runs eagerly.

    `propose` is the reference it is checked against: one sequence, a growing DrafterCache of
    all earlier context, the block's keys/values never kept; no engine."""

    def __init__(self, drafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, graphs: bool = True) -> None:
        from dflash_train.drafter import DrafterCache

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
    def for_target(cls, drafter, model, graphs: bool = True) -> "DFlashProposer":
        """Uses the target's frozen embedding and lm_head (tied or not)."""
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        return cls(drafter, embed, head.weight if head is not None else embed, graphs=graphs)

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
            masks = {FULL_ATTENTION: (key_W < (anchor_R + B)[:, None])[:, None, None, :]}  # context + whole block
            if window:
                masks[SLIDING_ATTENTION] = causal_position_mask(block_pos_RB, width, window)
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
            _keep_slots(self.row_cache, index_R)


def _keep_slots(cache: StaticCache, index_R: torch.Tensor) -> None:
    """Slots index_R[i] (ascending) move to slots i: live rows stay in slots 0..n-1. The moves
    are worked out on the host (`index_R` is a host tensor: no device sync)."""
    index = index_R.cpu()
    dst = torch.arange(index.numel())
    moved = index != dst
    if cache.keys and bool(moved.any()):
        device = cache.keys[0].device
        cache.move_rows(index[moved].to(device), dst[moved].to(device))


# --------------------------------------------------------------------------- generation


@dataclass
class Generation:
    output_ids: list[int]
    """New tokens, ending with the stop token when one ended the response."""
    acceptance_lengths: list[int] = field(default_factory=list)
    """Per verify cycle, the tokens it committed: acc + 1, cut at a stop token or the budget.
    The first new token comes from the prefill, so len(output_ids) = 1 + sum(these)."""
    stopped: bool = False
    """Ended on a stop token (else on max_new_tokens)."""
    seconds: float = 0.0
    """Wall-clock time of the whole call, prefill included (CUDA synchronized), less the time
    spent capturing graphs during it (the engine reports that); from a batched call, the whole
    batch's time (the same for every row)."""
    first_token_seconds: float | None = None
    """Speculative calls: the part of `seconds` until the first new tokens were on the host
    (the prefill and its token choice)."""
    first_cycle_seconds: float | None = None
    """Speculative calls: the part of `seconds` until the first cycle's packets were on the host
    (None when the prefill's token ended the call)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt_list(prompts) -> list[torch.Tensor]:
    rows = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    for i, r in enumerate(rows):
        if r.numel() == 0:
            raise ValueError(f"prompt {i} is empty")
    return rows


def _row_seeds(seed: int | Sequence[int], num_rows: int) -> list[int]:
    seeds = [int(seed)] * num_rows if isinstance(seed, int) else [int(x) for x in seed]
    if len(seeds) != num_rows:
        raise ValueError(f"{len(seeds)} seeds for {num_rows} prompts")
    return seeds


def _check_budget(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


class Decoder:
    """The decoding engine of one target (and optionally one proposer) for a process: the
    target's steps and caches (decode.TargetSteps, tapping the proposer's layers) and the
    proposer's, sized for `rows` rows of `capacity` positions, grown when a call needs more.
    Graphs are captured once per shape bucket and reused by every later call;
    `capture_seconds` says how long capturing took. `graphs=False` runs everything eagerly
    (what CPU always does). `attention`: the target's decode and verify steps' (TargetSteps)."""

    def __init__(self, model, proposer: Proposer | None = None, *, rows: int = 1, capacity: int = 0,
                 temperature: float = 0.0, top_p: float = 1.0, graphs: bool = True, attention: str = "auto") -> None:
        self.model, self.proposer = model, proposer
        self.device = model.get_input_embeddings().weight.device
        self.temperature, self.top_p, self.use_graphs = float(temperature), float(top_p), bool(graphs)
        self.attention = attention
        self.taps = LayerTaps(model, proposer.target_layer_ids) if proposer is not None else None
        self.target: TargetSteps | None = None
        self._fit(rows, capacity)

    def _fit(self, rows: int, capacity: int) -> None:
        """Caches of at least `rows` rows and `capacity` positions (rebuilt, graphs dropped, when
        a call needs more than the current ones hold)."""
        block = int(self.proposer.block_size) if self.proposer is not None else 1
        capacity = max(int(capacity), 2 * block + 2)
        if self.target is not None and self.target.cache.rows >= rows and self.target.capacity >= capacity:
            return
        if self.target is not None:
            rows, capacity = max(rows, self.target.cache.rows), max(capacity, 2 * self.target.capacity)
            self.target.graphs.clear()  # freed here, outside any capture (Graphs._capture says why)
        self.target = TargetSteps(self.model, rows, capacity, temperature=self.temperature, top_p=self.top_p,
                                  taps=self.taps, graphs=self.use_graphs, attention=self.attention)

    @property
    def capture_seconds(self) -> float:
        own = self.target.graphs.capture_seconds if self.target is not None else 0.0
        return own + getattr(getattr(self.proposer, "graphs", None), "capture_seconds", 0.0)

    @torch.inference_mode()
    def capture(self, rows: int = 1, capacity: int = 0) -> None:
        """Capture, ahead of time, every graph a call of up to `rows` rows within `capacity`
        positions can replay (on CUDA with graphs on; nothing otherwise): the prefills and the
        prompt context writes of up to PREFILL_GRAPH_ROWS rows, the decode steps and the cycles
        (or verify steps). The inputs are dummies that write only where nothing reads before it
        is written again (the trash column; column 0 and the first block columns of both caches,
        which every sequence's prefill and first cycle rewrite)."""
        self._fit(rows, capacity)
        if not self.target.graphs.enabled:
            return
        device, steps, proposer = self.device, self.target, self.proposer
        one = torch.zeros(1, dtype=torch.long, device=device)
        _, features = steps.prefill(torch.arange(1, device=device), [one], one)  # allocates the caches
        B = int(proposer.block_size) if proposer is not None else 1
        if proposer is not None:
            proposer.reset(steps.cache.rows, steps.capacity)
        fused = isinstance(proposer, DFlashProposer) and features is not None
        if fused:  # the drafter's buffers, allocated by an eager block step on this stream
            zero = torch.zeros(1, dtype=torch.long, device=device)
            proposer.block_body(zero, zero, features.new_zeros(1, B + 1, features.shape[-1]), zero, B)
        for R in [r for r in steps.rows if r <= rows]:
            zeros = torch.zeros(R, dtype=torch.long, device=device)
            pos = torch.full((R,), -1, dtype=torch.long, device=device)
            for W in steps.widths:
                steps.decode(zeros, pos, zeros, W - 1)
                if R <= PREFILL_GRAPH_ROWS:
                    steps.capture_prefill(R, W)
                if fused and R <= PREFILL_GRAPH_ROWS and W > B:  # a prompt's context, written ahead
                    proposer.write_context(zeros, zeros, features.new_zeros(R, W, features.shape[-1]), W)
                if proposer is None:
                    continue
                if fused and W >= B:  # dummies: anchored at 0 with no context (columns 0..B-1)
                    context = features.new_zeros(R, B, features.shape[-1])
                    steps.graphs.run(("cycle", R, W), self._cycle_fn(W), zeros, zeros, context, zeros, zeros)
                elif not fused:
                    steps.verify(torch.zeros(R, B, dtype=torch.long, device=device), pos[:, None].expand(R, B),
                                 zeros, W - 1)

    def close(self) -> None:
        if self.taps is not None:
            self.taps.__exit__(None, None, None)

    # ----------------------------------------------------------------------- target only

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens: int, *, stop_ids: Iterable[int] = (),
                 seed: int | Sequence[int] = 0) -> list[Generation]:
        """Target-only decoding of R prompts, one token per row per step (slots.SlotDecoder on
        this engine's steps): each row's output is the one it gets alone (up to the rounding of
        batched forwards). `seconds` is the whole batch's."""
        _check_budget(max_new_tokens)
        rows = _prompt_list(prompts)
        if not rows:
            return []
        seeds = _row_seeds(seed, len(rows))
        self._fit(len(rows), max(r.numel() for r in rows) + max_new_tokens + 2)
        _sync(self.device)
        started, captured = time.perf_counter(), self.capture_seconds
        # Each step read before the next is queued, as the speculative loop reads each cycle.
        slots = SlotDecoder(self.target, len(rows), stop_ids=stop_ids, overlap=False)
        for i, (r, s) in enumerate(zip(rows, seeds)):
            slots.add(i, r, max_new_tokens, s)
        done = {f.key: f for f in slots.run()}
        _sync(self.device)
        seconds = time.perf_counter() - started - (self.capture_seconds - captured)
        return [Generation(done[i].output_ids, [], done[i].stopped, seconds) for i in range(len(rows))]

    # ----------------------------------------------------------------------- speculative

    def _survivors(self, rows: list[int], outs, stop: set[int], max_new_tokens: int, tensors: tuple):
        """The rows that go on (last token not a stop token, budget not spent) and their rows of
        the per-row `tensors` (None stays None). Finished rows leave: the live ones move into
        the lowest slots of both caches. No row left: ([], tensors)."""
        live = [i for i, r in enumerate(rows) if outs[r][-1] not in stop and len(outs[r]) < max_new_tokens]
        if not live or len(live) == len(rows):
            return [rows[i] for i in live], tensors
        index = torch.tensor(live)  # on the host: the caches' moves need no device sync
        _keep_slots(self.target.cache, index)
        self.proposer.keep_rows(index)
        index = index.to(self.device, non_blocking=True)
        return [rows[i] for i in live], tuple(None if t is None else t.index_select(0, index) for t in tensors)

    def _cycle_fn(self, width: int):
        """One speculative cycle of the DFlash proposer as one step function (one graph per row
        and width bucket): the drafter's block step, the verify step, and what the next cycle
        starts from (its anchor token, anchor, context length), so the host only reads the
        packet [acc, chosen...] of each row."""
        proposer, target, B = self.proposer, self.target, int(self.proposer.block_size)

        def fn(anchor_token_R, anchor_R, context_RTF, context_len_R, seeds_R):
            k_B = torch.arange(B, device=anchor_R.device)
            proposals_RK = proposer.block_body(anchor_token_R, anchor_R, context_RTF, context_len_R, width)
            block_RB = torch.cat([anchor_token_R[:, None], proposals_RK], dim=1)
            chosen_RB, acc_R, feats = target.verify_body(block_RB, anchor_R[:, None] + k_B, seeds_R, width)
            packet = torch.cat([acc_R[:, None], chosen_RB], dim=1)
            return (packet, feats, chosen_RB.gather(1, acc_R[:, None])[:, 0], anchor_R + acc_R + 1, acc_R + 1)
        return fn

    def _prompt_context(self, token_R, anchor_R, context_RTF, longest: int):
        """The first cycle's context in the shape of every later one's, so that it replays the
        captured cycle too instead of running the whole target eagerly once per prompt: the
        drafter's keys and values of all but the last min(L, B) prompt positions of each row
        (prompt length L = anchor) are written into its cache first (DFlashProposer.write_context,
        itself captured at batch 1), and the last positions become the first cycle's
        context [R, B, F] with its length. `longest`: max(anchor_R) as a host int (the write
        reads up to column head + B = L of the longest row). Returns (context, lengths)."""
        B = int(self.proposer.block_size)
        keep_R = anchor_R.clamp(max=B)
        head_R = anchor_R - keep_R
        T, F = context_RTF.shape[1:]
        index_RB = (head_R[:, None] + torch.arange(B, device=anchor_R.device)).clamp(max=T - 1)
        first_RBF = context_RTF.gather(1, index_RB[:, :, None].expand(-1, -1, F))
        if longest > B:  # else every prompt fits in the first cycle's context
            self.proposer.write_context(token_R, head_R, context_RTF, int(longest))
        return first_RBF, keep_R

    def _speculate_fused(self, outs, accepted, lengths, token_R, anchor_R, context_RTF, seeds_R, stop,
                         max_new_tokens, started, captured, marks) -> list[Generation]:
        """Decoder.speculate's cycles for the DFlash proposer: each cycle one `_cycle_fn` run
        (captured per bucket; the first one too, after `_prompt_context`; eager only while the
        drafter's cache buffers do not exist yet)."""
        proposer, target, device = self.proposer, self.target, self.device
        B = int(proposer.block_size)
        context_RTF, context_len_R = self._prompt_context(token_R, anchor_R, context_RTF, max(lengths))
        rows = list(range(len(outs)))
        while True:
            rows, (token_R, anchor_R, context_len_R, seeds_R, context_RTF) = self._survivors(
                rows, outs, stop, max_new_tokens, (token_R, anchor_R, context_len_R, seeds_R, context_RTF))
            if not rows:
                break
            R = len(rows)
            max_anchor = max(lengths[r] + len(outs[r]) - 1 for r in rows)
            W = pick(max_anchor + B, target.widths)
            inputs = (token_R, anchor_R, context_RTF, context_len_R, seeds_R)
            if context_RTF.shape[1] != B or not proposer.ready:  # the first cycle: eager, any shape
                packet, feats, token_R, anchor_R, context_len_R = self._cycle_fn(max_anchor + B)(*inputs)
            else:
                Rb = pick(R, target.rows)
                if Rb > R:  # padding rows: anchored at 0 in free slots, no context
                    inputs = tuple(torch.cat([t, t.new_zeros(Rb - R, *t.shape[1:])]) for t in inputs)
                packet, feats, token_R, anchor_R, context_len_R = (
                    t[:R] for t in target.graphs.run(("cycle", Rb, W), self._cycle_fn(W), *inputs))
            context_RTF = feats
            # The cycle's one host sync: every row's acceptance count and the target's tokens.
            _commit(rows, packet.tolist(), outs, accepted, stop, max_new_tokens)
            if len(marks) == 1:
                marks.append(time.perf_counter() - started - (self.capture_seconds - captured))
        _sync(device)
        seconds = time.perf_counter() - started - (self.capture_seconds - captured)
        return [Generation(o, a, o[-1] in stop, seconds, *_marks(marks)) for o, a in zip(outs, accepted)]

    @torch.inference_mode()
    def speculate(self, prompts, max_new_tokens: int, *, stop_ids: Iterable[int] = (),
                  seed: int | Sequence[int] = 0) -> list[Generation]:
        """Speculative decoding of R prompts at once: one drafter step and one verify step per
        cycle for every live row, each row with its own anchor, acceptance and positions. Row by
        row the same tokens, acceptance lengths and stops as decoding it alone (up to the
        rounding of batched forwards: exact in float32 on CPU in the tests). A finished row
        leaves the batch (both caches drop it); `seconds` is the whole batch's."""
        _check_budget(max_new_tokens)
        prompt_rows = _prompt_list(prompts)
        if not prompt_rows:
            return []
        proposer, device = self.proposer, self.device
        R, B = len(prompt_rows), int(proposer.block_size)
        lengths = [p.numel() for p in prompt_rows]
        seeds = _row_seeds(seed, R)
        capacity = max(lengths) + max_new_tokens + B + 2
        self._fit(R, capacity)
        stop = set(int(s) for s in stop_ids)
        outs: list[list[int]] = [[] for _ in range(R)]
        accepted: list[list[int]] = [[] for _ in range(R)]
        _sync(device)
        started, captured = time.perf_counter(), self.capture_seconds
        seq_RS = torch.zeros(R, max(lengths) + max_new_tokens + B, dtype=torch.long, device=device)
        for i, p in enumerate(prompt_rows):
            seq_RS[i, : p.numel()] = p.to(device)
        seeds_R = torch.tensor(seeds, device=device)
        token_R, context_RTF = self.target.prefill(torch.arange(R, device=device), prompt_rows, seeds_R)
        anchor_R = torch.tensor(lengths, device=device)
        context_len_R = anchor_R.clone()  # the first context: every prompt position
        seq_RS.scatter_(1, anchor_R[:, None], token_R[:, None])
        for r, t in enumerate(token_R.tolist()):  # host sync: the first tokens' stop checks
            outs[r].append(t)
        marks = [time.perf_counter() - started - (self.capture_seconds - captured)]  # first token, first cycle
        # As many rows as the target's cache: the fused cycle pads R up to its row buckets.
        proposer.reset(self.target.cache.rows, self.target.capacity)
        if isinstance(proposer, DFlashProposer) and context_RTF is not None:
            return self._speculate_fused(outs, accepted, lengths, token_R, anchor_R, context_RTF, seeds_R, stop,
                                         max_new_tokens, started, captured, marks)
        k_B = torch.arange(B, device=device)
        rows = list(range(R))  # the prompt of each live row (live rows sit in slots 0..n-1)
        while True:
            rows, (seq_RS, anchor_R, context_len_R, seeds_R, context_RTF) = self._survivors(
                rows, outs, stop, max_new_tokens, (seq_RS, anchor_R, context_len_R, seeds_R, context_RTF))
            if not rows:
                break
            anchors = [lengths[r] + len(outs[r]) - 1 for r in rows]  # each row's last committed token
            proposals_RK = proposer.propose_batch(seq_RS, anchor_R, context_RTF, context_len_R, max(anchors))
            block_RB = torch.cat([seq_RS.gather(1, anchor_R[:, None]), proposals_RK.to(device, torch.long)], dim=1)
            pos_RB = anchor_R[:, None] + k_B
            chosen_RB, acc_R, features = self.target.verify(block_RB, pos_RB, seeds_R, max(anchors) + B - 1)
            # The cycle's one host sync: every row's acceptance count and the target's tokens.
            host = torch.cat([acc_R[:, None], chosen_RB], dim=1).tolist()
            _commit(rows, host, outs, accepted, stop, max_new_tokens)
            if len(marks) == 1:
                marks.append(time.perf_counter() - started - (self.capture_seconds - captured))
            # Positions anchor .. anchor+acc of each row are committed; their features are the
            # next context. Tokens written past that are overwritten before they are read.
            context_RTF = None if self.taps is None or not self.taps.layer_ids else features
            context_len_R = acc_R + 1
            seq_RS.scatter_(1, pos_RB + 1, chosen_RB)
            anchor_R = anchor_R + context_len_R
        _sync(device)
        seconds = time.perf_counter() - started - (self.capture_seconds - captured)
        return [Generation(outs[r], accepted[r], outs[r][-1] in stop, seconds, *_marks(marks)) for r in range(R)]


def _marks(marks: list[float]) -> tuple[float, float | None]:
    """(first_token_seconds, first_cycle_seconds) from a call's time marks."""
    return marks[0], (marks[1] if len(marks) > 1 else None)


def _commit(rows: list[int], packets: list[list[int]], outs, accepted, stop: set[int], max_new_tokens: int) -> None:
    """Book one cycle of every row from its packet [acc, target tokens...]: the accepted
    proposals (equal to the target's tokens) and the target's bonus token, cut after a stop
    token or at the budget; the acceptance length is what was kept."""
    for r, (acc, *chosen) in zip(rows, packets):
        committed = chosen[: acc + 1]
        keep = next((i + 1 for i, t in enumerate(committed) if t in stop), len(committed))
        keep = min(keep, max_new_tokens - len(outs[r]))
        outs[r].extend(committed[:keep])
        accepted[r].append(keep)


# --------------------------------------------------------------------------- one-call forms


def target_generate_batch(model, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                          stop_ids: Iterable[int] = (), seed: int | Sequence[int] = 0,
                          engine: Decoder | None = None) -> list[Generation]:
    """Target-only decoding of R prompts (see Decoder.generate); `seed` is one seed for all rows
    or one per row. Without `engine`, one is built for this call."""
    engine = engine or Decoder(model, temperature=temperature, top_p=top_p, rows=max(1, len(prompts)))
    return engine.generate(prompts, max_new_tokens, stop_ids=stop_ids, seed=seed)


def target_generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                    stop_ids: Iterable[int] = (), seed: int = 0, engine: Decoder | None = None) -> Generation:
    """Target-only decoding of one prompt: the reference that speculative decoding must
    reproduce, and the baseline of the speedup."""
    return target_generate_batch(model, [_one_prompt(prompt_ids)], max_new_tokens, temperature=temperature,
                                 top_p=top_p, stop_ids=stop_ids, seed=seed, engine=engine)[0]


def speculative_generate_batch(model, prompts, proposer: Proposer, max_new_tokens: int, *,
                               temperature: float = 0.0, top_p: float = 1.0, stop_ids: Iterable[int] = (),
                               seed: int | Sequence[int] = 0, engine: Decoder | None = None) -> list[Generation]:
    """Speculative decoding of R prompts with `proposer` (see Decoder.speculate); `seed` is one
    seed for all rows or one per row. Without `engine`, one is built for this call."""
    if engine is None:
        engine = Decoder(model, proposer, temperature=temperature, top_p=top_p, rows=max(1, len(prompts)))
        try:
            return engine.speculate(prompts, max_new_tokens, stop_ids=stop_ids, seed=seed)
        finally:
            engine.close()
    return engine.speculate(prompts, max_new_tokens, stop_ids=stop_ids, seed=seed)


def speculative_generate(model, prompt_ids, proposer: Proposer, max_new_tokens: int, *, temperature: float = 0.0,
                         top_p: float = 1.0, stop_ids: Iterable[int] = (), seed: int = 0,
                         engine: Decoder | None = None) -> Generation:
    """Speculative decoding of one prompt (REFERENCE.md section 2): at T = 0 the output is token
    for token the target-only greedy output; at T > 0 it is target_generate's sample with the
    same seed."""
    return speculative_generate_batch(model, [_one_prompt(prompt_ids)], proposer, max_new_tokens,
                                      temperature=temperature, top_p=top_p, stop_ids=stop_ids, seed=seed,
                                      engine=engine)[0]


def _one_prompt(prompt_ids) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"one non-empty prompt at a time (batch size 1), got shape {tuple(ids.shape)}")
    return ids[0]


# --------------------------------------------------------------------------- statistics


def mean_acceptance(lengths: Iterable[int]) -> float:
    """tau over cycles: the mean acceptance length (nan when there was no cycle)."""
    lengths = list(lengths)
    return sum(lengths) / len(lengths) if lengths else float("nan")


def turn_mean_tau(turns: Iterable[Sequence[int]]) -> float:
    """tau of a prompt set as the paper reports it: the mean over turns of each turn's mean
    acceptance length (turns without a cycle, answered by the prefill alone, are left out)."""
    means = [mean_acceptance(t) for t in turns if len(t)]
    return sum(means) / len(means) if means else float("nan")


def acceptance_histogram(lengths: Iterable[int], block_size: int) -> list[int]:
    """Counts of acceptance lengths 1..block_size (index 0 counts length 1)."""
    hist = [0] * block_size
    for n in lengths:
        if not 1 <= n <= block_size:
            raise ValueError(f"acceptance length {n} outside [1, {block_size}]")
        hist[n - 1] += 1
    return hist
