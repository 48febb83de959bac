"""Chat records: .json / .jsonl / .parquet files (or folders of them) read record by record.

Owns the two record formats (ShareGPT `conversations` of from/value, OpenAI-style `messages` of
role/content), their validation and normalisation to system / user / assistant messages
(`Record`), and what is skipped and why: every bad record, down to a file cut short mid-array,
is reported with its file, line and reason (`Skip`) instead of stopping the run. Files are read
forward in chunks, so memory goes by the record, not the file: a record longer than
data.max_record_bytes is skipped, with its line, before it is decoded. Also the conversation key
of the validation split, and the mark of an unfinished regeneration (`partial_path`).
preparation.py turns records into training samples; regenerate.py writes them back with the
target's answers.
"""

from __future__ import annotations

import codecs
import collections
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow.parquet as pq

from dflash_train.core.config import DEFAULT_MAX_RECORD_BYTES
from dflash_train.core.errors import InputError

DATA_SUFFIXES = (".json", ".jsonl", ".parquet")
READ_CHUNK = 1 << 20  # bytes read at once

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
# A record's optional field (either format): its replies were sampled, not greedy, and with what
# (`data regenerate --temperature` > 0 writes {"temperature", "top_p", "seed"}). Serving at T=0 sees
# the target's greedy replies, so the validation split walks no such record of a conversation
# that also has greedy ones (batching.one_version_each).
SAMPLED_REPLIES = "sampled_replies"


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

    @property
    def sampled(self) -> bool:
        """Its replies were sampled (SAMPLED_REPLIES), not the target's greedy ones."""
        return bool(self.raw.get(SAMPLED_REPLIES))


# ---------------------------------------------------------------------------------------------
# Reading


def partial_path(out: Path) -> Path:
    """The mark beside a `data regenerate` output that the regeneration writes before its first
    line and removes once the output holds every record: only an output carrying it is one this
    project is writing, the only kind whose partial last line (a run killed mid-write) is cut off
    on resume; and a data file carrying it is an unfinished regeneration (preparation says so)."""
    return out.with_name(out.name + ".partial")


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


def iter_records(paths: Iterable[str | os.PathLike],
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[Record | Skip]:
    """Every record of every file, in order, as a Record or as a Skip saying what is wrong.
    Never raises on file contents; raises DataError only for paths that do not exist. Memory
    goes by the record, not the file: a record longer than `max_record_bytes` is skipped, and
    reported with its line, before it is decoded."""
    for path in data_files(paths):
        for item, line in _iter_objects(path, max_record_bytes):
            yield item if isinstance(item, Skip) else parse_record(item, str(path), line)


def over_long(name: str, line: int, size: int, limit: int) -> Skip:
    """The skip of a record longer than the limit (data.max_record_bytes), read past unparsed."""
    return Skip(name, line, f"over-long record: {size:,} bytes, more than data.max_record_bytes ({limit:,}); "
                            "skipped unread (split the record, or raise the limit)")


def _iter_objects(path: Path, limit: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[tuple[Any, int]]:
    """(decoded object or Skip, 1-based line) for every record of one file, read forward in
    chunks: at most about two records of `limit` bytes are held at once."""
    name = str(path)
    if path.suffix == ".parquet":
        yield from _iter_parquet(path, limit)
        return
    try:
        handle = open(path, "rb")
    except OSError as err:
        yield Skip(name, 0, f"unreadable file: {err}"), 0
        return
    with handle:
        start, head = _content_start(handle)
        handle.seek(start)
        if path.suffix == ".json" and head == b"[":
            yield from _iter_json_array(name, handle, limit)
            return
        if path.suffix == ".json" and head == b"{" and os.fstat(handle.fileno()).st_size - start <= limit:
            data = handle.read()
            try:  # one (possibly pretty-printed) record
                yield json.loads(data.decode("utf-8")), 1 + data[: data.index(b"{")].count(b"\n")
                return
            except (ValueError, RecursionError):
                handle.seek(start)  # several objects, one per line, or damage: read it line by line
        # .jsonl, and .json files that hold one object per line instead of an array.
        yield from _iter_json_lines(name, handle, limit)


def _content_start(handle) -> tuple[int, bytes]:
    """(where the content starts: past a UTF-8 byte order mark, as some editors write; its first
    byte that is not blank, b"" when there is none)."""
    start = 3 if handle.read(3) == b"\xef\xbb\xbf" else 0
    handle.seek(start)
    while chunk := handle.read(READ_CHUNK):
        stripped = chunk.lstrip()
        if stripped:
            return start, stripped[:1]
    return start, b""


def _json_error(err: Exception) -> str:
    """A malformed-JSON reason from whatever the decoder raised (it also raises plain
    ValueError for over-long integers and RecursionError for very deep nesting)."""
    if isinstance(err, json.JSONDecodeError):
        return f"malformed JSON: {err.msg} at line {err.lineno} column {err.colno}"
    if isinstance(err, RecursionError):
        return "malformed JSON: nested too deeply to decode"
    return f"malformed JSON: {err}"


def _bounded_lines(handle, limit: int) -> Iterator[tuple[int, bytes | int]]:
    """(1-based line number, the line's bytes) for every line of a binary file, or (number, its
    length) for a line longer than `limit` bytes, which is read past in chunks, never held."""
    number = 0
    while line := handle.readline(limit + 1):
        number += 1
        if len(line) > limit and not (len(line) == limit + 1 and line.endswith(b"\n")):
            size = len(line)
            while not line.endswith(b"\n") and (line := handle.readline(READ_CHUNK)):
                size += len(line)
            yield number, size
            continue
        yield number, line


def _iter_json_lines(name: str, handle, limit: int) -> Iterator[tuple[Any, int]]:
    for number, raw_line in _bounded_lines(handle, limit):
        if isinstance(raw_line, int):
            yield over_long(name, number, raw_line, limit), number
            continue
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
_STRUCTURE = re.compile(r'["\[\]{},]')  # outside strings: what opens, closes or separates values
_IN_STRING = re.compile(r'["\\]')  # inside a string: its end, or an escape
PARTIAL_TOKEN = 16  # characters a token cut at the end of what was read may leave undecoded


class _Text:
    """A file's text read forward in chunks (UTF-8; bytes that are not are kept as surrogate
    escapes, so a record holding them is found), what is consumed dropped, the line counted."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.text, self.pos, self.line, self.eof = "", 0, 1, False

    def more(self, size: int = READ_CHUNK) -> bool:
        """About `size` more bytes of text; False at the end of the file."""
        if self.eof:
            return False
        data = self.handle.read(size)
        self.text, self.pos = self.text[self.pos:] + self.decoder.decode(data, final=not data), 0
        self.eof = not data
        return bool(data)

    def advance(self, to: int) -> None:
        self.line += self.text.count("\n", self.pos, to)
        self.pos = to

    def skip_space(self) -> bool:
        """Past blanks; False when the file ends first."""
        while True:
            self.advance(_WHITESPACE.match(self.text, self.pos).end())
            if self.pos < len(self.text):
                return True
            if not self.more():
                return False

    def closed(self) -> bool:
        """Whether the file's last character that is not blank is a ']' (its array is closed)."""
        size = os.fstat(self.handle.fileno()).st_size
        return os.pread(self.handle.fileno(), 64, max(0, size - 64)).rstrip().endswith(b"]")


def _iter_json_array(name: str, handle, limit: int) -> Iterator[tuple[Any, int]]:
    """Decode a JSON array element by element, reading the file forward, so a file cut
    mid-way (or broken at one place) still yields every whole record before the damage, and an
    element longer than `limit` is skipped unread. Text after a syntax error cannot be
    resynchronised reliably, so it is reported once and the file ends there."""
    src, decoder = _Text(handle), json.JSONDecoder()
    src.skip_space()
    src.advance(src.pos + 1)  # past '['
    expect_value = True
    while True:
        if not src.skip_space():
            yield Skip(name, src.line, "truncated file: the JSON array is not closed (file cut short?)"), src.line
            return
        char, line = src.text[src.pos], src.line
        if char == "]":
            src.advance(src.pos + 1)
            if src.skip_space():
                yield Skip(name, line, "malformed JSON: extra data after the closing ']'"), line
            return
        if not expect_value:
            if char != ",":
                yield Skip(name, line, f"malformed JSON: expected ',' or ']' but found {char!r}; "
                                       "the rest of the file is not read"), line
                return
            src.advance(src.pos + 1)
            expect_value = True
            continue
        obj, stop = _decode_element(src, decoder, limit)
        if stop is None and obj is None:
            size = _skip_element(src)
            yield over_long(name, line, size if size is not None else limit, limit), line
            if size is None:
                return
        elif stop is None:
            # A cut file never closes its array; a damaged one fails before its closing ']'.
            reason = ("truncated file: the file ends inside this record (the array is never closed)"
                      if not src.closed() else f"{_json_error(obj)}; the rest of the file is not read")
            yield Skip(name, line, reason), line
            return
        else:
            bad = _ESCAPED_BYTES.search(src.text, src.pos, stop)
            yield (Skip(name, line, "invalid UTF-8: the record holds bytes that are not UTF-8") if bad else obj), line
            src.advance(stop)
        expect_value = False


def _decode_element(src: _Text, decoder: json.JSONDecoder, limit: int) -> tuple[Any, int | None]:
    """(the element at src.pos, where it ends) once enough of the file is read; (the decoder's
    error, None) for an element that cannot be decoded; (None, None) for one longer than
    `limit` (nothing consumed)."""
    while True:
        try:
            obj, stop = decoder.raw_decode(src.text, src.pos)
            if stop - src.pos > limit:
                return None, None  # whole in what was read, but over the limit all the same
            if stop < len(src.text) or src.eof:
                return obj, stop  # else a number may go on past what was read
        except RecursionError as err:
            return err, None
        except ValueError as err:
            definite = (isinstance(err, json.JSONDecodeError) and not err.msg.startswith("Unterminated string")
                        and err.pos < len(src.text) - PARTIAL_TOKEN)
            if definite or src.eof:
                return err, None
        if len(src.text) - src.pos > limit:
            return None, None
        src.more(max(READ_CHUNK, len(src.text) - src.pos))  # doubling: the element is decoded again


def _skip_element(src: _Text) -> int | None:
    """Consume the JSON value at src.pos without decoding or holding it (its strings, brackets
    and separators followed through what is read); its length in characters, or None when the
    file ends inside it."""
    depth, in_string, escaped, size = 0, False, False, 0
    while True:
        text, end, i = src.text, None, src.pos
        while i < len(text) and end is None:
            if escaped:
                i, escaped = i + 1, False
                continue
            match = (_IN_STRING if in_string else _STRUCTURE).search(text, i)
            if match is None:
                i = len(text)
                break
            char = match.group()
            if in_string:
                escaped, in_string = char == "\\", char == "\\"
                end = match.end() if char == '"' and depth == 0 else None
            elif char == '"':
                in_string = True
            elif char in "[{":
                depth += 1
            elif depth == 0:  # a separator or closing bracket after a value that was no container
                end = match.start()
                continue
            elif char in "]}":
                depth -= 1
                end = match.end() if depth == 0 else None
            i = match.end()
        stop = end if end is not None else i
        size += stop - src.pos
        src.advance(stop)
        if end is not None:
            return size
        if not src.more():
            return None


PARQUET_ROWS = 64  # rows converted at once


def _iter_parquet(path: Path, limit: int) -> Iterator[tuple[Any, int]]:
    """Parquet rows, a few at a time (line = 1-based row number); a row longer than `limit`
    bytes (its Arrow data) is skipped unconverted. A file that cannot be read is one skip where
    reading stopped."""
    name, number = str(path), 0
    try:
        for batch in pq.ParquetFile(name).iter_batches(batch_size=PARQUET_ROWS):
            for i in range(batch.num_rows):
                number += 1
                row = batch.slice(i, 1)
                size = row.nbytes
                yield (over_long(name, number, size, limit) if size > limit else row.to_pylist()[0]), number
    except Exception as err:  # noqa: BLE001 - any reader failure is a bad file, not a crash
        yield Skip(name, number, f"unreadable file: parquet could not be read ({type(err).__name__}: {err})"), number


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
    """What identifies a conversation for the validation split: a hash of its opening (the
    system turns before its first user turn and that turn), so that the raw and the regenerated
    versions of a chat, several sampled replies to one prompt, a version cut short by a token
    budget (fewer turns) and the samples of a template that rewrites earlier turns all fall on
    the same side of the split."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages) - 1)
    opening = [[m["role"], m["content"]] for m in messages[:first_user + 1] if m["role"] != "assistant"]
    return hashlib.sha256(json.dumps(opening).encode("utf-8", "surrogatepass")).hexdigest()[:16]


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
