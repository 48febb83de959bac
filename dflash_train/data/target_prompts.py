"""Prompts written by the target itself: the `target-prompts` source of `dflash-train data source`.

A drafter accelerates text like the text it was trained on, and a user rarely has the chats their
target was tuned on. The target knows what it expects to be asked: opened at a user turn of its
own chat template and sampled, it writes a user's message. This module owns that source:

- A conversation opens with the template's own start (its default system prompt included, where
  it has one), or, for a share of the conversations (`system_share`), with a system message the
  target writes itself (the template opened at a system turn), where the template has a system
  role. The target then writes the first user turn, sampled at `temperature` / `top_p` on the
  decoding engine, one seed per (record, turn) so that a record does not depend on batching.
- Every user turn is answered greedily (T = 0) on the engine, as `data regenerate` answers, and
  the target writes the next user turn after it, up to a number of user turns drawn per record
  from 1..`max_turns`, while the conversation fits `max_length` tokens. The records are finished
  chats in the target's own words: training reads them as they are, and `data regenerate` gives
  them back unchanged (up to rounding).
- Filters, counted by reason: empty turns, turns cut at `max_prompt_tokens` (truncated / over-long),
  a "user" turn that is a refusal or an assistant's reply, an empty answer; and duplicates of an
  earlier first user turn, exact (normalised text) or near (MinHash LSH of word shingles at
  Jaccard `near_duplicate`, datasketch). A later turn that fails ends its conversation there.
- The output is JSONL (ShareGPT records, `source: target-prompts`, ids `target-prompts:SEED:N` with
  N the candidate's index), written in candidate order as chunks finish: a rerun of the same
  command resumes after the last whole record (the deduplication index is rebuilt from it), and
  the records do not depend on where a run was stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer

from dflash_train.core import locks
from dflash_train.core.devices import resolve_device
from dflash_train.core.errors import InputError, output_file_problem
from dflash_train.core.target import load_target_model, resolve_target_path
from dflash_train.data.chat_files import DataError
from dflash_train.data.preparation import render
from dflash_train.data.responders import Decoding, LocalResponder, check_cache_memory
from dflash_train.data.serving import turn_seed

SOURCE = "target-prompts"
MARK = "\ue000dflash-train\ue001"  # private-use characters: no template or tokenizer makes them
NUM_PERM = 128
SHINGLE_WORDS = 3
# A "user" turn that opens like an assistant's reply: the target answered instead of asking.
REFUSAL = re.compile(r"^\W*(i'?m sorry|i am sorry|sorry[,.!]|i apologi[sz]e|i can(?:no|')t (?:help|assist|do|provide|"
                     r"answer|comply)|i cannot|i'?m (?:not able|unable)|i am (?:not able|unable)|as an ai\b|"
                     r"as a language model|certainly[,!.]|sure[,!]|of course[,!]|here is |here's )", re.IGNORECASE)
PROGRESS_EVERY_S = 30.0
# The last chunks: candidates for the records still needed at the rate kept so far, times KEEP_MARGIN,
# plus MARGIN_CANDIDATES, at most one engine batch (a chunk that falls short is followed by another)
KEEP_MARGIN = 1.15
MARGIN_CANDIDATES = 16


@dataclass(frozen=True)
class TargetPromptOptions:
    """How the target writes its conversations (`dflash-train data source --source target-prompts`)."""

    limit: int
    """Records to write (kept after the filters)."""
    seed: int = 0
    temperature: float = 1.0
    """Sampling temperature of the user (and system) turns; must be > 0."""
    top_p: float = 0.95
    max_turns: int = 1
    """User turns per conversation at most; each record draws its count from 1..max_turns."""
    system_share: float = 0.0
    """Share of the conversations that open with a system message the target writes."""
    max_prompt_tokens: int = 512
    """A user or system turn that has not ended within this many tokens is dropped (truncated)."""
    max_new_tokens: int = 2048
    """The answers' budget, as `data regenerate --max-new-tokens`."""
    max_length: int = 4096
    """No turn is added once the conversation's context would pass this many tokens."""
    near_duplicate: float = 0.8
    """Jaccard similarity of word shingles (MinHash) at which a first user turn is a near
    duplicate of an earlier one."""
    batch_size: int = 64
    """Turns decoded at once on the engine."""
    device: str = "auto"
    graphs: bool = True
    deadline: float | None = None
    """No chunk of candidates starts after this time.time() instant (None: no time box); the
    records written by then stay, and the same command resumes."""
    max_candidates: int | None = None
    """Candidates tried before a target that writes too little is given up (None: 20 per record
    asked for, at least 1,000)."""

    def problems(self) -> list[str]:
        p = []
        for name in ("limit", "max_turns", "max_prompt_tokens", "max_new_tokens", "max_length", "batch_size"):
            if getattr(self, name) < 1:
                p.append(f"--{flag_of(name)} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            p.append(f"--temperature must be > 0: the target writes varied prompts only when it samples, "
                     f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            p.append(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.system_share <= 1:
            p.append(f"--system-share must be in [0, 1], got {self.system_share}")
        if not 0 < self.near_duplicate <= 1:
            p.append(f"--near-duplicate must be in (0, 1], got {self.near_duplicate}")
        if min(self.max_prompt_tokens, self.max_new_tokens, self.max_length) >= 1 and \
                self.max_prompt_tokens + self.max_new_tokens > self.max_length:
            # A turn written to its budget and answered to its own would be dropped as over-long.
            p.append(f"--max-prompt-tokens {self.max_prompt_tokens} and --max-new-tokens {self.max_new_tokens} "
                     f"pass --max-length {self.max_length}: a written turn and its answer must fit a conversation; "
                     f"raise --max-length or lower the other two")
        return p


# The `data source` flag of an option whose name differs from it (problems name the flag)
FLAG_OF = {"max_turns": "turns"}


def flag_of(name: str) -> str:
    """The `data source` flag of option `name`, without its dashes."""
    return FLAG_OF.get(name, name).replace("_", "-")

# The options that shape the records (the rest only say how fast or how long they are written): each
# record keeps them (`written_with`, by flag), and a resumed run with others is refused
RECORD_OPTIONS = ("max_turns", "system_share", "temperature", "top_p", "max_prompt_tokens", "max_new_tokens",
                  "max_length", "near_duplicate")


def written_with(options: TargetPromptOptions) -> dict:
    """The options that shape the records, by their `data source` flag (a record's `written_with`)."""
    return {flag_of(name): getattr(options, name) for name in RECORD_OPTIONS}


@dataclass
class Conversation:
    """One candidate record while the target writes it."""

    index: int
    turns: int  # user turns wanted
    system: bool  # opens with a system message the target writes
    messages: list[dict] = field(default_factory=list)
    alive: bool = True

    @property
    def users(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)


class Deduplicator:
    """Exact and near duplicates among the first user turns of the records kept so far."""

    def __init__(self, threshold: float) -> None:
        # datasketch (and the scipy it loads) only where this source runs: a command's start-up
        # would pay for it otherwise.
        from datasketch import MinHashLSH

        self.exact: set[str] = set()
        self.lsh = MinHashLSH(threshold=threshold, num_perm=NUM_PERM)

    def check(self, text: str) -> str | None:
        """The reason `text` duplicates a kept record's first user turn, or None."""
        normal = normalise(text)
        if hashlib.sha1(normal.encode()).hexdigest() in self.exact:
            return "exact duplicate"
        return "near duplicate" if self.lsh.query(minhash(normal)) else None

    def check_and_add(self, key: str, text: str) -> str | None:
        """As `check`; a text that is no duplicate is remembered under `key`."""
        reason = self.check(text)
        if reason is None:
            normal = normalise(text)
            self.exact.add(hashlib.sha1(normal.encode()).hexdigest())
            self.lsh.insert(key, minhash(normal))
        return reason


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def minhash(normal: str):
    """The MinHash signature of a normalised text's word shingles."""
    from datasketch import MinHash  # loaded with the Deduplicator: see there

    words = normal.split()
    shingles = [" ".join(words[i:i + SHINGLE_WORDS]) for i in range(max(1, len(words) - SHINGLE_WORDS + 1))]
    signature = MinHash(num_perm=NUM_PERM, seed=1)
    for shingle in shingles:
        signature.update(shingle.encode())
    return signature


def turn_problem(text: str, stopped: bool) -> str | None:
    """Why a written user or system turn is dropped, or None."""
    if not stopped:
        return "truncated"
    if len(text.strip()) < 2:
        return "empty"
    if REFUSAL.match(text):
        return "refusal"
    return None


def template_problem(tokenizer, named: str) -> str | None:
    """Why the target of `tokenizer` (`named`: the option and its value, for the message) cannot
    write conversations: its tokenizer has no chat template. None when it has one."""
    if getattr(tokenizer, "chat_template", None):
        return None
    return (f"{named}: its tokenizer has no chat template, so it has no user turn to write: give the folder of a "
            f"chat (instruct) model, whose tokenizer_config.json or chat_template.jinja holds its template")


class Template:
    """Where the target's chat template opens a turn of a role, after the messages so far."""

    def __init__(self, tokenizer, name: str) -> None:
        problem = template_problem(tokenizer, f"--target {name}")
        if problem:
            raise DataError(problem)
        self.tokenizer = tokenizer
        self.opening([], "user")  # a template that drops the user's words is no use here
        try:
            self.has_system = bool(self.opening([], "system"))
        except (DataError, Exception):  # noqa: BLE001 - templates raise what they like for an unsupported role
            self.has_system = False

    def opening(self, messages: list[dict], role: str) -> str:
        """The rendered conversation up to where a `role` turn's text begins."""
        text = render(self.tokenizer, [*messages, {"role": role, "content": MARK}])
        if MARK not in text:
            raise DataError(f"the target's chat template does not render a {role} turn's text; it cannot write one")
        return text[:text.index(MARK)]

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


class Writer:
    """The target's conversations for one chunk of candidates, in candidate order. Each
    conversation goes its own way through its turns (a system turn, a user turn, its answer,
    the next user turn, ...): a turn is asked as soon as the one before it is written, on the
    sampling engine (written turns) or the greedy one (answers), so that both engines stay full
    while the chunk's conversations are at different turns."""

    def __init__(self, template: Template, sampler: LocalResponder, answerer: LocalResponder,
                 options: TargetPromptOptions, counts: dict[str, int]) -> None:
        self.template, self.sampler, self.answerer = template, sampler, answerer
        self.options, self.counts = options, counts
        self.asked: dict[tuple[str, int], tuple[Conversation, str]] = {}  # in flight: (engine, index) -> turn
        self.dedup: Deduplicator | None = None

    def candidates(self, first: int, count: int) -> list[Conversation]:
        out = []
        for index in range(first, first + count):
            rng = random.Random(turn_seed(self.options.seed, index, -1))
            turns = rng.randint(1, self.options.max_turns)
            system = self.template.has_system and rng.random() < self.options.system_share
            out.append(Conversation(index, turns, system))
        return out

    def write(self, conversations: list[Conversation], dedup: Deduplicator) -> list[Conversation]:
        """The conversations of a chunk that pass the filters, each written to its end. A first
        user turn that repeats a record kept before the chunk is dropped before it is answered;
        one that repeats an earlier candidate of the chunk after, in candidate order, so that
        which of two copies is kept depends on neither batching nor where a run was resumed."""
        self.dedup = dedup
        for c in conversations:
            self.ask(c, "system" if c.system else "user")
        while self.asked:
            for name, engine in self.engines_to_step():
                for key, text, stopped, _ in engine.poll(wait=False):
                    c, role = self.asked.pop((name, key))
                    if role == "assistant":
                        self.answered(c, text, stopped)
                    else:
                        self.written(c, role, text, stopped)
        kept = []
        for c in conversations:
            if c.alive and any(m["role"] == "assistant" for m in c.messages):
                reason = dedup.check_and_add(str(c.index), first_user(c))
                if reason is None:
                    kept.append(c)
                else:
                    self.drop(c, reason)
        return kept

    def engines_to_step(self) -> list[tuple[str, LocalResponder]]:
        """The engines to step once each now: those with at least half of their rows' worth of
        turns live or waiting (an engine stepped with few rows costs nearly a full step), or,
        where neither has, both that have any (the chunk's last turns)."""
        engines = [("sampler", self.sampler), ("answerer", self.answerer)]
        full = [(name, e) for name, e in engines if e.load >= max(1, e.capacity // 2)]
        return full or [(name, e) for name, e in engines if e.load]

    def ask(self, c: Conversation, role: str) -> None:
        """The target writes c's next `role` turn (sampled, one seed per record and turn)."""
        ids = self.template.ids(self.template.opening(c.messages, role))
        self.sampler.submit(c.index, "", ids, turn_seed(self.options.seed, c.index, 2 * c.users + (role == "user")))
        self.asked[("sampler", c.index)] = (c, role)

    def written(self, c: Conversation, role: str, text: str, stopped: bool) -> None:
        """A written turn back: kept, or what its filter says. A failed system turn leaves the
        conversation without one; a failed first user turn (or one that repeats a record kept
        before the chunk) drops the candidate; a failed later one ends the conversation before it."""
        reason = turn_problem(text, stopped)
        if reason is None and role == "system" and not self.fits(c, self.options.max_prompt_tokens,
                                                                 {"role": role, "content": text.strip()}):
            reason = "over-long"  # no room left after it for the user turn it opens
        first = role == "user" and c.users == 0
        if reason is None:
            c.messages.append({"role": role, "content": text.strip()})
            reason = self.dedup.check(first_user(c)) if first else None
            if reason is not None:
                self.drop(c, reason)
            else:
                self.ask(c, "user") if role == "system" else self.answer(c)
        elif first:
            self.drop(c, reason)
        else:
            self.count(f"{role} turns dropped: {reason}")
            if role == "system":
                self.ask(c, "user")
            else:
                c.turns = c.users

    def answer(self, c: Conversation) -> None:
        """c's last user turn answered at T = 0; a turn whose answer would pass max_length ends
        its conversation before it (the first turn: the candidate is dropped)."""
        if not self.fits(c, self.options.max_new_tokens):
            self.end_before_last_turn(c, "over-long")
            return
        ids = self.template.ids(render(self.template.tokenizer, c.messages, generation_prompt=True))
        self.answerer.submit(c.index, "", ids, 0)
        self.asked[("answerer", c.index)] = (c, "assistant")

    def answered(self, c: Conversation, text: str, stopped: bool) -> None:
        """An answer back: an empty one ends the conversation before its user turn; one cut at
        its budget is marked unfinished, as regeneration marks it. Then the next user turn, while
        the conversation wants one and has room for it."""
        if not text.strip():
            self.end_before_last_turn(c, "empty answer")
            return
        c.messages.append({"role": "assistant", "content": text, **({} if stopped else {"unfinished": True})})
        if c.users < c.turns and self.fits(c, self.options.max_prompt_tokens):
            self.ask(c, "user")

    def end_before_last_turn(self, c: Conversation, reason: str) -> None:
        c.messages.pop()
        c.turns = c.users
        if c.users:
            self.count(f"user turns cut: {reason}")
        else:
            self.drop(c, reason)

    def fits(self, c: Conversation, new_tokens: int, then: dict | None = None) -> bool:
        """The conversation so far (and the message `then` after it) plus `new_tokens` more stays
        within max_length."""
        messages = c.messages if then is None else [*c.messages, then]
        context = self.template.ids(render(self.template.tokenizer, messages))
        return len(context) + new_tokens <= self.options.max_length

    def drop(self, c: Conversation, reason: str) -> None:
        c.alive = False
        self.count(reason)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


def first_user(c: Conversation) -> str:
    return next(m["content"] for m in c.messages if m["role"] == "user")


def record_of(c: Conversation, options: TargetPromptOptions) -> dict:
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    turns = [{"from": roles[m["role"]], "value": m["content"], **({"unfinished": True} if m.get("unfinished") else {})}
             for m in c.messages]
    return {"id": f"{SOURCE}:{options.seed}:{c.index}", "source": SOURCE, "conversations": turns,
            "written_with": written_with(options)}


def resume_state(out: Path, options: TargetPromptOptions) -> tuple[int, list[dict]]:
    """(next candidate index, the records already written) of an earlier run into `out`; a
    torn last line (a killed run) is ignored here and cut when the file is next written. A file
    that holds anything but this source's records of this seed, or records written with other
    options that shape them (written_with; records without it are taken as they are), is refused,
    untouched."""
    seed, settings = options.seed, written_with(options)
    if not out.exists():
        return 0, []
    records, data = [], out.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    torn = data[len(whole):]
    if torn and not torn.startswith(json.dumps({"id": f"{SOURCE}:"})[:-2].encode()):
        number = whole.count(b"\n") + 1
        raise InputError(f"--out {out}:{number}: not a {SOURCE} record; the same command resumes only its own "
                         f"output: choose another --out")
    for number, line in enumerate(whole.splitlines(), 1):
        try:
            record = json.loads(line)
            kind, record_seed, index = record["id"].rsplit(":", 2)
        except (ValueError, KeyError, AttributeError, TypeError):
            record = kind = None
        written = record.get("written_with", {}) if isinstance(record, dict) else None
        if record is None or kind != SOURCE or record.get("source") != SOURCE or int(record_seed) != seed or \
                not isinstance(written, dict):
            raise InputError(f"--out {out}:{number}: not a {SOURCE} record of --seed {seed}; the same command "
                             f"resumes only its own output: choose another --out")
        other = other_option(written, settings)
        if other:
            raise InputError(f"--out {out}:{number}: written with --{other[0]} {other[1]}, where this command has "
                             f"{other[2]}; the same command resumes only its own output: give the same options or "
                             f"choose another --out")
        records.append(record)
    last = int(records[-1]["id"].rsplit(":", 1)[1]) if records else -1
    return last + 1, records


def other_option(written: dict, settings: dict) -> tuple[str, object, object] | None:
    """The first option whose value a record was written with (`written`) differs from this
    run's (`settings`): (flag, its value then, its value now); None when all agree. An option the
    record does not name (written before it was kept) is taken as it is."""
    return next(((flag, written[flag], value) for flag, value in settings.items()
                 if flag in written and written[flag] != value), None)


def append_records(out: Path, records: list[dict]) -> None:
    """Append whole lines, after cutting a torn last line of a killed run; flushed and fsynced."""
    if out.exists():
        size = out.stat().st_size
        with open(out, "rb") as handle:
            data = handle.read()
        whole = data.rfind(b"\n") + 1
        if whole != size:
            os.truncate(out, whole)
    with open(out, "a", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def write_target_prompts(target: str, out: str | Path, options: TargetPromptOptions, *, model=None, tokenizer=None,
                         log=print) -> dict:
    """Write `options.limit` conversations of the target's own to the JSONL file `out` (resumed
    when it holds an earlier run's); returns the counts. `model` / `tokenizer`: the target
    already loaded."""
    out = Path(out)
    problems = options.problems()
    problem = output_file_problem(out)
    if problem:
        problems.append(f"--out {out}: {problem}")
    if problems:
        raise InputError("; ".join(problems))
    lock = out.with_name(f".{out.name}.lock")
    with locks.discard_if_created(lock, out.parent), locks.hold(
            lock, f"--out {out}", "wait for that run to end, or choose another --out", log):
        return _write_owned(target, out, options, model, tokenizer, log)


def _write_owned(target: str, out: Path, options: TargetPromptOptions, model, tokenizer, log) -> dict:
    """write_target_prompts once its checks passed and it owns `out`: resumed, then written."""
    first, done = resume_state(out, options)
    target_dir = resolve_target_path(target, "--target")
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(target_dir)
    template = Template(tokenizer, str(target))
    counts = {"kept": len(done), "candidates": first}
    if len(done) >= options.limit:
        return counts
    if model is None:
        model = load_target_model(str(target_dir), resolve_device(options.device, "--device"))[0]
    writer = Writer(template, *responders(model, tokenizer, options), options, counts)
    dedup = Deduplicator(options.near_duplicate)
    for record in done:
        first_user = next(t["value"] for t in record["conversations"] if t["from"] == "human")
        dedup.check_and_add(record["id"].rsplit(":", 1)[1], first_user)
    return write_chunks(writer, dedup, out, first, log)


def responders(model, tokenizer, options: TargetPromptOptions) -> tuple[LocalResponder, LocalResponder]:
    """The sampling engine of the written turns and the greedy one of the answers."""
    device = next(model.parameters()).device
    sampled = Decoding(options.max_prompt_tokens, options.max_length, options.temperature, options.top_p,
                       rows=options.batch_size, graphs=options.graphs)
    greedy = Decoding(options.max_new_tokens, options.max_length, rows=options.batch_size, graphs=options.graphs)
    check_cache_memory(model, device, sampled, greedy)  # both engines hold their caches at once
    return LocalResponder(model, tokenizer, sampled), LocalResponder(model, tokenizer, greedy)


def chunk_size(full: int, need: int, kept: int, tried: int) -> int:
    """Candidates in the next chunk: a full one (four engine batches) until the candidates tried
    so far tell how many a kept record takes, then no more than the records still needed take,
    with a margin (KEEP_MARGIN, and MARGIN_CANDIDATES but no more than an engine batch, a quarter
    of `full`: on a CPU's few rows 16 spare candidates cost as much as the records): the last chunk
    no longer writes up to a whole chunk of conversations only to cut them off. Which candidates
    are kept does not depend on it."""
    if kept <= 0 or tried <= 0:
        return full
    margin = min(MARGIN_CANDIDATES, max(1, full // 4))
    return max(1, min(full, math.ceil(need * tried / kept * KEEP_MARGIN) + margin))


def write_chunks(writer: Writer, dedup: Deduplicator, out: Path, first: int, log) -> dict:
    """Candidates in chunks (chunk_size) until `limit` records are kept; a chunk's records are
    appended as it finishes (a stop loses at most the chunk in flight)."""
    options, counts = writer.options, writer.counts
    full, started, shown = 4 * options.batch_size, time.perf_counter(), time.perf_counter()
    give_up = options.max_candidates or max(1000, 20 * options.limit)  # a target that writes nothing usable
    while counts["kept"] < options.limit:
        if options.deadline is not None and time.time() >= options.deadline:
            counts["out_of_time"] = 1
            break
        if counts["candidates"] >= give_up:
            raise DataError(f"{SOURCE}: {counts['kept']} of {counts['candidates']:,} conversations kept; the target "
                            f"writes too few usable turns ({drop_summary(counts)}): try another --temperature / "
                            f"--top-p or a larger --max-prompt-tokens")
        need = options.limit - counts["kept"]
        chunk = chunk_size(full, need, counts["kept"], counts["candidates"])
        written = writer.write(writer.candidates(first, chunk), dedup)
        kept = written[:need]
        append_records(out, [record_of(c, options) for c in kept])
        counts["kept"] += len(kept)
        # Past the chunk, or (the limit reached inside it) past its last record written.
        counts["candidates"] = first = kept[-1].index + 1 if len(written) > need else first + chunk
        if time.perf_counter() - shown >= PROGRESS_EVERY_S or counts["kept"] >= options.limit:
            shown = time.perf_counter()
            log(f"{SOURCE}: {counts['kept']:,} of {options.limit:,} kept from {counts['candidates']:,} candidates "
                f"in {shown - started:.0f} s ({drop_summary(counts)})")
    return counts


def drop_summary(counts: dict[str, int]) -> str:
    dropped = {k: v for k, v in counts.items() if k not in ("kept", "candidates", "out_of_time") and v}
    return ", ".join(f"{v:,} {k}" for k, v in sorted(dropped.items())) or "none dropped"
