"""Continuous batching on the decoding engine: `SlotDecoder`, target-only decoding of many
prompts with rows refilled as they finish, the engine of `data regenerate` (and of evaluation's
target-only side).

The host's work between two decode steps (reading the step's tokens, retiring and refilling
rows, and the caller's own: rendering and tokenizing the next turns, turning finished ids into
text) runs in series with the GPU unless the next step is already queued. With `overlap` (the
default) a step is launched before the previous one's tokens are read: the GPU decodes
step k + 1 while the host books step k. A row whose last token comes out of step k has then
already been decoded once more by step k + 1; that token is dropped, and its write lands in
the row's own slot at a position its budget leaves room for (below the trash column), which the
slot's next occupant overwrites before it reads it. Outputs are unchanged: a row's tokens
depend only on its prompt, seed and budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from dflash_train.decode import PREFILL_TOKENS, TargetSteps, pick


@dataclass
class Finished:
    key: object
    output_ids: list[int]
    stopped: bool


@dataclass
class _Launched:
    """A decode step in flight: the (slot, row) pairs it decodes, as they were at launch, and
    its tokens on their way to the host (`ready` fires when they are there; None on CPU)."""

    rows: list[tuple[int, dict]]
    tokens: torch.Tensor
    ready: torch.cuda.Event | None

    def wait(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tokens.tolist()


class SlotDecoder:
    """Target-only decoding of many prompts with rows refilled as they finish: `add` queues a
    prompt (ids, budget, seed) under a key; each `step` refills free slots (once at least
    `refill` of them are free, or when nothing runs), decodes one token for every live row and
    returns the requests that finished. A row's output depends only on its own prompt, seed and
    budget (position-hashed sampling; at T = 0 in float32 the tokens do not depend on what else
    runs), so neither the order of refills nor `overlap` changes anything.

    A finished row leaves a hole (its position set to -1: it writes to the trash column and
    nothing reads it) that the next refill fills, lowest slot first, so a step runs the slots
    0..k-1 of the smallest row bucket holding every live row; once no request waits and the
    live rows fit a smaller bucket, they are moved into the lowest slots.

    `overlap` (default): each step launches the next decode step before it reads the tokens of
    the one before (module docstring; on CPU it changes nothing but the order of the work). `seconds` counts the host's time spent in
    refills (`prefill`: the prefill forward and its first tokens) and blocked on the GPU for a
    step's tokens (`wait`); the rest of a caller's wall time is host work."""

    def __init__(self, steps: TargetSteps, rows: int | None = None, *, stop_ids: Iterable[int] = (),
                 refill: int | None = None, prefill_tokens: int = PREFILL_TOKENS, overlap: bool = True) -> None:
        self.steps = steps
        self.device = steps.device
        rows = steps.cache.rows if rows is None else min(int(rows), steps.cache.rows)
        self.max_rows = int(rows)
        self.refill = max(1, int(refill if refill is not None else rows // 8))
        self.prefill_tokens = int(prefill_tokens)
        self.overlap = bool(overlap)
        self.stop = set(int(s) for s in stop_ids)
        self.pending: list[tuple[object, torch.Tensor, int, int]] = []
        # per slot: key, slot, pos (the column its next launched step writes), budget, out, live; None = a hole
        self.slots: list[dict | None] = []
        self.token_R = torch.zeros(0, dtype=torch.long, device=self.device)
        self.pos_R = torch.zeros(0, dtype=torch.long, device=self.device)
        self.seed_R = torch.zeros(0, dtype=torch.long, device=self.device)
        self.ahead: _Launched | None = None  # the step launched and not yet read
        self.generated = 0  # new tokens so far (prefill tokens included)
        self.seconds = {"prefill": 0.0, "wait": 0.0}

    @classmethod
    def for_model(cls, model, rows: int, capacity: int, *, temperature: float = 0.0, top_p: float = 1.0,
                  graphs: bool = True, attention: str = "auto", **kw) -> "SlotDecoder":
        """A SlotDecoder on its own TargetSteps (caches of `rows` x `capacity`)."""
        return cls(TargetSteps(model, rows, capacity, temperature=temperature, top_p=top_p, graphs=graphs,
                               attention=attention), **kw)

    def add(self, key, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> None:
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
        if prompt.numel() == 0:
            raise ValueError(f"request {key!r}: empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"request {key!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if prompt.numel() + max_new_tokens > self.steps.capacity - 1:
            raise ValueError(f"request {key!r}: {prompt.numel()} prompt + {max_new_tokens} new tokens exceed the "
                             f"cache ({self.steps.capacity - 1} positions)")
        self.pending.append((key, prompt, int(max_new_tokens), int(seed)))

    @property
    def num_live(self) -> int:
        return sum(row is not None for row in self.slots)

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.num_live)

    def _fill(self) -> list[Finished]:
        live = self.num_live
        free = self.max_rows - live
        if not self.pending or free <= 0 or (live and free < min(self.refill, len(self.pending))):
            return []
        began = time.perf_counter()
        holes = [i for i, row in enumerate(self.slots) if row is None]
        holes += list(range(len(self.slots), self.max_rows))
        take, longest = [], 0
        while self.pending and len(take) < free:
            n = self.pending[0][1].numel()
            if take and (len(take) + 1) * max(longest, n) > self.prefill_tokens:
                break
            take.append(self.pending.pop(0))
            longest = max(longest, n)
        chosen = holes[: len(take)]
        used = max(len(self.slots), chosen[-1] + 1)
        if used > len(self.slots):  # grow the per-slot tensors (new slots start as holes)
            grow = used - len(self.slots)
            self.slots += [None] * grow
            self.token_R = torch.cat([self.token_R, self.token_R.new_zeros(grow)])
            self.pos_R = torch.cat([self.pos_R, self.pos_R.new_full((grow,), -1)])
            self.seed_R = torch.cat([self.seed_R, self.seed_R.new_zeros(grow)])
        # Queued behind a step in flight, if any: that step's writes to these slots (rows it
        # decoded once past their end) land first, and the prompts overwrite them.
        slots = torch.tensor(chosen, device=self.device)
        seeds = torch.tensor([t[3] for t in take], device=self.device)
        first, _ = self.steps.prefill(slots, [t[1] for t in take], seeds, features=False)
        self.token_R[slots] = first
        self.pos_R[slots] = torch.tensor([t[1].numel() for t in take], device=self.device)
        self.seed_R[slots] = seeds
        for slot, (key, prompt, budget, _), t in zip(chosen, take, first.tolist()):  # host sync: first tokens
            self.slots[slot] = {"key": key, "slot": slot, "pos": prompt.numel(), "budget": budget, "out": [t],
                                "live": True}
        self.generated += len(take)
        self.seconds["prefill"] += time.perf_counter() - began
        return self._retire(chosen)

    def _retire(self, candidates: Iterable[int]) -> list[Finished]:
        """Rows whose last token is a stop token or whose budget is spent leave their slot."""
        done, holes = [], []
        for i in candidates:
            row = self.slots[i]
            stopped = row["out"][-1] in self.stop
            if stopped or len(row["out"]) >= row["budget"]:
                done.append(Finished(row["key"], row["out"], stopped))
                row["live"] = False  # a step in flight may still decode it: its token is dropped
                self.slots[i] = None
                holes.append(i)
        if holes:
            self.pos_R[torch.tensor(holes, device=self.device)] = -1
        while self.slots and self.slots[-1] is None:
            self.slots.pop()
        used = len(self.slots)
        self.token_R, self.pos_R, self.seed_R = self.token_R[:used], self.pos_R[:used], self.seed_R[:used]
        if not self.pending and used and pick(self.num_live, self.steps.rows) < pick(used, self.steps.rows):
            self._compact()
        return done

    def _compact(self) -> None:
        live = [i for i, row in enumerate(self.slots) if row is not None]
        moves = [(i, j) for j, i in enumerate(live) if i != j]
        if moves:  # queued behind a step in flight: its writes move with the rows
            src = torch.tensor([i for i, _ in moves], device=self.device)
            dst = torch.tensor([j for _, j in moves], device=self.device)
            self.steps.cache.move_rows(src, dst)
        index = torch.tensor(live, dtype=torch.long, device=self.device)
        self.token_R, self.pos_R, self.seed_R = (t.index_select(0, index) for t in (self.token_R, self.pos_R, self.seed_R))
        self.slots = [self.slots[i] for i in live]
        for slot, row in enumerate(self.slots):
            row["slot"] = slot

    def _launch(self) -> _Launched:
        """Queue one decode step of every live row; the rows' next tokens and positions become
        the step's outputs on the device, so the next step can be queued before these are read."""
        rows = [(i, row) for i, row in enumerate(self.slots) if row is not None]
        max_pos = max(row["pos"] for _, row in rows)
        next_R = self.steps.decode(self.token_R, self.pos_R, self.seed_R, max_pos)
        # Copied out before anything else is queued: a graph's output is rewritten by its next replay.
        tokens = next_R.to("cpu", non_blocking=True, copy=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self.token_R = next_R.clone()
        self.pos_R = torch.where(self.pos_R >= 0, self.pos_R + 1, self.pos_R)
        for _, row in rows:
            row["pos"] += 1
        return _Launched(rows, tokens, ready)

    def step(self) -> list[Finished]:
        """Refill, one decode step for every live row, retire. Returns the finished requests.
        With `overlap` the step after it is queued before this one's tokens are read."""
        done = self._fill()
        if not self.num_live:
            self.ahead = None  # it decoded retired rows only
            return done
        launched = self.ahead if self.ahead is not None else self._launch()
        self.ahead = self._launch() if self.overlap else None
        began = time.perf_counter()
        tokens = launched.wait()  # host sync: the step's one
        self.seconds["wait"] += time.perf_counter() - began
        booked = []
        for slot, row in launched.rows:  # `slot`: where the row was at launch; rows may have moved since
            if row["live"]:
                row["out"].append(tokens[slot])
                booked.append(row["slot"])
        self.generated += len(booked)
        return done + self._retire(booked)

    def run(self) -> Iterable[Finished]:
        """Step until every added request finished, yielding them as they finish."""
        while self.busy:
            yield from self.step()
