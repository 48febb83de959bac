"""The walked tau: how a drafter would serve a sequence, read off one teacher-forced forward.

Owns the measurement and its two users: the validation of a training run (every `eval.every`
steps on the conversations `data.validation` holds out: walked tau and validation loss) and
`dflash-train eval --walk DATA` (any drafter on any chat data, no generation, written in the
eval JSON layout). docs/EVALUATION.md, "Walked tau", says when it equals served tau.

For every sample (a conversation rendered by the target's chat template, its responses
supervised):
1. `anchor_runs`: the drafter runs in the training layout under the training mask rule
   (masks.build_layout, masks.build_attention_masks), without feature noise, with an anchor at
   every position training may anchor at (masks.sample_anchors with no cap: every response
   position whose next position is in the same response); run(a) at anchor a is
   loss.accepted_run_length of the drafter's argmax against the data tokens at block positions
   1..B-1 (a position outside the response ends the run). Blocks never see each other, so the
   anchors are spread over as many forwards as memory needs; each is the same computation.
2. `walk_turn`: each response (a turn: a maximal span r..e of supervised positions) is walked
   as serving decodes it: the first cycle anchors at r (the token the prefill gave); a cycle at
   anchor a commits n = min(run(a) + 1, e - a) tokens, the accepted proposals and the target's
   own token, cut at the end of the response as serving cuts at the stop token or the budget;
   the next cycle anchors at a + n; the turn ends when a reaches e.
When a response is the target's own greedy output for its context, the lengths n of its turn
are the acceptance lengths served decoding reports for that turn (tests/test_walk.py: equal in
float32, cycle for cycle).

tau of a set is the mean over turns of each turn's mean acceptance length (acceptance.turn_mean_tau,
the served evaluation's per-set tau; a one-token turn has no cycle and is left out); a record's
tau is the same mean over its own turns.

Shape legend: T packed tokens, N anchors, G anchors (blocks) of one drafter forward, B block
size, K = B - 1, M block rows, V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.core.config import DEFAULT_GAMMA, DataSection, ObjectiveSection
from dflash_train.core.errors import InputError
from dflash_train.core.export import load_drafter
from dflash_train.core.loss import accepted_run_length, hard_chunk_loss, position_weights
from dflash_train.core.masks import (
    ANCHOR_STREAM,
    build_attention_masks,
    build_layout,
    document_starts,
    padded_anchor_count,
    sample_anchors,
    step_generator,
)
from dflash_train.core.target import load_target, resolve_target_path
from dflash_train.data import preparation
from dflash_train.data.batching import BatchPlan, BatchStream, quantile_boundaries
from dflash_train.data.preparation import response_spans
from dflash_train.engine.acceptance import acceptance_histogram, mean_acceptance, turn_mean_tau
from dflash_train.eval.evaluate import checked_inputs
from dflash_train.eval.prompts import set_label
from dflash_train.eval.results import SetResult, combine, loop_fields
from dflash_train.train import compilation
from dflash_train.train.produce import FeatureNoise, pack

# Block rows of one drafter forward. Flex attention visits only the visible tiles, so the bound
# is activation memory (about one training step's blocks). The dense path materialises a
# [rows, T + rows] mask and sdpa's scores over it, kept near 4M entries (~100 MB of scores).
FLEX_QUERY_ROWS = 65536
DENSE_MASK_ENTRIES = 1 << 22


# --------------------------------------------------------------------------- the walk


def walk_turn(run_L: np.ndarray, first: int, last: int) -> list[int]:
    """The acceptance lengths of serving the turn at positions first..last, from the accepted
    run at each of its anchors (run_L, -1 where there is no anchor)."""
    lengths, a = [], first
    while a < last:
        assert run_L[a] >= 0, "every position of a turn but its last is an anchor"
        n = min(int(run_L[a]) + 1, last - a)
        lengths.append(n)
        a += n
    return lengths


# --------------------------------------------------------------------------- one packed row


@dataclass(frozen=True)
class ForwardSettings:
    """How the walk runs the drafter, as the training step runs it: `attention` (sdpa or flex),
    under `autocast` (a context manager, or None), anchor counts padded to a multiple of
    `anchor_multiple`; and how its loss sums are made: `gamma` (loss.position_weights; None: the
    block size's published one), the lm_head applied `chunk_rows` block rows at a time."""

    attention: str
    autocast: Any = None
    gamma: float | None = None
    chunk_rows: int = ObjectiveSection.lm_head_chunk_rows
    anchor_multiple: int = 1


@dataclass
class AnchorRuns:
    """What one packed row's forwards give: the run at every anchor and the loss sums."""

    run_T: np.ndarray  # accepted run at each anchor position, -1 elsewhere
    loss_sum: float  # sum of w_k * CE over every anchor's valid block positions (data labels)
    weight_sum: float
    correct_K: np.ndarray  # per block position 1..B-1: argmax equal to the data token
    count_K: np.ndarray  # per block position 1..B-1: valid positions


def blocks_per_forward(num_ctx: int, block_size: int, attention: str, multiple: int) -> int:
    """Anchors per drafter forward (a multiple of `multiple`, as training pads anchor counts)."""
    if attention == "flex":
        rows = FLEX_QUERY_ROWS
    else:  # rows * (num_ctx + rows) <= DENSE_MASK_ENTRIES
        rows = int((math.sqrt(num_ctx * num_ctx + 4 * DENSE_MASK_ENTRIES) - num_ctx) / 2)
    multiple = max(1, multiple)
    return max(multiple, rows // block_size // multiple * multiple)


def _padded(anchors_G: torch.Tensor, size: int, multiple: int) -> torch.Tensor:
    """A group of anchors padded with -1 (blocks that see only themselves and count nothing) to
    `size`, or for a last, shorter group to `multiple` times a power of two: a bounded set of
    shapes for the walk's flex attention, compiled one kernel per shape (as training does with
    train.anchor_buckets_per_doubling=1)."""
    n = anchors_G.numel()
    if n < size:
        size = min(size, padded_anchor_count(n, multiple, buckets_per_doubling=1))
    return torch.cat([anchors_G, anchors_G.new_full((size - n,), -1)])


def _predict(hidden_MH, weight_VH, labels_M, valid_M, chunk_rows: int):
    """argmax (-1 on invalid rows) and cross-entropy (0 on invalid rows) of the valid block
    rows, the lm_head applied chunk by chunk so that [rows, V] logits never exist at once."""
    rows = valid_M.nonzero().flatten()  # host sync: evaluation only
    preds_M = torch.full_like(labels_M, -1)
    ce_M = torch.zeros(labels_M.shape, dtype=torch.float32, device=labels_M.device)
    for s in range(0, rows.numel(), chunk_rows):
        r = rows[s : s + chunk_rows]
        ce_M[r], preds_M[r], _, _ = hard_chunk_loss(hidden_MH[r], weight_VH, labels_M[r], need_grad=False)
    return preds_M, ce_M


@torch.no_grad()
def anchor_runs(drafter, heads, shipment, forward: ForwardSettings) -> AnchorRuns:
    """The accepted run at every anchor of one packed row (a produce.Shipment made without
    noise), with the decayed cross-entropy of every anchor's block (`forward.gamma`:
    loss.position_weights) against the data tokens (loss sums 0 for a block size without a
    published gamma when none is given). `heads`: the target's embed and lm_head_weight."""
    d, s = drafter, shipment
    attention, gamma, anchor_multiple = forward.attention, forward.gamma, forward.anchor_multiple
    B, T, device = d.block_size, s.loss_mask_T.numel(), s.loss_mask_T.device
    # No cap on anchors per document: every position the training rule allows is chosen, so
    # the generator's draw decides nothing (it only has to be one that touches no global state).
    anchors_N = sample_anchors(s.loss_mask_T, s.doc_lengths, max(1, T),
                               step_generator(0, 0, ANCHOR_STREAM, device=device), align=s.doc_align)
    anchors_N = anchors_N[anchors_N >= 0]
    G = blocks_per_forward(T, B, attention, anchor_multiple)
    known = gamma is not None or B in DEFAULT_GAMMA
    w_B = position_weights(B, gamma, device) if known else torch.zeros(B, device=device)
    lm_head = heads.lm_head_weight
    run_T = torch.full((T,), -1, dtype=torch.long, device=device)
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    counts = torch.zeros(2, B - 1, dtype=torch.float64, device=device)
    for start in range(0, anchors_N.numel(), G):
        group = _padded(anchors_N[start : start + G], G, max(1, anchor_multiple))
        layout = build_layout(group, s.loss_mask_T, s.doc_lengths, B, s.doc_align)
        masks = build_attention_masks(layout, d.layer_types, d.config.sliding_window, attention)
        block_emb = heads.embed(layout.block_input_ids(s.input_ids_T, d.mask_token_id))
        with forward.autocast or contextlib.nullcontext():
            hidden = d(s.features[None], block_emb[None], layout.position_ids(), attention_mask=masks)[0]
        valid_NB = layout.valid_NB
        labels_NB = layout.labels(s.labels_T).view(-1, B)
        preds, ce = _predict(hidden.to(lm_head.dtype), lm_head, labels_NB.flatten(), valid_NB.flatten(),
                              forward.chunk_rows)
        correct_NB = (preds.view(-1, B) == labels_NB) & valid_NB
        real = group >= 0
        run_T[group[real]] = accepted_run_length(correct_NB[:, 1:])[real]
        w_NB = w_B[None, :] * valid_NB
        sums += torch.stack([(w_NB * ce.view(-1, B)).sum(), w_NB.sum()]).double()
        counts += torch.stack([correct_NB[:, 1:].sum(0), valid_NB[:, 1:].sum(0)]).double()
    (loss_sum, weight_sum), (correct, count) = sums.tolist(), counts.cpu().numpy()  # host sync
    return AnchorRuns(run_T.cpu().numpy(), loss_sum, weight_sum, correct, count)


# --------------------------------------------------------------------------- a set of samples


@dataclass
class WalkResult:
    """The walk of a set of samples: per sample, the acceptance lengths of each of its turns and
    the turns' replies (their supervised token ids)."""

    block_size: int
    files: list[str] | None = None  # each sample's data file (file_labels), where the samples name theirs
    turns: dict[int, list[list[int]]] = field(default_factory=dict)
    replies: dict[int, list[list[int]]] = field(default_factory=dict)
    loss_sum: float = 0.0
    weight_sum: float = 0.0
    correct_K: np.ndarray | None = None
    count_K: np.ndarray | None = None
    seconds: float = 0.0

    def add(self, indices: list[int], shipment, runs: AnchorRuns) -> None:
        """The samples of one packed row (documents in batch order, `indices` their rows, placed
        as `masks.document_starts` says)."""
        mask_T = shipment.loss_mask_T.cpu().numpy()
        ids_T = shipment.input_ids_T.cpu().tolist()
        doc_lengths = shipment.doc_lengths.cpu()
        starts = document_starts(doc_lengths, shipment.doc_align).tolist()
        for index, start, length in zip(indices, starts, doc_lengths.tolist()):
            spans = response_spans(mask_T[start : start + length])
            self.turns[index] = [walk_turn(runs.run_T, start + a, start + b) for a, b in spans]
            self.replies[index] = [ids_T[start + a : start + b + 1] for a, b in spans]
        self.loss_sum += runs.loss_sum
        self.weight_sum += runs.weight_sum
        self.correct_K = runs.correct_K if self.correct_K is None else self.correct_K + runs.correct_K
        self.count_K = runs.count_K if self.count_K is None else self.count_K + runs.count_K

    def all_turns(self) -> list[list[int]]:
        return [t for i in sorted(self.turns) for t in self.turns[i]]

    def all_replies(self) -> list[list[int]]:
        return [r for i in sorted(self.replies) for r in self.replies[i]]

    def lengths(self) -> list[int]:
        return [n for t in self.all_turns() for n in t]

    @property
    def tau(self) -> float:
        """Mean over turns of each turn's mean acceptance length (acceptance.turn_mean_tau)."""
        return turn_mean_tau(self.all_turns())

    @property
    def loss(self) -> float:
        return self.loss_sum / self.weight_sum if self.weight_sum > 0 else float("nan")

    def acc_per_position(self) -> list[float | None]:
        return [c / n if n else None for c, n in zip(self.correct_K.tolist(), self.count_K.tolist())]

    def by_file(self) -> dict[str, dict]:
        """Per data file, in the order the files first come: its walked tau (the same turn mean
        as `tau`, over that file's turns) and how many samples and walked turns it holds; empty
        when the samples name no file or all come from one."""
        if self.files is None or len(set(self.files)) < 2:
            return {}
        turns: dict[str, list[list[int]]] = {}
        samples: dict[str, int] = {}
        for i in sorted(self.turns):
            name = self.files[i]
            turns.setdefault(name, []).extend(self.turns[i])
            samples[name] = samples.get(name, 0) + 1
        return {name: {"tau": turn_mean_tau(t), "samples": samples[name], "turns": sum(1 for x in t if x)}
                for name, t in turns.items()}

    def record(self) -> dict:
        """The fields a training log step adds (metrics.jsonl), walked tau first."""
        lengths = self.lengths()
        loops = loop_fields(self.all_turns(), self.all_replies())
        by_file = self.by_file()
        return {
            "walked_tau": self.tau,
            "walked_tau_cycles": mean_acceptance(lengths),
            "walked_histogram": acceptance_histogram(lengths, self.block_size),
            "walked_turns": sum(1 for t in self.all_turns() if t),
            **{f"walked_{k}": v for k, v in loops.items()},
            **({"walked_by_file": by_file} if by_file else {}),
            "val_loss": self.loss,
            "val_acc_per_position": self.acc_per_position(),
            "walk_s": round(self.seconds, 3),
        }


class Walker:
    """The walk of drafters over one set of prepared samples (columns input_ids, loss_mask,
    length), batched by length buckets as `data` says (its token_budget, max_batch_size and
    num_buckets; default: DataSection's) and packed as training packs them. `target` captures
    the tapped features (`capture(ids) -> (features, greedy)`: target.Target); `heads` has the
    target's embed and lm_head_weight; `forward`: how the drafter runs. `pad_to`: packed rows
    padded to this many tokens (the token budget on a GPU: one shape for compiled code; 0 on
    CPU, where the dense mask would pay for the padding)."""

    def __init__(self, dataset, target, heads, *, device: torch.device, forward: ForwardSettings,
                 data: DataSection | None = None, pad_id: int = 0, pad_to: int = 0) -> None:
        data = data if data is not None else DataSection()
        lengths = list(dataset["length"])
        boundaries = quantile_boundaries(lengths, data.num_buckets)
        budget = max(data.token_budget, boundaries[-1])  # a sample longer than the budget gets a batch of its own
        self.plan = BatchPlan(lengths, token_budget=budget, max_batch_size=data.max_batch_size, boundaries=boundaries)
        self.stream = BatchStream(dataset, self.plan, pad_id=pad_id)
        self.target, self.heads, self.device = target, heads, device
        self.forward = forward
        self.pad_to = pad_to
        self.no_noise = FeatureNoise("none", 0.0, 0, device)
        self.files = file_labels(dataset["source"]) if "source" in dataset.column_names else None

    def __call__(self, drafter) -> WalkResult:
        started = time.perf_counter()
        drafter = getattr(drafter, "module", drafter)  # DDP
        result = WalkResult(int(drafter.block_size), files=self.files)
        was_training = drafter.training
        drafter.eval()
        try:
            for g in range(self.plan.num_batches):  # the batches of epoch 0: every sample once
                batch = self.stream[g]
                features, _ = self.target.capture(batch.input_ids.to(self.device))
                # Labels: the data tokens (no greedy labels given); features: as captured.
                shipment = pack(batch, g, features, None, self.pad_to, self.no_noise)
                result.add(batch.indices, shipment, anchor_runs(drafter, self.heads, shipment, self.forward))
        finally:
            drafter.train(was_training)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result.seconds = time.perf_counter() - started
        return result


def file_labels(sources: list[str]) -> list[str]:
    """Each sample's data file, from prepare's `source` column ("file:line"): the file's name, or
    its whole path where two files of the data share a name."""
    paths = [preparation.source_location(source)[0] for source in sources]
    names: dict[str, set[str]] = {}
    for path in dict.fromkeys(paths):
        names.setdefault(Path(path).name, set()).add(path)
    return [Path(path).name if len(names[Path(path).name]) == 1 else path for path in paths]


# --------------------------------------------------------------------------- eval --walk


def walk_dataset(path: str, target_dir: Path, work: Path, log=print):
    """The prepared samples of one `--walk` argument: a prepared folder as it is, or chat files
    prepared with the target's tokenizer into a folder under `work` (temporary). Raises
    InputError when it holds nothing to walk."""
    if preparation.is_prepared_folder(Path(path)):
        dataset = preparation.load_prepared(path)
        if len(dataset) == 0:
            raise InputError(f"--walk {path}: the prepared folder holds no samples: no assistant turns to walk")
        return dataset
    prepared = preparation.prepare([path], target_dir, work / f"set-{len(list(work.iterdir()))}", log=log)
    if len(prepared.dataset) == 0:
        report = prepared.report
        reasons = ", ".join(f"{k}: {v}" for k, v in report["skipped_by_reason"].items()) or "none"
        raise InputError(f"--walk {path}: no assistant turns to walk: {report['num_records']} record(s) read, "
                         f"none gave a sample (skipped by reason: {reasons}); the walk needs conversations "
                         f"with assistant turns (ShareGPT or OpenAI messages)")
    return prepared.dataset


def evaluate_walk(target: str, drafter: str, paths: list[str], *, limit: int | None = None,
                  device: str = "auto", dtype: str = "auto", log=print) -> dict:
    """Walked tau of a published-format drafter folder on each data set of `paths` (chat files
    or prepared folders, one set each; the first `limit` samples of each), in the JSON layout
    of `results.combine`: tau, per_set (with the validation-style loss and per-position
    accuracy added), histogram, settings and, per record, its turns' acceptance lengths."""
    problems = [f"--limit must be >= 1 (leave it out for every sample), got {limit}"] if limit is not None and limit < 1 else []
    dev, torch_dtype = checked_inputs(target, drafter, device, dtype, problems)  # before any data is prepared
    target_dir = resolve_target_path(target)
    started = time.perf_counter()
    sets, results = [], []
    with tempfile.TemporaryDirectory(prefix="dflash-walk-") as work:
        datasets = [(set_label(p), walk_dataset(p, target_dir, Path(work), log)) for p in paths]  # before loading
        draft = load_drafter(drafter, "--drafter", dtype=torch_dtype, device=dev).eval()
        tgt, tokenizer = load_target(target, dev, torch_dtype, draft.target_layer_ids, "data")
        attention = "flex" if dev.type == "cuda" else "sdpa"
        if attention == "flex":
            compilation.compile_flex_attention()
        for name, dataset in datasets:
            if limit is not None and limit < len(dataset):
                dataset = dataset.select(range(limit))
            pad_to = DataSection.token_budget if dev.type == "cuda" else 0
            walker = Walker(dataset, tgt, tgt, device=dev, forward=ForwardSettings(attention),
                            pad_id=tokenizer.pad_token_id or 0, pad_to=pad_to)
            result = walker(draft)
            sources = dataset["source"] if "source" in dataset.column_names else None
            walked = SetResult(name, result.block_size)
            for i in range(len(dataset)):
                turns = result.turns[i]
                walked.add_record({"id": sources[i] if sources else str(i), "set": name,
                                   "tau": turn_mean_tau(turns), "acceptance_lengths": turns,
                                   "output_ids": result.replies[i]}, [])
            walked.new_tokens = sum(sum(t) + 1 for t in result.all_turns())  # the response tokens walked
            sets.append(walked)
            results.append(result)
            log(f"[{name}] {len(dataset)} samples walked in {result.seconds:.1f} s: tau {result.tau:.3f}")
    settings = {"target": target, "drafter": str(drafter), "walk": list(paths), "limit": limit,
                "temperature": 0.0, "max_new_tokens": None, "device": str(dev),
                "dtype": str(torch_dtype).removeprefix("torch."), "speedup_turns": 0}
    doc = combine(sets, settings)
    for s, result in zip(sets, results):
        loss = result.loss if math.isfinite(result.loss) else None  # None: no published gamma for the block size
        doc["per_set"][s.name].update(loss=loss, acc_per_position=result.acc_per_position())
    doc["wall_s"] = {"walk": time.perf_counter() - started}
    return doc
