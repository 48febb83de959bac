"""Length-bucketed batches of prepared samples for the target, and the validation split.

Owns which samples are held out for validation (`validation_split`: a seeded hash of each
sample's conversation, the `conversation` column preparation.prepare writes), and how an epoch
of the training samples (their `length` column) becomes padded batches: bucket boundaries
(given, or from length quantiles), a token budget and a row cap per batch, the deterministic
shuffle from (seed, epoch), and `BatchStream`, the endless stream of batches a run consumes by
global index, so that resuming mid-epoch means continuing from an integer. Which rank makes and
which trains batch g is the trainer's (train/dist.py's Assignment).

Every batch is padded to its bucket's boundary, so the target sees at most two shapes per
bucket (`BatchPlan.shapes`: its full batches' and its last one's) and can warm each up (and
capture it as a CUDA graph) before training: a shape first seen late in a run would compile
(and could run out of memory) there.

Shape suffixes: B rows of a batch, L padded length (the bucket boundary).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from dflash_train.core.config import DataSection

PAD_MULTIPLE = 64  # derived boundaries are rounded up to this (kernel-friendly shapes)


def quantile_boundaries(lengths: Sequence[int], num_buckets: int = DataSection.num_buckets,
                        multiple: int = PAD_MULTIPLE) -> list[int]:
    """Bucket upper bounds at the length quantiles 1/n .. n/n, rounded up to `multiple` and
    deduplicated; the last one covers the longest sample."""
    if len(lengths) == 0:
        raise ValueError("no samples: cannot derive bucket boundaries from an empty dataset")
    if num_buckets < 1 or multiple < 1:
        raise ValueError(f"num_buckets={num_buckets}, multiple={multiple}: both must be >= 1")
    quantiles = np.quantile(np.asarray(lengths), np.arange(1, num_buckets + 1) / num_buckets)
    rounded = {int(-(-int(np.ceil(q)) // multiple) * multiple) for q in quantiles}
    return sorted(rounded)


@dataclass
class Batch:
    """One padded batch. `indices` are dataset rows; the stats describe its padding."""

    input_ids: Any  # LongTensor [B, L], padded with the pad id
    loss_mask: Any  # BoolTensor [B, L], False on padding
    lengths: Any  # LongTensor [B], real tokens per row
    indices: list[int]
    index: int  # position of the batch in its epoch
    epoch: int

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seq_len(self) -> int:
        return int(self.lengths.max())

    @property
    def avg_seq_len(self) -> float:
        return float(self.lengths.sum()) / len(self.lengths)

    @property
    def padding_efficiency(self) -> float:
        """Real tokens / padded tokens."""
        return float(self.lengths.sum()) / self.input_ids.numel()

    def stats(self) -> dict[str, float]:
        return {"avg_seq_len": self.avg_seq_len, "max_seq_len": self.max_seq_len,
                "batch_size": self.batch_size, "padding_efficiency": self.padding_efficiency}


class BatchPlan:
    """Which samples form which batch, per epoch. Each bucket holds the samples whose length
    is at most its boundary (and above the previous one); a batch of bucket L has at most
    min(max_batch_size, token_budget // L) rows, so rows * L <= token_budget. The last batch of
    a bucket may have fewer rows. Batch order is a pure function of (seed, epoch)."""

    def __init__(self, lengths: Sequence[int], token_budget: int = DataSection.token_budget,
                 max_batch_size: int = DataSection.max_batch_size, boundaries: Sequence[int] | None = None,
                 num_buckets: int = DataSection.num_buckets, pad_multiple: int = PAD_MULTIPLE,
                 seed: int = 0):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.size == 0:
            raise ValueError("no samples: the prepared dataset is empty (see its report.json)")
        if boundaries is None:
            boundaries = quantile_boundaries(self.lengths, num_buckets, pad_multiple)
        boundaries = [int(b) for b in boundaries]
        problems = []
        if any(b < 1 for b in boundaries) or boundaries != sorted(set(boundaries)):
            problems.append(f"boundaries {boundaries} must be positive and strictly increasing")
        elif self.lengths.max() > boundaries[-1]:
            problems.append(f"a sample has {self.lengths.max()} tokens, more than the last boundary "
                            f"{boundaries[-1]}: add a boundary >= {self.lengths.max()}")
        if self.lengths.min() < 1:
            problems.append("a sample has length 0")
        if max_batch_size < 1:
            problems.append(f"max_batch_size={max_batch_size} must be >= 1")
        if boundaries and token_budget < max(boundaries):
            problems.append(f"token_budget={token_budget} is below the longest bucket {max(boundaries)}: "
                            f"one row would not fit; raise token_budget to >= {max(boundaries)}")
        if problems:
            raise ValueError("invalid batch plan: " + "; ".join(problems))
        self.boundaries = boundaries
        self.token_budget = token_budget
        self.max_batch_size = max_batch_size
        self.seed = seed
        self.bucket_of = np.searchsorted(np.asarray(boundaries), self.lengths, side="left")
        self.rows = [min(max_batch_size, token_budget // b) for b in boundaries]
        counts = np.bincount(self.bucket_of, minlength=len(boundaries))
        self.num_batches = int(sum(-(-int(c) // r) for c, r in zip(counts, self.rows)))
        self._cached: tuple[int, list[np.ndarray]] | None = None

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(rows, L) of every batch this plan makes, the shapes to warm up: per non-empty bucket,
        its full batches' and, when its sample count is not a multiple of its rows, its last
        batch's (the same in every epoch)."""
        counts = np.bincount(self.bucket_of, minlength=len(self.boundaries))
        out = []
        for k, (b, count) in enumerate(zip(self.boundaries, counts.tolist())):
            rows = self.rows[k]
            out += [(rows, b)] if count >= rows else []
            out += [(count % rows, b)] if count % rows else []
        return out

    def epoch(self, epoch: int) -> list[np.ndarray]:
        """The batches of `epoch` in order, each an array of sample indices of one bucket."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        rng = np.random.default_rng([self.seed, epoch])
        batches = []
        for bucket, rows in enumerate(self.rows):
            members = rng.permutation(np.flatnonzero(self.bucket_of == bucket))
            batches.extend(members[start : start + rows] for start in range(0, len(members), rows))
        batches = [batches[i] for i in rng.permutation(len(batches))]
        self._cached = (epoch, batches)
        return batches

    def length_of(self, indices: np.ndarray) -> int:
        """The padded length L of a batch: its bucket's boundary."""
        return self.boundaries[int(self.bucket_of[indices[0]])]

    def padding_efficiency(self) -> float:
        """Real tokens / padded tokens over a whole epoch (the same for every epoch)."""
        padded = sum(len(b) * self.length_of(b) for b in self.epoch(0))
        return float(self.lengths.sum()) / padded


def collate(dataset, indices: np.ndarray, length: int, pad_id: int):
    """input_ids [B, L] (pad_id after each row), loss_mask [B, L] bool, lengths [B]."""
    rows = dataset[[int(i) for i in indices]]
    input_ids_BL = torch.full((len(indices), length), pad_id, dtype=torch.long)
    loss_mask_BL = torch.zeros((len(indices), length), dtype=torch.bool)
    for row, (ids, mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"])):
        input_ids_BL[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        loss_mask_BL[row, : len(mask)] = torch.as_tensor(mask, dtype=torch.bool)
    lengths_B = torch.as_tensor(rows["length"], dtype=torch.long)
    return input_ids_BL, loss_mask_BL, lengths_B


class BatchStream:
    """The endless stream of batches that a run consumes: batch g is batch g % n of epoch
    g // n (n = plan.num_batches). Which rank makes and which trains batch g is decided
    elsewhere (dist.Assignment); the data cursor of a run is the next global index, so resuming
    means continuing from an integer."""

    def __init__(self, dataset, plan: BatchPlan, pad_id: int = 0):
        if len(dataset) != len(plan.lengths):
            raise ValueError(f"the plan covers {len(plan.lengths)} samples but the dataset has {len(dataset)}; "
                             "build the plan from this dataset's `length` column")
        self.dataset, self.plan, self.pad_id = dataset, plan, pad_id
        # Which conversations, in which order: a different validation split (or other data of the
        # same lengths) is another plan even when every length and count agrees.
        self.samples_digest = (hashlib.sha256("\n".join(dataset["conversation"]).encode()).hexdigest()[:16]
                               if "conversation" in dataset.column_names else None)

    def epoch_of(self, g: int) -> int:
        return g // self.plan.num_batches

    def __getitem__(self, g: int) -> Batch:
        epoch, index = divmod(g, self.plan.num_batches)
        indices = self.plan.epoch(epoch)[index]
        input_ids, loss_mask, lengths = collate(self.dataset, indices, self.plan.length_of(indices), self.pad_id)
        return Batch(input_ids, loss_mask, lengths, [int(i) for i in indices], index, epoch)

    def identity(self) -> dict[str, Any]:
        """What a saved cursor must match to mean the same batches."""
        plan = self.plan
        return {"seed": plan.seed, "num_samples": int(plan.lengths.size), "boundaries": list(plan.boundaries),
                "token_budget": plan.token_budget, "max_batch_size": plan.max_batch_size,
                "samples": self.samples_digest}

    def check_state(self, state: dict[str, Any]) -> int:
        """The next global index of a saved cursor, after checking it was saved for this plan."""
        # "samples" is checked when the cursor was saved with it (older checkpoints lack it).
        differ = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in self.identity().items()
                  if state.get(k) != v and (k != "samples" or k in state)]
        if differ:
            raise ValueError("the data cursor was saved for another batch plan, so resuming would not "
                             "continue the same epoch (" + "; ".join(differ) + "); use the saved settings "
                             "(samples: the same data, data.validation and data.validation_seed)")
        return int(state["next_index"])


# --------------------------------------------------------------------------- validation split


def conversation_keys(dataset) -> list[str]:
    """The conversation of every sample: preparation.prepare's `conversation` column (a hash of
    the conversation's opening: system turns and first user turn), or, for data without it
    (prepared by an earlier version, or rows built in code), a hash of the sample's tokens before
    its first supervised token, its first prompt."""
    if "conversation" in dataset.column_names:
        return list(dataset["conversation"])
    keys = []
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]):
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
        first = int(np.argmax(mask)) if mask.any() else len(ids)
        keys.append("tokens:" + hashlib.sha256(ids[:first].tobytes()).hexdigest()[:16])
    return keys


def one_version_each(dataset, indices: np.ndarray, keys: Sequence[str]) -> tuple[np.ndarray, int]:
    """(the samples of `indices` to walk, how many were left out): of each held-out conversation
    (`keys`, by sample), the samples of one record, its first with greedy replies (prepare's
    `sampled` column) or, where it has none (data regenerated only at T > 0), its first. Records
    sharing an opening are versions of one conversation: the greedy and the sampled replies to it,
    one cut short by a token budget, chats that open alike ("continue") and whose first T=0 reply
    is the same; walking them all would weigh one opening many times, and serving at T=0 sees the
    greedy replies. The other versions are neither walked nor trained on. Records are told apart
    by prepare's `source` column (a record's several samples, from a template that rewrites earlier
    turns, are walked together); data without it walks every sample that is not sampled beside a
    greedy one."""
    if not len(indices):
        return indices, 0
    held = dataset.select(indices)
    sampled = (np.asarray(held["sampled"], dtype=bool) if "sampled" in held.column_names
               else np.zeros(len(indices), dtype=bool))
    records = list(held["source"]) if "source" in held.column_names else [None] * len(indices)
    chosen: dict[str, tuple[bool, Any]] = {}  # key -> (sampled, record): greedy before sampled, then data order
    for i, is_sampled, record in zip(indices, sampled, records):
        key = keys[i]
        if key not in chosen or (chosen[key][0] and not is_sampled):
            chosen[key] = (bool(is_sampled), record)
    keep = np.fromiter((chosen[keys[i]][0] == is_sampled and (record is None or chosen[keys[i]][1] == record)
                        for i, is_sampled, record in zip(indices, sampled, records)), dtype=bool, count=len(indices))
    return indices[keep], int((~keep).sum())


def split_hash(seed: int, key: str) -> float:
    """Where conversation `key` falls in [0, 1) under `seed`: a pure function of the two, so the
    split depends on nothing else (not the order of the data, not the other settings)."""
    digest = hashlib.sha256(f"{int(seed)}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def validation_split(keys: Sequence[str], validation: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) sample indices, each in data order. `validation` is 0 (nothing
    held out), a fraction in (0, 1) (the conversations whose hash is below it) or a count >= 1
    (the conversations with the smallest hashes; identical openings count once). Every
    sample of a held-out conversation is held out. Raises ValueError when nothing would be
    left to train on."""
    keys = list(keys)
    everything = np.arange(len(keys))
    if not validation:
        return everything, everything[:0]
    where = {k: split_hash(seed, k) for k in dict.fromkeys(keys)}
    if validation < 1:
        held = {k for k, u in where.items() if u < validation}
    else:
        held = set(sorted(where, key=lambda k: (where[k], k))[: int(validation)])
    if len(held) == len(where):
        raise ValueError(f"data.validation={validation:g} holds out all {len(where)} conversations: nothing is "
                         f"left to train on; hold out fewer")
    is_held = np.fromiter((k in held for k in keys), dtype=bool, count=len(keys))
    return everything[~is_held], everything[is_held]
