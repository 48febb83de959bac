"""Decoding against the target: speculative and target-only, on one engine per process.

Owns `Decoder` and the generate functions that drive it. Speculative decoding runs R prompts at
once (batch 1 is one row), in one loop of cycles whatever the proposer: every cycle the
proposer proposes B-1 tokens for every live row from its anchor (last committed token) and the
context features it has not seen yet; the target verifies every row's block in one forward and
chooses its own token at every position; the longest prefix of proposals equal to the
target's tokens is accepted, plus the target's own next token; the verify pass's tapped
features of the committed positions become the next context. Rows advance by their own
acceptance; a finished row leaves. With the DFlash proposer (proposer.py) and the target's
features, a cycle is one step function, the drafter's block step and the verify step
together, captured as one CUDA graph per bucket; any other proposer (or no features) runs its
`propose_batch` and then the target's verify step.

Target-only decoding is the reference speculative decoding must reproduce, and the baseline
of the speedup. Both run on decode.py's engine (static position-addressed caches, shape
buckets, CUDA graphs on a GPU, eager on CPU), built once per process and reused across
prompts. Token choice is `sampling.choose`: the token committed at position p is always the
target's own choice at p (argmax, or the sample drawn at the position-hashed uniform number of
(seed, p)), conditioned on the committed prefix; proposals only decide how many of those one
verify forward yields. So at T = 0 the output is the target's greedy output, and at T > 0
target-only sampling with the same seed gives the same tokens, not only the same distribution.
The statistics of the acceptance lengths a call reports are acceptance.py's.

Shape legend: R rows, S committed tokens, T new context tokens, F = n*H tapped features,
B block size, V vocabulary, W key columns read by a forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from dflash_train.core.devices import synchronize
from dflash_train.core.target import LayerTaps
from dflash_train.engine.decode import PREFILL_GRAPH_ROWS, TargetSteps, pick
from dflash_train.engine.proposer import DFlashProposer, Proposer
from dflash_train.engine.slots import SlotDecoder


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


@dataclass
class Speculation:
    """The state of one `Decoder.speculate` call. On the host: the prompts, the stop ids and
    budget, each prompt's output and acceptance lengths, `rows` (the prompt of each live row;
    live rows sit in slots 0..n-1 of both caches) and the call's clock. On the device, the live
    rows' tensors (PER_ROW, in slot order): anchor (the position of the last committed token),
    seed, the new context and its length, and what the cycle reads the anchor token from:
    `token_R` (the fused cycle) or the committed ids `seq_RS` (a proposer's `propose_batch`).
    The prefill sets both; the loop drops (sets to None) the one its cycle does not read."""

    prompts: list[torch.Tensor]
    stop: set[int]
    max_new_tokens: int
    started: float
    captured: float
    """The engine's capture_seconds at `started`: capture time is left out of the clock."""
    anchor_R: torch.Tensor
    seeds_R: torch.Tensor
    token_R: torch.Tensor | None
    seq_RS: torch.Tensor | None
    context_RTF: torch.Tensor | None
    context_len_R: torch.Tensor
    rows: list[int] = field(default_factory=list)
    outs: list[list[int]] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)
    marks: list[float] = field(default_factory=list)
    """Seconds until the first tokens, and until the first cycle's, were on the host."""

    PER_ROW = ("seq_RS", "token_R", "anchor_R", "context_len_R", "seeds_R", "context_RTF")

    def __post_init__(self) -> None:
        self.rows = list(range(len(self.prompts)))
        self.outs = [[] for _ in self.prompts]
        self.accepted = [[] for _ in self.prompts]

    @property
    def lengths(self) -> list[int]:
        return [p.numel() for p in self.prompts]

    def elapsed(self, capture_seconds: float) -> float:
        """Seconds since `started`, less the graph capture time since then."""
        return time.perf_counter() - self.started - (capture_seconds - self.captured)

    def max_anchor(self) -> int:
        """The largest anchor of the live rows, from the host's books (no device sync)."""
        return max(self.prompts[r].numel() + len(self.outs[r]) - 1 for r in self.rows)

    def live(self) -> list[int]:
        """Indices into `rows` of the rows that go on: last token not a stop token, budget not
        spent."""
        return [i for i, r in enumerate(self.rows)
                if self.outs[r][-1] not in self.stop and len(self.outs[r]) < self.max_new_tokens]

    def keep(self, live: list[int], index_R: torch.Tensor) -> None:
        """Only the rows `live` (indices into `rows`) go on: `rows` keeps their prompts, each
        per-row tensor their rows (index_R: the same indices on the device; None stays None)."""
        self.rows = [self.rows[i] for i in live]
        for name in self.PER_ROW:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, index_R))

    def commit(self, packets: list[list[int]]) -> None:
        """Book one cycle of every live row from its packet [acc, target tokens...]: the
        accepted proposals (equal to the target's tokens) and the target's bonus token, cut
        after a stop token or at the budget; the acceptance length is what was kept."""
        for r, (acc, *chosen) in zip(self.rows, packets):
            committed = chosen[: acc + 1]
            keep = next((i + 1 for i, t in enumerate(committed) if t in self.stop), len(committed))
            keep = min(keep, self.max_new_tokens - len(self.outs[r]))
            self.outs[r].extend(committed[:keep])
            self.accepted[r].append(keep)

    def generations(self, seconds: float) -> list[Generation]:
        first_cycle = self.marks[1] if len(self.marks) > 1 else None
        return [Generation(o, a, o[-1] in self.stop, seconds, self.marks[0], first_cycle)
                for o, a in zip(self.outs, self.accepted)]


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


def _committed_ids(prompts: list[torch.Tensor], width: int, device) -> torch.Tensor:
    """[R, width] ids: each prompt at the start of its row, zeros after it."""
    seq_RS = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        seq_RS[i, : p.numel()] = p.to(device)
    return seq_RS


def _pad_zero_rows(rows: int, inputs: tuple) -> tuple:
    """Per-row inputs padded with zero rows up to `rows` (padding rows: anchored at 0 in free
    slots, no context)."""
    R = inputs[0].shape[0]
    return inputs if rows == R else tuple(torch.cat([t, t.new_zeros(rows - R, *t.shape[1:])]) for t in inputs)


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
        synchronize(self.device)
        started, captured = time.perf_counter(), self.capture_seconds
        # Each step read before the next is queued, as the speculative loop reads each cycle.
        slots = SlotDecoder(self.target, len(rows), stop_ids=stop_ids, overlap=False)
        for i, (r, s) in enumerate(zip(rows, seeds)):
            slots.add(i, r, max_new_tokens, s)
        done = {f.key: f for f in slots.run()}
        synchronize(self.device)
        seconds = time.perf_counter() - started - (self.capture_seconds - captured)
        return [Generation(done[i].output_ids, [], done[i].stopped, seconds) for i in range(len(rows))]

    # ----------------------------------------------------------------------- speculative

    @torch.inference_mode()
    def speculate(self, prompts, max_new_tokens: int, *, stop_ids: Iterable[int] = (),
                  seed: int | Sequence[int] = 0) -> list[Generation]:
        """Speculative decoding of R prompts at once: one proposal step and one verify step per
        cycle for every live row, each row with its own anchor, acceptance and positions. Row by
        row the same tokens, acceptance lengths and stops as decoding it alone (up to the
        rounding of batched forwards: exact in float32 on CPU in the tests). A finished row
        leaves the batch (both caches drop it); `seconds` is the whole batch's.

        The one loop of every proposer: the call's state is a Speculation; a cycle is
        `_fused_cycle` (the DFlash proposer with features) or `_proposer_cycle` (any other),
        each queuing its device work, advancing the state's per-row tensors and returning the
        packets [acc, target tokens...] that the loop reads in the cycle's one host sync."""
        _check_budget(max_new_tokens)
        prompt_rows = _prompt_list(prompts)
        if not prompt_rows:
            return []
        call = self._prefill(prompt_rows, max_new_tokens, stop_ids, seed)
        if isinstance(self.proposer, DFlashProposer) and call.context_RTF is not None:
            cycle, call.seq_RS = self._fused_cycle, None  # it reads the anchor token from token_R
            call.context_RTF, call.context_len_R = self._prompt_context(call.token_R, call.anchor_R, call.context_RTF,
                                                                        max(call.lengths))
        else:
            cycle, call.token_R = self._proposer_cycle, None  # a proposer reads the committed ids
        while self._survivors(call):
            packets = cycle(call)
            call.commit(packets.tolist())  # the cycle's one host sync: acceptance counts and the target's tokens
            if len(call.marks) == 1:
                call.marks.append(call.elapsed(self.capture_seconds))
        synchronize(self.device)
        return call.generations(call.elapsed(self.capture_seconds))

    def _prefill(self, prompt_rows: list[torch.Tensor], max_new_tokens: int, stop_ids: Iterable[int],
                 seed: int | Sequence[int]) -> Speculation:
        """A speculate call's start: the caches fitted, the clock started, the prompts prefilled
        into slots 0..R-1 (each row's first new token read: the first time mark; both the
        anchor token and the committed ids [R, S] hold it) and the proposer reset to as many
        rows as the target's cache (the fused cycle pads R up to its row buckets)."""
        R, B = len(prompt_rows), int(self.proposer.block_size)
        lengths = [p.numel() for p in prompt_rows]
        seeds = _row_seeds(seed, R)
        self._fit(R, max(lengths) + max_new_tokens + B + 2)
        synchronize(self.device)
        started, captured = time.perf_counter(), self.capture_seconds
        seq_RS = _committed_ids(prompt_rows, max(lengths) + max_new_tokens + B, self.device)
        seeds_R = torch.tensor(seeds, device=self.device)
        token_R, context_RTF = self.target.prefill(torch.arange(R, device=self.device), prompt_rows, seeds_R)
        anchor_R = torch.tensor(lengths, device=self.device)
        call = Speculation(prompt_rows, {int(s) for s in stop_ids}, max_new_tokens, started, captured,
                           anchor_R=anchor_R, seeds_R=seeds_R, token_R=token_R, context_RTF=context_RTF,
                           context_len_R=anchor_R.clone(), seq_RS=seq_RS)  # the first context: every prompt position
        seq_RS.scatter_(1, anchor_R[:, None], token_R[:, None])
        for r, t in enumerate(token_R.tolist()):  # host sync: the first tokens' stop checks
            call.outs[r].append(t)
        call.marks.append(call.elapsed(self.capture_seconds))
        self.proposer.reset(self.target.cache.rows, self.target.capacity)
        return call

    def _survivors(self, call: Speculation) -> bool:
        """Whether any row goes on. Finished rows (last token a stop token, budget spent) leave:
        the live ones move into the lowest slots of both caches and keep their rows of the
        call's per-row tensors."""
        live = call.live()
        if live and len(live) < len(call.rows):
            index = torch.tensor(live)  # on the host: the caches' moves need no device sync
            self.target.cache.keep_rows(index)
            self.proposer.keep_rows(index)
            call.keep(live, index.to(self.device, non_blocking=True))
        return bool(live)

    # ----------------------------------------------------------------------- the cycles

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

    def _fused_cycle(self, call: Speculation) -> torch.Tensor:
        """One cycle of the DFlash proposer: one `_cycle_fn` run, replayed from the target's
        graph of its row and width bucket (padding rows anchored at 0 in free slots, no
        context); eager, at its own width, only while the drafter's cache buffers do not exist
        yet or the context is not B wide."""
        target, B, R = self.target, int(self.proposer.block_size), len(call.rows)
        max_anchor = call.max_anchor()
        W = pick(max_anchor + B, target.widths)
        inputs = (call.token_R, call.anchor_R, call.context_RTF, call.context_len_R, call.seeds_R)
        if call.context_RTF.shape[1] != B or not self.proposer.ready:
            outputs = self._cycle_fn(max_anchor + B)(*inputs)
        else:
            Rb = pick(R, target.rows)
            replayed = target.graphs.run(("cycle", Rb, W), self._cycle_fn(W), *_pad_zero_rows(Rb, inputs))
            outputs = (t[:R] for t in replayed)
        packets, call.context_RTF, call.token_R, call.anchor_R, call.context_len_R = outputs
        return packets

    def _proposer_cycle(self, call: Speculation) -> torch.Tensor:
        """One cycle of any proposer: its `propose_batch` on the committed ids, then the target's
        verify step (captured per bucket on its own). Positions anchor .. anchor+acc of each row
        are committed; their features are the next context. Tokens written past that are
        overwritten before they are read."""
        B, max_anchor, seq_RS, anchor_R = int(self.proposer.block_size), call.max_anchor(), call.seq_RS, call.anchor_R
        proposals_RK = self.proposer.propose_batch(seq_RS, anchor_R, call.context_RTF, call.context_len_R, max_anchor)
        block_RB = torch.cat([seq_RS.gather(1, anchor_R[:, None]), proposals_RK.to(self.device, torch.long)], dim=1)
        pos_RB = anchor_R[:, None] + torch.arange(B, device=self.device)
        chosen_RB, acc_R, features = self.target.verify(block_RB, pos_RB, call.seeds_R, max_anchor + B - 1)
        packets = torch.cat([acc_R[:, None], chosen_RB], dim=1)
        call.context_RTF = None if self.taps is None or not self.taps.layer_ids else features
        call.context_len_R = acc_R + 1
        seq_RS.scatter_(1, pos_RB + 1, chosen_RB)
        call.anchor_R = anchor_R + call.context_len_R
        return packets


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
    """Speculative decoding of one prompt: at T = 0 the output is token for token the
    target-only greedy output; at T > 0 it is target_generate's sample with the same seed."""
    return speculative_generate_batch(model, [_one_prompt(prompt_ids)], proposer, max_new_tokens,
                                      temperature=temperature, top_p=top_p, stop_ids=stop_ids, seed=seed,
                                      engine=engine)[0]


def _one_prompt(prompt_ids) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"one non-empty prompt at a time (batch size 1), got shape {tuple(ids.shape)}")
    return ids[0]
