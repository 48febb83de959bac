"""Regeneration: every assistant turn of a chat file replaced by the target's own response.

Owns `dflash-train data regenerate`: reading records with chat_files' reader (bad records are
skipped and reported), rendering each assistant turn's context with the target's chat template,
and a resumable JSONL output in the input's format. Turn k of a conversation is generated from
the user turns and the already regenerated turns before it, the context the target would really
have had. Data the target wrote itself is what a drafter should learn to predict: the DFlash
paper calls it the largest lever on acceptance.

Scheduling is continuous batching over conversations (`regenerate_stream`): up to `window`
conversations are in flight, each with at most one turn being answered; when a turn's answer
comes back, that conversation's next turn is submitted at once, and a finished conversation
makes room for the next one, so the responder always has work. Answers come from a
`Responder` (responders.py): the target on the decoding engine (`LocalResponder`: rows refilled
as they finish, CUDA graphs on a GPU), or serving engines (`ServerResponder` over
serving.ServerPool, `--server`: vLLM, SGLang, `transformers serve`). Lines are written in input
order, so an output is always a prefix of the full one and a rerun resumes after its last whole
line. Every check comes before any write: an output from other input is refused untouched, and a
partial last line is cut only from an output this command is writing (the `OUT.partial` mark it
keeps beside an unfinished output); one process writes an output at a time (locks.hold).
Records that finished behind an unfinished earlier one when a run is stopped (Ctrl-C,
SIGTERM, a time box) are kept in a file beside the output (`OUT.ahead`, `ahead_path`) and the
rerun writes them without regenerating them, so a stop loses only the turns in flight. A turn's
sampling seed depends only on (seed, record position, turn) (serving.turn_seed), and at T = 0
in float32 a turn's tokens depend only on its prompt, so the output does not depend on the
batch size, the refill order or `--workers` (processes that each regenerate fixed chunks of
records with their own engine).

A run's options are a `RegenerationOptions` (the command's flags other than the data, the target,
the output and the servers, which are a serving.ServingOptions).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from transformers import AutoTokenizer

from dflash_train.core import locks
from dflash_train.core.assets import atomic_write_lines
from dflash_train.core.config import DEFAULT_MAX_RECORD_BYTES
from dflash_train.core.devices import resolve_device
from dflash_train.core.errors import output_file_problem, problems_of
from dflash_train.core.signals import StopFlag
from dflash_train.core.target import resolve_target_path
from dflash_train.data.chat_files import (
    DATA_SUFFIXES,
    FORMATS,
    SAMPLED_REPLIES,
    UNFINISHED,
    DataError,
    Record,
    Skip,
    iter_records,
    nothing_usable,
    partial_path,
)
from dflash_train.data.preparation import loop_period, render
from dflash_train.data.responders import Decoding, Responder, ServerResponder, load_responder
from dflash_train.data.serving import ServingOptions, turn_seed
from dflash_train.data.workers import parallel_map

DEFAULT_MAX_NEW_TOKENS = 2048
CHUNK_BATCHES = 4  # with --workers: records per chunk a worker regenerates = CHUNK_BATCHES * batch_size
SHOWN_SKIPS = 20  # skipped records printed by the command (the summary counts them all)
# The canonical role names written back, per input format.
OUTPUT_ROLES = {
    "sharegpt": {"system": "system", "user": "human", "assistant": "gpt"},
    "openai": {"system": "system", "user": "user", "assistant": "assistant"},
}


@dataclass(frozen=True)
class RegenerationOptions:
    """The options of one regeneration: `data regenerate`'s flags but the data, the target, the
    output and the servers (serving.ServingOptions).

    What is generated: at most `max_new_tokens` tokens per turn, sampled at `temperature`
    (greedy at 0) within nucleus `top_p` with per-turn seeds from `seed` (serving.turn_seed); a
    conversation is cut before a turn whose prompt exceeds `max_prompt_length` tokens. How:
    `batch_size` turns decoded at once (engine rows; fewer when the job has fewer turns) on
    `device`, in `workers` processes, with CUDA graphs (`graphs`), the next step queued early
    (`overlap`) and a conversation's next turn prefilled from where its last one ended
    (`continue_turns`); `window` conversations in flight (None: twice the turns the responder takes at
    once). How much: at most `limit` more records (None: every record), and none started after
    `deadline` (a time.time() instant; None: no time box: the records finished by then are
    written, `out_of_time` in the summary, and the same job resumes later). A progress line
    comes every `progress_every_s` seconds. An input record longer than `max_record_bytes` is
    skipped unread."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    max_prompt_length: int = 3072
    seed: int = 0
    batch_size: int = 64
    device: str = "auto"
    workers: int = 1
    graphs: bool = True
    overlap: bool = True
    continue_turns: bool = False
    window: int | None = None
    limit: int | None = None
    progress_every_s: float = 10.0
    deadline: float | None = None
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES

    def sampled_replies(self) -> dict[str, Any] | None:
        """What each output record's SAMPLED_REPLIES field says: None when greedy (temperature 0)."""
        if self.temperature == 0:
            return None
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}

    def decoding(self, rows: int) -> Decoding:
        """What a responder answers each turn with, `rows` turns at once."""
        return Decoding(max_new_tokens=self.max_new_tokens, max_prompt_length=self.max_prompt_length,
                        temperature=self.temperature, top_p=self.top_p, rows=rows, graphs=self.graphs,
                        overlap=self.overlap, continue_turns=self.continue_turns)


def to_output(record: Record, messages: list[dict[str, str]], sampled: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """The record in its own format with `messages` as its turns; other fields are kept but the
    mark of sampled replies (SAMPLED_REPLIES), which is `sampled` when given (how these replies
    were sampled: RegenerationOptions.sampled_replies), else left out."""
    list_key, role_key, content_key = FORMATS[record.format]
    roles = OUTPUT_ROLES[record.format]
    out = {k: v for k, v in record.raw.items() if k != SAMPLED_REPLIES}
    out[list_key] = [{role_key: roles[m["role"]], content_key: m["content"],
                      **({UNFINISHED: True} if m.get(UNFINISHED) else {})} for m in messages]
    if sampled:
        out[SAMPLED_REPLIES] = sampled
    return out


def _first_user(messages: list[dict[str, str]]) -> str | None:
    return next((m["content"] for m in messages if m["role"] == "user"), None)


def _output_first_user(line: bytes, record: Record) -> str | None:
    """The first user turn of a written output line, read as `record`'s format."""
    list_key, role_key, content_key = FORMATS[record.format]
    try:
        turns = json.loads(line)[list_key]
        return next(t[content_key] for t in turns if t[role_key] == OUTPUT_ROLES[record.format]["user"])
    except (ValueError, KeyError, TypeError, StopIteration):
        return None


def resume_point(out: Path, records: list[Record]) -> tuple[int, int | None]:
    """(how many records `out` already holds, None or the length to cut it to: its whole lines,
    when a partial last line follows them). Reads only, line by line. Each finished line must
    belong to the record at its position (same first user turn), else the output comes from
    other input and DataError says so; a partial last line is cut only from an output that
    carries the `partial_path` mark, else DataError: a file of the user's is never changed."""
    if not out.exists():
        return 0, None
    with open(out, "rb") as handle:
        whole = sum(1 for line in handle if line.endswith(b"\n"))
    if whole > len(records):
        raise DataError(f"--out {out} holds {whole} records but the input has {len(records)}; "
                        "it comes from other input: choose another --out")
    kept = 0
    with open(out, "rb") as handle:
        for number, (line, record) in enumerate(zip(handle, records[:whole]), start=1):
            if _output_first_user(line, record) != _first_user(record.messages):
                raise DataError(f"{out}:{number} does not match input record {record.file}:{record.line}; "
                                "the output comes from other input: choose another --out or delete it")
            kept += len(line)
    size = out.stat().st_size
    if kept == size:
        return whole, None
    if not partial_path(out).is_file():
        raise DataError(f"--out {out}: its last line is cut off ({size - kept} bytes after line {whole}) and no "
                        f"unfinished `data regenerate` wrote it (no {partial_path(out).name} beside it), so it is "
                        "left as it is: choose another --out")
    return whole, kept


def ahead_path(out: Path) -> Path:
    """The file beside `out` that keeps the records a stopped run finished ahead of its written
    prefix (not .jsonl, so a folder of training data never reads it)."""
    return out.with_name(out.name + ".ahead")


def read_ahead(out: Path, records: list[Record], done: int) -> dict[int, str]:
    """The kept records of `out`'s ahead file (position -> output line) that are not written yet
    (position >= `done`). Each must be the record at its position (same first user turn), else
    the file comes from other input and DataError says so."""
    path = ahead_path(out)
    if not path.exists():
        return {}
    kept: dict[int, str] = {}
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            entry = json.loads(raw)
            position, line = int(entry["position"]), entry["line"]
            if not isinstance(line, str):
                raise TypeError("line is not a string")
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(f"{path}:{number}: not a kept record ({err}); delete {path} (its records are "
                            "regenerated)") from None
        if position < done:
            continue  # written since (an older file)
        record = records[position] if position < len(records) else None
        if record is None or _output_first_user(line.encode(), record) != _first_user(record.messages):
            where = f"input record {record.file}:{record.line}" if record is not None else \
                f"any input record (the input has {len(records)})"
            raise DataError(f"{path}:{number} (record {position + 1}) does not match {where}; it comes from other "
                            f"input: delete {path} or choose another --out")
        kept[position] = line if line.endswith("\n") else line + "\n"
    return kept


def keep_ahead(out: Path, kept: dict[int, str], written: int) -> int:
    """Rewrite `out`'s ahead file (atomically) with the kept records not written yet (position >=
    `written`), or remove it when there are none. Returns how many it keeps."""
    path = ahead_path(out)
    left = sorted(p for p in kept if p >= written)
    if not left:
        path.unlink(missing_ok=True)
        return 0
    atomic_write_lines(path, (json.dumps({"position": p, "line": kept[p]}, ensure_ascii=False) + "\n" for p in left))
    return len(left)


class _Stopped(Exception):
    """A signal asked the one-process regeneration to stop (StopFlag)."""


class _OutOfTime(Exception):
    """RegenerationOptions.deadline passed: the stream ends as a stop does, and no signal is said."""


class _StopFlag(StopFlag):
    """SIGINT / SIGTERM: the first asks the stream to stop after the step in progress; a second
    one interrupts at once (a step that hangs), and the finished records are still kept."""

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        super()._handle(signum, frame)


class Conversation:
    """One record on its way through regeneration: the messages so far (system and user turns
    as written, assistant turns as regenerated) and where it stands in the record."""

    def __init__(self, position: int, record: Record) -> None:
        self.position, self.record = position, record
        self.messages: list[dict[str, str]] = []
        self.cursor = 0  # index of the next message of the record
        self.turn = 0  # assistant turns answered so far
        self.prompt_ids = None  # PromptIds' state: the last prompt's text, ids and cut points

    def next_prompt(self) -> list[dict[str, str]] | None:
        """The context of the next assistant turn (ending with its user turn), or None when
        the record has no more assistant turns."""
        messages = self.record.messages
        while self.cursor < len(messages) and messages[self.cursor]["role"] != "assistant":
            self.messages.append(messages[self.cursor])
            self.cursor += 1
        return None if self.cursor == len(messages) else self.messages

    def answer(self, text: str, stopped: bool = True) -> None:
        """The turn's response; one that ended without the target's stop token (its budget ran
        out) is marked unfinished, so that training does not supervise the end-of-turn token the
        template closes it with."""
        self.messages.append({"role": "assistant", "content": text, **({} if stopped else {UNFINISHED: True})})
        self.cursor += 1
        self.turn += 1

    def line(self, sampled: dict[str, Any] | None = None) -> str:
        return json.dumps(to_output(self.record, self.messages, sampled), ensure_ascii=False) + "\n"


def _positions(ids: list[int], wanted: set[int]) -> list[int]:
    """The indices of `ids` holding one of `wanted`, ascending (list.index scans in C, once
    per wanted id that occurs: a prompt holds a few special tokens among thousands of ids)."""
    found = []
    for t in wanted.intersection(ids):
        j = ids.index(t)
        while True:
            found.append(j)
            try:
                j = ids.index(t, j + 1)
            except ValueError:
                break
    return sorted(found)


class PromptIds:
    """The token ids of each conversation's next prompt, tokenizing only the text that is new
    since its last prompt. A fast tokenizer splits its input at added tokens before anything
    else and tokenizes the pieces between them independently, so the ids of a text up to the
    end of a special token do not depend on what follows it. When the chat template renders the
    earlier turns unchanged (ChatML, Llama 3: the common prefix is the whole last prompt), the
    next prompt's ids are the last prompt's up to its last special token inside the shared text,
    followed by the new text's (the answer, the next user turn, the generation prompt). The ids
    are those of tokenizing the whole text, which is what a server given the rendered text
    sees (tests compare them on real chats and templates).

    Only special tokens that absorb no neighbouring whitespace and are matched unnormalized
    are used as cut points; a slow tokenizer, or one with none, tokenizes every prompt whole.
    As a guard, the first `check` prompts that reuse ids are also tokenized whole and compared;
    any difference turns reuse off for the rest of the run (`mismatch` says what). Tokenizing
    every prompt whole was most of the scheduler's host time (docs/PERFORMANCE.md)."""

    def __init__(self, tokenizer, check: int = 64) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.cut_ids = {i for i, t in decoder.items()
                        if t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized)}
        self.enabled = bool(getattr(tokenizer, "is_fast", False)) and bool(self.cut_ids)
        self.check = int(check)
        self.mismatch: str | None = None
        self.reused_tokens = 0  # prompt ids taken over from the last prompt instead of tokenized again

    def encode(self, prompts: list[tuple[Any, str]]) -> list[list[int]]:
        """The ids of each (conversation, rendered text); a conversation's state from its last
        prompt is read from and written to its `prompt_ids` attribute, a (text, ids, cuts)
        triple with cuts [(end of a special token in text, ids up to it)], or None."""
        if not prompts:
            return []
        if not self.enabled:
            return self.tokenizer([text for _, text in prompts], add_special_tokens=False)["input_ids"]
        heads, tails = [], []
        for conv, text in prompts:
            head = (0, [], [])  # (characters, ids, cuts) taken over
            state = getattr(conv, "prompt_ids", None)
            if state is not None:
                last, ids, cuts = state
                for k in range(len(cuts) - 1, -1, -1):
                    c, n = cuts[k]
                    if text.startswith(last[:c]):
                        head = (c, ids[:n], cuts[: k + 1])
                        break
            heads.append(head)
            tails.append(text[head[0]:])
        enc = self.tokenizer(tails, add_special_tokens=False, return_offsets_mapping=True)
        out, whole = [], []
        for (conv, text), (c, head_ids, head_cuts), tail_ids, offsets in zip(
                prompts, heads, enc["input_ids"], enc["offset_mapping"]):
            ids = head_ids + tail_ids
            cuts = head_cuts + [(c + offsets[j][1], len(head_ids) + j + 1) for j in _positions(tail_ids, self.cut_ids)]
            if head_ids and self.check > 0:
                whole.append((len(out), conv, text))
            self.reused_tokens += len(head_ids)
            conv.prompt_ids = (text, ids, cuts)
            out.append(ids)
        if whole:
            self.check -= len(whole)
            full = self.tokenizer([text for *_, text in whole], add_special_tokens=False)["input_ids"]
            for (i, conv, text), ids in zip(whole, full):
                if ids != out[i]:
                    self.enabled = False
                    self.mismatch = (f"a prompt of {len(text)} characters tokenized in two parts differs from "
                                     f"tokenizing it whole; prompts are tokenized whole from here on")
                    out[i] = ids
                    conv.prompt_ids = None
        return out


CHUNK_STATS = ("num_turns", "num_unfinished", "num_looping", "num_empty", "num_cut", "num_template_errors",
               "num_prompt_tokens_reused", "num_prompt_id_mismatches")  # the last two: PromptIds
# Host seconds of the scheduler's own work, outside the engine's steps: rendering and tokenizing
# each next prompt (prompt_s), and turning each finished turn's ids into text (text_s); and of the
# engine's (slots.SlotDecoder.seconds): refills (prefill_s: their forward and first tokens),
# queueing decode steps (launch_s), waiting for a step's tokens (wait_s; with the next step queued
# first, the host's own work hides behind the GPU's, so wait_s near the elapsed time means the GPU
# is the limit) and booking them (book_s).
HOST_STATS = ("prompt_s", "text_s")
ENGINE_STATS = ("prefill_s", "launch_s", "wait_s", "book_s")


class _Scheduler:
    """The state of one `regenerate_stream`: the conversations in flight (`active`, by record
    position), the finished records' lines not yet yielded (`finished`), the prompts' ids
    (PromptIds) and the counts (`stats`)."""

    def __init__(self, responder: Responder, tokenizer, options: RegenerationOptions, stats: dict[str, Any],
                 finished: dict[int, str]) -> None:
        self.responder, self.tokenizer, self.options, self.stats = responder, tokenizer, options, stats
        self.finished = finished
        self.active: dict[int, Conversation] = {}
        self.prompt_ids = PromptIds(tokenizer)

    def join(self, waiting: deque, window: int) -> None:
        """Take records from `waiting` until `window` conversations are in flight (skipping those
        a stopped run kept) and submit their first turns."""
        joining = []
        while waiting and len(self.active) < window:
            position, record = waiting.popleft()
            if position in self.finished:  # kept by a stopped run
                continue
            self.active[position] = Conversation(position, record)
            joining.append(self.active[position])
        self.advance(joining)

    def finish(self, conv: Conversation) -> None:
        del self.active[conv.position]
        self.finished[conv.position] = conv.line(self.options.sampled_replies())

    def _render(self, convs: list[Conversation]) -> list[tuple[Conversation, str]]:
        """The rendered prompt of each conversation's next turn; a conversation without one, or
        whose prompt the template refuses, is finished."""
        rendered = []
        for conv in convs:
            prompt = conv.next_prompt()
            if prompt is None:
                self.finish(conv)
                continue
            try:
                rendered.append((conv, render(self.tokenizer, prompt, generation_prompt=True)))
            except Exception:  # noqa: BLE001 - a template may refuse a conversation (jinja raise)
                self.stats["num_template_errors"] += 1
                self.finish(conv)
        return rendered

    def advance(self, convs: list[Conversation]) -> None:
        """Submit each conversation's next turn, or finish it. The prompts are tokenized in one
        call (the tokenizer spreads a batch over its threads)."""
        stats, prompt_ids = self.stats, self.prompt_ids
        began = time.perf_counter()
        rendered = self._render(convs)
        reused, mismatch = prompt_ids.reused_tokens, prompt_ids.mismatch
        encoded = prompt_ids.encode(rendered)
        stats["num_prompt_tokens_reused"] += prompt_ids.reused_tokens - reused
        stats["num_prompt_id_mismatches"] += prompt_ids.mismatch is not None and mismatch is None
        stats["prompt_s"] += time.perf_counter() - began
        for (conv, text), ids in zip(rendered, encoded):
            if len(ids) > self.options.max_prompt_length:
                stats["num_cut"] += 1  # the rest of this conversation is dropped
                self.finish(conv)
            else:
                self.responder.submit(conv.position, text, ids, turn_seed(self.options.seed, conv.position, conv.turn))

    def answer(self) -> None:
        """Wait for answered turns (none when nothing is in flight), count them, and submit their
        conversations' next turns."""
        stats, responder = self.stats, self.responder
        text_before = getattr(responder, "text_seconds", 0.0)
        answered = responder.poll() if self.active else []
        stats["text_s"] += getattr(responder, "text_seconds", 0.0) - text_before
        for position, text, stopped, ids in answered:
            stats["num_turns"] += 1
            stats["num_unfinished"] += not stopped
            stats["num_looping"] += not stopped and loop_period(ids) is not None  # ends in a loop (eval's rule)
            stats["num_empty"] += not text.strip()
            self.active[position].answer(text, stopped)
        self.advance([self.active[position] for position, *_ in answered])


def regenerate_stream(responder: Responder, tokenizer, records: list[Record], first_position: int,
                      options: RegenerationOptions, stats: dict[str, int],
                      on_poll: Callable[[int], None] | None = None,
                      finished: dict[int, str] | None = None) -> Iterator[str]:
    """The output lines of `records` (whose first is record `first_position` of the input), in
    order, regenerated by continuous batching over conversations (module docstring). A
    conversation is cut (its remaining turns dropped; counted in `num_cut`, or
    `num_template_errors` when the template refuses it) before a turn whose prompt exceeds
    `options.max_prompt_length` tokens. `stats` (CHUNK_STATS) is updated as turns come back, and
    `on_poll(finished)` is called after every answered batch with the number of records finished
    so far (written or waiting for an earlier, longer one), for progress reports.

    `finished` (position -> output line), when given, is the caller's store of records done but
    not yet yielded: records already in it (kept by a stopped run) are not regenerated, and
    whatever it holds when the stream stops early is what the caller keeps (`keep_ahead`)."""
    window = max(1, int(options.window or 2 * responder.capacity))
    finished = {} if finished is None else finished
    scheduler = _Scheduler(responder, tokenizer, options, stats, finished)
    waiting = deque(enumerate(records, start=first_position))
    next_out, end = first_position, first_position + len(records)
    beyond = sum(not first_position <= k < end for k in finished)  # kept for records after this range

    for key in CHUNK_STATS:
        stats.setdefault(key, 0)
    for key in HOST_STATS:
        stats.setdefault(key, 0.0)

    while waiting or scheduler.active:
        scheduler.join(waiting, window)
        while next_out < end and next_out in finished:
            yield finished.pop(next_out)
            next_out += 1
        scheduler.answer()
        if on_poll is not None:
            on_poll(next_out - first_position + len(finished) - beyond)
    while next_out < end and next_out in finished:
        yield finished.pop(next_out)
        next_out += 1


def _worker_setup(device, target: str, tokenizer, options: RegenerationOptions, decoding: Decoding):
    responder, tokenizer = load_responder(target, str(device), decoding, tokenizer=tokenizer)
    return responder, tokenizer, options


def _worker_span(state, item) -> tuple[str, dict[str, int]]:
    """One chunk of records (position, records, the chunk's kept records) regenerated in a
    worker: its lines and counts."""
    responder, tokenizer, options = state
    position, records, kept = item
    stats = {**dict.fromkeys(CHUNK_STATS, 0), **dict.fromkeys(HOST_STATS, 0.0)}
    before, kept_before, engine = responder.generated_tokens, responder.kept_prompt_tokens, responder.engine_seconds()
    text = "".join(regenerate_stream(responder, tokenizer, records, position, options, stats, finished=dict(kept)))
    stats["num_new_tokens"] = responder.generated_tokens - before
    stats["num_prompt_tokens_kept"] = responder.kept_prompt_tokens - kept_before
    stats.update({k: v - engine[k] for k, v in responder.engine_seconds().items()})
    return text, stats


class _Writer:
    """Appends lines to the output in order: flushed and fsynced every `every_s` seconds and at
    the end, so a run killed at any point leaves a prefix of the output (at worst a partial
    last line, cut off on resume)."""

    def __init__(self, path: Path, every_s: float = 5.0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(path, "a", encoding="utf-8")
        self.every_s, self.last = every_s, time.perf_counter()

    def write(self, text: str) -> None:
        self.handle.write(text)
        if time.perf_counter() - self.last >= self.every_s:
            self.sync()

    def sync(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.last = time.perf_counter()

    def close(self) -> None:
        self.sync()
        self.handle.close()


def _progress(log, finished: int, total: int, resumed: int, stats: dict, tokens: int, started: float) -> None:
    """One progress line: records finished of `total` (written, or done and waiting for an
    earlier one), turns, new tokens and their rate, elapsed time, and the ETA from the rate at
    which records finish."""
    elapsed = time.perf_counter() - started
    rate = (finished - resumed) / elapsed if elapsed > 0 else 0.0
    eta = f"{(total - finished) / rate:.0f} s" if rate > 0 else "unknown"
    host = ""
    if elapsed > 0 and (stats["prompt_s"] or stats["text_s"]):
        host = (f", host: prompts {100 * stats['prompt_s'] / elapsed:.0f}%, "
                f"text {100 * stats['text_s'] / elapsed:.0f}% of the time")
    if elapsed > 0 and stats.get("wait_s"):
        kept = f" ({stats['num_prompt_tokens_kept']:,} prompt tokens kept from the turn before)" \
            if stats.get("num_prompt_tokens_kept") else ""
        host += (f"; engine: refills {100 * stats['prefill_s'] / elapsed:.0f}%{kept}, queueing steps "
                 f"{100 * stats['launch_s'] / elapsed:.0f}%, waiting on decode steps "
                 f"{100 * stats['wait_s'] / elapsed:.0f}%, booking {100 * stats['book_s'] / elapsed:.0f}%")
    log(f"data regenerate: {finished}/{total} records ({stats['num_written']} written), {stats['num_turns']} turns, "
        f"{tokens} tokens, {tokens / max(elapsed, 1e-9):,.0f} tokens/s, {elapsed:.0f} s, ETA {eta}{host}")


def input_output_overlap(paths, out) -> str | None:
    """What is wrong when `out` is one of the input files (`paths`: files or folders), or a data
    file inside an input folder: resuming matches records by their first user turn, so the input
    itself would pass as its finished regeneration (nothing regenerated, said as done), and a
    rerun would read the answers as input; None when they are apart."""
    resolved = Path(out).resolve()
    for raw in paths:
        path = Path(raw).resolve()
        if resolved == path:
            return (f"--out {out} is the input file itself; regeneration writes the target's answers to a new "
                    f"file: choose another --out")
        if path.is_dir() and resolved.is_relative_to(path) and resolved.suffix in DATA_SUFFIXES:
            return (f"--out {out} lies in the input folder {raw}, so a rerun would read its answers as input: "
                    f"choose an --out outside it")
    return None


def _problems(paths, target, out, options: RegenerationOptions, serving: ServingOptions | None,
              model) -> list[str]:
    """What is wrong with a regeneration's settings, in words, in the order the error lists them."""
    o = options
    problems = [f"{name}={value} (need >= 1)" for name, value in
                (("max_new_tokens", o.max_new_tokens), ("batch_size", o.batch_size), ("workers", o.workers),
                 ("max_prompt_length", o.max_prompt_length)) if value < 1]
    if o.temperature < 0 or not 0 < o.top_p <= 1:
        problems.append(f"temperature={o.temperature}, top_p={o.top_p} (need temperature >= 0, 0 < top_p <= 1)")
    if o.workers > 1 and model is not None:
        problems.append("workers > 1 loads the target in each worker: pass a target path, not a model object")
    if serving is not None and (o.workers != 1 or o.device != "auto" or model is not None):
        problems.append("--server sends every turn to the servers: --workers and --device (and a model "
                        "object) are for local generation only; leave them out")
    if o.limit is not None and o.limit < 1:
        problems.append(f"limit={o.limit} (need >= 1; leave it out for every record)")
    problem = output_file_problem(out)
    if problem is not None:
        problems.append(f"--out {out}: {problem}")
    overlap = input_output_overlap(paths, out)
    if overlap is not None:
        problems.append(overlap)
    if model is None:
        problems += problems_of(lambda: resolve_target_path(str(target), "--target"))
    if serving is None:
        problems += problems_of(lambda: resolve_device(o.device, setting="--device"))
    return problems


@dataclass
class _Job:
    """One regeneration under way: its output, the input's valid records, how many the output
    already holds (`done`), the records a stopped run finished ahead (`kept`, position -> line),
    where this run stops, the summary it returns, its log and when its clock started."""

    out: Path
    records: list[Record]
    done: int
    kept: dict[int, str]
    stop: int
    summary: dict[str, Any]
    log: Callable[[str], None]
    started: float = 0.0
    cut: int | None = None  # the output's length without its partial last line, when it has one


def _open_job(paths, out: Path, options: RegenerationOptions, log) -> _Job:
    """The records of `paths` (skips counted in the summary), where `out` and its ahead file
    leave off, and the summary so far; a DataError when no record is usable. Reads only: a
    partial last line of `out` is cut later (`_repair`), once every check has passed."""
    records: list[Record] = []
    skipped: list[Skip] = []
    limit = options.limit
    for item in iter_records(paths, options.max_record_bytes):
        (skipped if isinstance(item, Skip) else records).append(item)
    if not records:
        raise DataError(f"--data: {nothing_usable(paths, len(skipped), skipped)}")
    done, cut = resume_point(out, records)
    kept = read_ahead(out, records, done)
    stop = len(records) if limit is None else min(len(records), done + limit)
    summary = {"num_records": len(records) + len(skipped), "num_skipped": len(skipped),
               "skipped": [s.as_dict() for s in skipped], "num_resumed": done,
               "num_ahead_resumed": sum(done <= p < stop for p in kept), "num_ahead_kept": len(kept),
               "num_written": 0, **dict.fromkeys(CHUNK_STATS, 0), **dict.fromkeys(HOST_STATS, 0.0),
               **dict.fromkeys(ENGINE_STATS, 0.0), "num_new_tokens": 0, "num_prompt_tokens_kept": 0}
    if done:
        log(f"data regenerate: resuming {out} after {done} of {len(records)} records")
    if summary["num_ahead_resumed"]:
        log(f"data regenerate: {summary['num_ahead_resumed']} records a stopped run finished ahead are kept in "
            f"{ahead_path(out)}; they are written without being regenerated")
    return _Job(out, records, done, kept, stop, summary, log, cut=cut)


def _start_writing(job: _Job) -> "_Writer":
    """The output's writer, opened after every check has passed (the target and the servers
    too): the partial last line of an output this project is writing cut off, and the mark that
    it is unfinished written before the first new line."""
    if job.cut is not None:
        with open(job.out, "r+b") as handle:
            handle.truncate(job.cut)
        job.log(f"data regenerate: cut the partial last line a stopped run left in {job.out}")
    mark = partial_path(job.out)
    if not mark.exists():
        job.out.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(json.dumps({"written_by": "dflash-train data regenerate", "output": job.out.name}) + "\n")
    return _Writer(job.out)


def _finish(job: _Job) -> None:
    """The unfinished mark removed once the output holds every record."""
    if job.done + job.summary["num_written"] >= len(job.records):
        partial_path(job.out).unlink(missing_ok=True)


def _responder(target, device: str, decoding: Decoding, pool, log, model=None, tokenizer=None):
    """(responder, tokenizer) of a run in this process: the servers of `pool` (checked first),
    or, without a pool, the target loaded here."""
    if pool is None:
        return load_responder(target, device, decoding, model=model, tokenizer=tokenizer)
    models = pool.check()  # before anything is written: a wrong URL fails in seconds
    log("data regenerate: " + ", ".join(f"{url} ({name})" for url, name in models.items())
        + f", concurrency {pool.concurrency}")
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(str(target)))
    return ServerResponder(pool, tokenizer, decoding), tokenizer


def _write_stream(job: _Job, responder: Responder, tokenizer, options: RegenerationOptions, writer: _Writer) -> None:
    """The job's records regenerated in this process and written in order, with a progress line
    every `options.progress_every_s` seconds, written lines or not. A first SIGINT / SIGTERM (in
    the main thread) stops the stream after the step in progress (`stopped` in the summary);
    what finished ahead stays in `job.kept`."""
    summary = job.summary
    job.started = time.perf_counter()
    last_log = [job.started]
    signals = _StopFlag().install() if threading.current_thread() is threading.main_thread() else None

    def report(finished: int) -> None:
        summary["num_new_tokens"] = responder.generated_tokens
        summary["num_prompt_tokens_kept"] = responder.kept_prompt_tokens
        summary.update(responder.engine_seconds())
        if time.perf_counter() - last_log[0] >= options.progress_every_s:
            _progress(job.log, job.done + finished, job.stop, job.done, summary, summary["num_new_tokens"],
                      job.started)
            last_log[0] = time.perf_counter()
        if signals is not None and signals.requested:
            raise _Stopped  # out of the stream: what finished ahead stays in `kept`
        if options.deadline is not None and time.time() >= options.deadline:
            raise _OutOfTime

    try:
        for line in regenerate_stream(responder, tokenizer, job.records[job.done:job.stop], job.done, options,
                                      summary, on_poll=report, finished=job.kept):
            writer.write(line)
            summary["num_written"] += 1
    except _Stopped:
        summary["stopped"] = signals.requested
    except _OutOfTime:
        summary["out_of_time"] = True
    finally:
        if signals is not None:
            signals.restore()
    summary["num_new_tokens"] = responder.generated_tokens
    summary["num_prompt_tokens_kept"] = responder.kept_prompt_tokens
    summary.update(responder.engine_seconds())
    summary["capture_s"] = responder.capture_seconds
    summary["rows"] = responder.capacity  # turns decoded at once (engine rows, or server concurrency)


def _write_chunks(job: _Job, target, tokenizer, options: RegenerationOptions, decoding: Decoding,
                  writer: _Writer) -> None:
    """The job's records regenerated by `options.workers` processes (workers.parallel_map) in
    chunks of CHUNK_BATCHES * batch_size records, appended in order, a progress line each."""
    chunk = CHUNK_BATCHES * options.batch_size
    spans, position = [], job.done
    while position < job.stop:  # fixed boundaries: a resumed run makes the same chunks
        spans.append((position, min(job.stop, (position // chunk + 1) * chunk)))
        position = spans[-1][1]
    items = [(a, job.records[a:b], {p: job.kept[p] for p in job.kept if a <= p < b}) for a, b in spans]
    results = parallel_map(_worker_setup, (str(target), tokenizer, options, decoding), _worker_span, items,
                           num_workers=options.workers, device=resolve_device(options.device, setting="--device"))
    summary = job.summary
    for (a, b), (text, stats) in zip(spans, results):
        writer.write(text)
        writer.sync()
        for key, value in stats.items():
            summary[key] += value
        summary["num_written"] += b - a
        _progress(job.log, b, job.stop, job.done, summary, summary["num_new_tokens"], job.started)


def _conclude(job: _Job) -> dict[str, Any]:
    """The summary completed with the run's time and rate, after the last progress line (and,
    for a stopped run, where its records are and that the same command resumes)."""
    summary = job.summary
    if summary.get("stopped"):
        where = f", {summary['num_ahead_kept']} finished ahead kept in {ahead_path(job.out)}" \
            if summary["num_ahead_kept"] else ""
        job.log(f"data regenerate: {summary['stopped']} received: {job.done + summary['num_written']} records "
                f"written to {job.out}{where}; the same command resumes: {locks.command_line()}")
    seconds = time.perf_counter() - job.started
    summary["seconds"] = seconds
    summary["tokens_per_s"] = summary["num_new_tokens"] / seconds if seconds > 0 else None
    _progress(job.log, job.done + summary["num_written"], job.stop, job.done, summary, summary["num_new_tokens"],
              job.started)
    return summary


def regenerate(paths, target, out, options: RegenerationOptions = RegenerationOptions(),
               serving: ServingOptions | None = None, *, log=print, model=None, tokenizer=None) -> dict[str, Any]:
    """Write `out` (JSONL, one line per valid input record, in the record's own format) with
    every assistant turn replaced by the target's response (`options`: RegenerationOptions).
    Resumes an existing `out`; with `options.limit`, stops after that many more records. With
    `options.workers` > 1, chunks of records are regenerated by that many processes
    (workers.parallel_map) and appended in order, so the output is the same. With `serving`
    (serving.ServingOptions naming at least one server), the turns are sent to those serving
    engines instead (serving.ServerPool), scheduled the same way, and only the target's
    tokenizer is loaded. `model` and `tokenizer`, when given, are used instead of loading them
    from `target`. Returns a summary with the skipped records and the measured rate."""
    serving = serving if serving is not None and serving.urls else None
    problems = _problems(paths, target, out, options, serving, model)
    if problems:
        raise DataError("invalid regenerate settings: " + "; ".join(problems))
    out = Path(out)
    lock = out.with_name(f".{out.name}.lock")
    with locks.discard_if_created(lock, out.parent), locks.hold(
            lock, f"--out {out}", "wait for that regeneration to end, or choose another --out", log):
        job = _open_job(paths, out, options, log)
        if job.done >= job.stop:
            _finish(job)
            return job.summary
        return _run_job(job, target, options, serving, (log, model, tokenizer))


def _run_job(job: _Job, target, options: RegenerationOptions, serving: ServingOptions | None, given) -> dict[str, Any]:
    """The job's records regenerated (in this process or in workers) and appended to its
    output; `given`: (log, model, tokenizer) as `regenerate` was called with them."""
    log, model, tokenizer = given
    # no more rows than the turns to answer: a small job allocates no caches it cannot fill
    turns = sum(m["role"] == "assistant" for record in job.records[job.done:job.stop] for m in record.messages)
    decoding = options.decoding(rows=min(options.batch_size, max(1, turns)))
    job.started = time.perf_counter()
    pool = serving.pool() if serving is not None else None
    writer = None
    try:
        if options.workers == 1:
            responder, tokenizer = _responder(target, options.device, decoding, pool, log, model, tokenizer)
            writer = _start_writing(job)
            _write_stream(job, responder, tokenizer, options, writer)
        else:
            writer = _start_writing(job)
            _write_chunks(job, target, tokenizer, options, decoding, writer)
    finally:
        if writer is not None:
            writer.close()
            job.summary["num_ahead_kept"] = keep_ahead(job.out, job.kept, job.done + job.summary["num_written"])
            _finish(job)
        if pool is not None:
            pool.close()
    return _conclude(job)
