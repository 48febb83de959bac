"""Chat records: .json / .jsonl / .parquet files (or folders of them) read record by record.

Owns the two record formats (ShareGPT `conversations` of from/value, OpenAI-style `messages` of
role/content), their validation and normalisation to system / user / assistant messages
(`Record`), and what is skipped and why: every bad record, down to a file cut short mid-array,
is reported with its file, line and reason (`Skip`) instead of stopping the run. Also the
conversation key of the validation split. preparation.py turns records into training samples;
regenerate.py writes them back with the target's answers.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import datasets

from dflash_train.core.errors import InputError

DATA_SUFFIXES = (".json", ".jsonl", ".parquet")

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


def conversation_key(messages: list[dict[str, str]]) -> str:
    """What identifies a conversation for the validation split: a hash of its prompt side (the
    system and user turns, in order), so that the raw and the regenerated versions of a chat,
    several sampled responses to one prompt, and the samples of a template that rewrites
    earlier turns all fall on the same side of the split."""
    prompt_side = [[m["role"], m["content"]] for m in messages if m["role"] != "assistant"]
    return hashlib.sha256(json.dumps(prompt_side).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def nothing_usable(files: Iterable[str | os.PathLike], num_records: int, skipped: list[Skip]) -> str:
    """Why chat files gave no usable record, in words: empty, or every record skipped (by reason)."""
    if num_records == 0:
        why = "they hold no records"
    else:
        counts = collections.Counter(s.category for s in skipped).most_common()
        why = f"all {num_records} records were skipped ({', '.join(f'{n} {reason}' for reason, n in counts)})"
    return f"no usable records in {', '.join(map(str, files))}: {why}"


def strict_error(skipped: list[Skip]) -> DataError:
    lines = [f"  {s.file}:{s.line}: {s.reason}" for s in skipped]
    return DataError(
        f"{len(skipped)} bad record(s); fix them or run without --strict to skip them:\n" + "\n".join(lines)
    )
