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

The host's bookkeeping is per step, not per row: each slot's request, position, output and
budget live in numpy arrays, a step's tokens are written into its rows' outputs in one
assignment, and the stop and budget checks are array operations; Python touches a row only when
it joins or leaves (a third of the host time of a loop over the rows at 1,024 rows:
docs/PERFORMANCE.md).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from dflash_train.engine.decode import PREFILL_TOKENS, TargetSteps, pick, to_device


@dataclass
class Finished:
    key: object
    output_ids: list[int]
    stopped: bool


@dataclass
class _Launched:
    """A decode step in flight: the slots it decodes and their requests' ids, as they were at
    launch, and its tokens on their way to the host (`ready` fires when they are there; None on
    CPU)."""

    slots: np.ndarray
    rids: np.ndarray
    tokens: torch.Tensor
    ready: torch.cuda.Event | None

    def wait(self) -> np.ndarray:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tokens.numpy()


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
    the one before (module docstring; on CPU it changes nothing but the order of the work).
    `continue_turns`: a request under a finished one's key goes on in the row that holds its keys,
    first in, prefilling only what is new (Continuations): the tokens of prefilling it whole.
    `seconds` counts where the host's time goes: refills (`prefill_s`: the prefill forward and
    its first tokens), queueing decode steps (`launch_s`), blocked on the GPU for a step's
    tokens (`wait_s`) and booking them (`book_s`: outputs, stop and budget checks, rows leaving);
    the rest of a caller's wall time is the caller's own."""

    def __init__(self, steps: TargetSteps, rows: int | None = None, *, stop_ids: Iterable[int] = (),
                 refill: int | None = None, prefill_tokens: int = PREFILL_TOKENS, overlap: bool = True,
                 continue_turns: bool = False) -> None:
        self.steps = steps
        self.device = steps.device
        rows = steps.cache.rows if rows is None else min(int(rows), steps.cache.rows)
        self.max_rows = int(rows)
        self.refill = max(1, int(refill if refill is not None else rows // 8))
        self.prefill_tokens = int(prefill_tokens)
        self.overlap = bool(overlap)
        self.stop = np.array(sorted(set(int(s) for s in stop_ids)), dtype=np.int64)
        self.pending: deque[tuple[int, torch.Tensor, int, int]] = deque()  # rid, prompt, budget, seed
        self.keys: dict[int, object] = {}  # rid -> the caller's key, while the request is queued or live
        self.next_rid = 0
        self.where = np.full(64, -1, dtype=np.int64)  # rid -> its slot while live, else -1
        # Per slot (slots 0..used-1 are in play; trailing holes are trimmed): the request's id
        # (-1: a hole), the column its next launched step writes, its budget, its output so far.
        S = self.max_rows
        self.used = 0
        self.rid_S = np.full(S, -1, dtype=np.int64)
        self.pos_S = np.zeros(S, dtype=np.int64)
        self.budget_S = np.zeros(S, dtype=np.int64)
        self.n_S = np.zeros(S, dtype=np.int64)
        self.out_SC = np.zeros((S, steps.capacity), dtype=np.int64)
        self.num_live = 0
        self.token_R = torch.zeros(0, dtype=torch.long, device=self.device)
        self.pos_R = torch.zeros(0, dtype=torch.long, device=self.device)
        self.seed_R = torch.zeros(0, dtype=torch.long, device=self.device)
        # continue_turns: a finished request's slot keeps the keys of its prompt and answer until
        # another request takes the slot; a request added under the same key whose prompt starts
        # with those ids continues there (Continuations).
        self.continued = Continuations() if continue_turns else None
        self.ahead: _Launched | None = None  # the step launched and not yet read
        self.generated = 0  # new tokens so far (prefill tokens included)
        self.seconds = {"prefill_s": 0.0, "launch_s": 0.0, "wait_s": 0.0, "book_s": 0.0}

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens not prefilled: their keys were kept in the slot from the turn before."""
        return self.continued.reused if self.continued is not None else 0

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
        rid = self.next_rid
        self.next_rid += 1
        if rid >= len(self.where):
            self.where = np.concatenate([self.where, np.full(len(self.where), -1, dtype=np.int64)])
        self.keys[rid] = key
        request = (rid, prompt, int(max_new_tokens), int(seed))
        if self.continued is not None and self.continued.holds(key):
            self.pending.appendleft(request)  # first in: before another request takes the row it goes on in
        else:
            self.pending.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.num_live)

    def _fill(self) -> list[Finished]:
        """Admit the waiting requests, oldest first, into the free slots: sorted by prompt length
        and prefilled in as few forwards as fit `prefill_tokens` padded tokens each (a group
        pads its prompts to its longest, the last one), their first tokens read once for all the
        groups. An eager prefill forward of a small target costs its host time (its launches),
        not its padded tokens: groups split to pad less made the refills slower, by more
        forwards for less padding (docs/PERFORMANCE.md)."""
        live = self.num_live
        free = self.max_rows - live
        if not self.pending or free <= 0 or (live and free < min(self.refill, len(self.pending))):
            return []
        began = time.perf_counter()
        window = sorted((self.pending.popleft() for _ in range(min(free, len(self.pending)))),
                        key=lambda t: t[1].numel())
        going_on, fresh = (self.continued.take(window, self.keys, self.rid_S) if self.continued is not None
                           else ([], window))
        taken = {slot for _, slot, _ in going_on}
        holes = [h for h in np.flatnonzero(self.rid_S[:self.used] < 0).tolist() + list(range(self.used, self.max_rows))
                 if h not in taken]
        window = fresh + [t for t, _, _ in going_on]
        chosen = np.array(holes[: len(fresh)] + [slot for _, slot, _ in going_on], dtype=np.int64)
        if self.continued is not None:
            self.continued.forget(chosen[: len(fresh)])  # their kept keys are overwritten now
        used = max(self.used, int(chosen.max()) + 1)
        if used > self.used:  # grow the per-slot tensors (new slots start as holes)
            grow = used - self.used
            self.token_R = torch.cat([self.token_R, self.token_R.new_zeros(grow)])
            self.pos_R = torch.cat([self.pos_R, self.pos_R.new_full((grow,), -1)])
            self.seed_R = torch.cat([self.seed_R, self.seed_R.new_zeros(grow)])
            self.used = used
        lengths = np.array([t[1].numel() for t in window], dtype=np.int64)
        starts = [0] * len(fresh) + [start for _, _, start in going_on]
        # Queued behind a step in flight, if any: that step's writes to these slots (rows it
        # decoded once past their end) land first, and the prompts overwrite them.
        firsts = []
        sizes = [len(t[1]) - a for t, a in zip(window, starts)]
        for part in refill_forwards(sizes, len(fresh), self.prefill_tokens):
            group = window[part]
            slots, seeds = self._to_device(chosen[part]), self._to_device([t[3] for t in group])
            if part.start < len(fresh):
                first, _ = self.steps.prefill(slots, [t[1] for t in group], seeds, features=False)
            else:
                first = self.steps.extend(slots, [t[1][a:] for t, a in zip(group, starts[part])], starts[part], seeds)
            self.token_R[slots] = first
            self.pos_R[slots] = self._to_device(lengths[part])
            self.seed_R[slots] = seeds
            firsts.append(first)
        if self.continued is not None:
            self.continued.started(window)
        rids = np.array([t[0] for t in window], dtype=np.int64)
        self.rid_S[chosen] = rids
        self.where[rids] = chosen
        self.pos_S[chosen] = lengths
        self.budget_S[chosen] = [t[2] for t in window]
        self.out_SC[chosen, 0] = torch.cat(firsts).cpu().numpy()  # host sync: the first tokens
        self.n_S[chosen] = 1
        self.num_live += len(window)
        self.generated += len(window)
        self.seconds["prefill_s"] += time.perf_counter() - began
        return self._retire(chosen)

    def _retire(self, slots: np.ndarray) -> list[Finished]:
        """Rows of `slots` whose last token is a stop token or whose budget is spent leave."""
        n = self.n_S[slots]
        stopped = np.isin(self.out_SC[slots, n - 1], self.stop)
        ended = stopped | (n >= self.budget_S[slots])
        done = []
        if ended.any():
            leaving = slots[ended]
            for slot, stop in zip(leaving.tolist(), stopped[ended].tolist()):
                rid = int(self.rid_S[slot])
                key, output = self.keys.pop(rid), self.out_SC[slot, : self.n_S[slot]]
                done.append(Finished(key, output.tolist(), stop))
                if self.continued is not None:  # the keys of the prompt and of every output token but the last
                    self.continued.keep(key, slot, rid, output[:-1])
            self.where[self.rid_S[leaving]] = -1  # a step in flight may still decode them: its tokens are dropped
            self.rid_S[leaving] = -1
            self.num_live -= len(leaving)
            # index_fill_, not `pos_R[index] = -1`: setting a CUDA tensor's items to a Python
            # number copies it from the host first, a blocking copy that waits for the step in flight.
            self.pos_R.index_fill_(0, self._to_device(leaving), -1)
            live = np.flatnonzero(self.rid_S[: self.used] >= 0)
            self.used = int(live[-1]) + 1 if len(live) else 0
            self.token_R, self.pos_R, self.seed_R = (t[: self.used] for t in (self.token_R, self.pos_R, self.seed_R))
            if not self.pending and self.used and pick(self.num_live, self.steps.rows) < pick(self.used, self.steps.rows):
                self._compact()
        return done

    def _compact(self) -> None:
        live = np.flatnonzero(self.rid_S[: self.used] >= 0)
        k = len(live)
        moved = live != np.arange(k)
        if moved.any():  # queued behind a step in flight: its writes move with the rows
            src, dst = self._to_device(live[moved]), self._to_device(np.flatnonzero(moved))
            self.steps.cache.move_rows(src, dst)
            if self.continued is not None:
                self.continued.forget(np.flatnonzero(moved))
        for a in (self.rid_S, self.pos_S, self.budget_S, self.n_S, self.out_SC):
            a[:k] = a[live]
        self.rid_S[k: self.used] = -1
        self.where[self.rid_S[:k]] = np.arange(k)
        index = self._to_device(live)
        self.token_R, self.pos_R, self.seed_R = (t.index_select(0, index) for t in (self.token_R, self.pos_R, self.seed_R))
        self.used = k

    def _to_device(self, values) -> torch.Tensor:
        return to_device(values, self.device)

    def _launch(self) -> _Launched:
        """Queue one decode step of every live row; the rows' next tokens and positions become
        the step's outputs on the device, so the next step can be queued before these are read."""
        began = time.perf_counter()
        live = np.flatnonzero(self.rid_S[: self.used] >= 0)
        max_pos = int(self.pos_S[live].max())
        next_R = self.steps.decode(self.token_R, self.pos_R, self.seed_R, max_pos)
        # Copied out before anything else is queued: a graph's output is rewritten by its next replay.
        tokens = next_R.to("cpu", non_blocking=True, copy=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self.token_R = next_R.clone()
        self.pos_R = torch.where(self.pos_R >= 0, self.pos_R + 1, self.pos_R)
        self.pos_S[live] += 1
        self.seconds["launch_s"] += time.perf_counter() - began
        return _Launched(live, self.rid_S[live], tokens, ready)

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
        booking = time.perf_counter()
        self.seconds["wait_s"] += booking - began
        now = self.where[launched.rids]  # where each launched row is now (rows may have moved), -1: gone
        kept = now >= 0
        slots = now[kept]
        self.out_SC[slots, self.n_S[slots]] = tokens[launched.slots[kept]]
        self.n_S[slots] += 1
        self.generated += len(slots)
        done += self._retire(slots)
        self.seconds["book_s"] += time.perf_counter() - booking
        return done

    def run(self) -> Iterable[Finished]:
        """Step until every added request finished, yielding them as they finish."""
        while self.busy:
            yield from self.step()


def refill_forwards(sizes: list[int], split: int, cap: int) -> list[slice]:
    """A refill's rows in consecutive runs, one forward each: the first `split` are prefills, the
    rest continuations (each part in ascending order of the tokens it writes); a run closes
    before its padded tokens (its rows times its last, longest size) would pass `cap`."""
    parts, begin = [], 0
    for i, n in enumerate(sizes):
        if i > begin and (i == split or (i - begin + 1) * n > cap):
            parts.append(slice(begin, i))
            begin = i
    return parts + ([slice(begin, len(sizes))] if sizes else [])


def common_prefix(prompt: torch.Tensor, kept: torch.Tensor) -> int:
    """How many first ids of `prompt` equal `kept`'s, at most all but its last (a prefill must
    leave at least one token to choose the next from). A row's key at position p depends on its
    ids up to p alone, so that many kept keys are the prompt's own even where the two differ later
    (an answer cut mid-word is tokenized again otherwise in the next prompt's text)."""
    n = min(kept.numel(), prompt.numel() - 1)
    if n <= 0:
        return 0
    same = prompt[:n].cpu() == kept[:n]
    return n if bool(same.all()) else int(same.to(torch.int8).argmin())


class Continuations:
    """The keys a finished request left in its slot, until another request takes the slot: by
    request key, (slot, the ids whose keys the slot holds: its prompt and every output token but
    the last, which no step has fed yet). A cache row's key at position p is a function of its ids
    up to p alone, so a new request whose prompt shares a first part with those ids can go on from
    there in that slot: only the rest of its prompt is prefilled (TargetSteps.extend), from the
    position where the shared part ends. A multi-turn conversation's next prompt is its last one,
    the answer and the next user turn. Keys must be hashable."""

    def __init__(self) -> None:
        self.by_key: dict[object, tuple[int, torch.Tensor]] = {}
        self.key_of: dict[int, object] = {}  # slot -> the key kept there
        self.prompts: dict[int, torch.Tensor] = {}  # request id -> its prompt, while it runs
        self.reused = 0  # prompt tokens whose keys were kept instead of prefilled again

    def started(self, requests: list) -> None:
        """Requests (rid, prompt, budget, seed) given rows."""
        for t in requests:
            self.prompts[t[0]] = t[1]

    def keep(self, key, slot: int, rid: int, output: np.ndarray) -> None:
        """Request `rid` (under `key`) finished in `slot`, whose keys are its prompt's and `output`'s."""
        self.forget([slot])
        old = self.by_key.pop(key, None)
        if old is not None:
            self.key_of.pop(old[0], None)
        prompt = self.prompts.pop(rid)
        self.by_key[key] = (slot, torch.cat([prompt.cpu(), torch.from_numpy(output.copy())]))
        self.key_of[slot] = key

    def holds(self, key) -> bool:
        return key in self.by_key

    def forget(self, slots) -> None:
        """The slots' kept keys are (about to be) overwritten."""
        for slot in np.asarray(slots).tolist():
            key = self.key_of.pop(slot, None)
            if key is not None:
                del self.by_key[key]

    def take(self, window: list, keys: dict, rid_S: np.ndarray) -> tuple[list, list]:
        """Split refill requests (rid, prompt, budget, seed) into those that go on in their key's
        kept slot, as (request, slot, kept length), and the rest; the kept entries they use are
        dropped."""
        going_on, fresh = [], []
        for t in window:
            kept = self.by_key.get(keys[t[0]])
            if kept is not None:
                slot, ids = kept
                self.forget([slot])
                n = common_prefix(t[1], ids) if rid_S[slot] < 0 else 0
                if n:
                    going_on.append((t, slot, n))
                    self.reused += n
                    continue
            fresh.append(t)
        going_on.sort(key=lambda g: g[0][1].numel() - g[2])  # by the length still to prefill, as refills go
        return going_on, fresh
