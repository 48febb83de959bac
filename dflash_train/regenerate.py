"""Regeneration: every assistant turn of a chat file replaced by the target's own response.

Owns `dflash-train data regenerate`: reading records with data.py's reader (bad records are
skipped and reported), rendering each assistant turn's context with the target's chat template,
batched generation with left padding (greedy by default), and a resumable JSONL output in the
input's format, written in fixed chunks that one process or several (`--workers`, each with its
own copy of the target) regenerate, or that serving engines answer (`--server`, serving.py).
Turn k of a conversation is generated from the user turns and the already regenerated turns
before it, the context the target would really have had. The paper calls this data the largest
lever on acceptance (REFERENCE.md 3).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from dflash_train.data import FORMATS, DataError, Record, Skip, iter_records, render
from dflash_train.serving import ServerError
from dflash_train.workers import WorkerError

DEFAULT_MAX_NEW_TOKENS = 2048
CHUNK_BATCHES = 4  # records per written chunk = CHUNK_BATCHES * batch_size
SHOWN_SKIPS = 20  # skipped records printed by the command (the summary counts them all)
# The canonical role names written back, per input format.
OUTPUT_ROLES = {
    "sharegpt": {"system": "system", "user": "human", "assistant": "gpt"},
    "openai": {"system": "system", "user": "user", "assistant": "assistant"},
}


def to_output(record: Record, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The record in its own format with `messages` as its turns; other fields are kept."""
    list_key, role_key, content_key = FORMATS[record.format]
    roles = OUTPUT_ROLES[record.format]
    out = {k: v for k, v in record.raw.items()}
    out[list_key] = [{role_key: roles[m["role"]], content_key: m["content"]} for m in messages]
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


def resume_point(out: Path, records: list[Record]) -> int:
    """How many records `out` already holds. A partial last line (a run killed mid-write) is
    cut off. Each finished line must belong to the record at its position (same first user
    turn), else the output comes from other input and DataError says so."""
    if not out.exists():
        return 0
    raw = out.read_bytes()
    keep = raw.rfind(b"\n") + 1
    if keep != len(raw):
        with open(out, "r+b") as handle:
            handle.truncate(keep)
    lines = raw[:keep].splitlines()
    if len(lines) > len(records):
        raise DataError(f"--out {out} holds {len(lines)} records but the input has {len(records)}; "
                        "it comes from other input: choose another --out")
    for number, (line, record) in enumerate(zip(lines, records), start=1):
        if _output_first_user(line, record) != _first_user(record.messages):
            raise DataError(f"{out}:{number} does not match input record {record.file}:{record.line}; "
                            "the output comes from other input: choose another --out or delete it")
    return len(lines)


class Generator:
    """The target and its tokenizer, answering batches of conversations."""

    def __init__(self, target, device: str = "auto", model=None, tokenizer=None):
        from dflash_train.target import load_target_model, resolve_device

        self.device = resolve_device(device, setting="--device")
        if model is None:
            model, loaded_tokenizer = load_target_model(str(target), self.device)
            tokenizer = tokenizer or loaded_tokenizer
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(target)
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"  # generation continues every row at the same column
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = model.to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_token_id = eos if eos is not None else self.tokenizer.eos_token_id

    def prompt_length(self, messages: list[dict[str, str]]) -> int:
        text = render(self.tokenizer, messages, generation_prompt=True)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def answer(self, prompts: list[list[dict[str, str]]], max_new_tokens: int, temperature: float,
               top_p: float, batch_size: int) -> tuple[list[str], int]:
        """Responses to each prompt (a message list ending with a user turn), generated in
        batches of similar length; also how many hit max_new_tokens without ending."""
        import torch

        texts = [render(self.tokenizer, p, generation_prompt=True) for p in prompts]
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
        answers: list[str] = [""] * len(texts)
        unfinished = 0
        eos_ids = set(self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id])
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            batch = self.tokenizer([texts[i] for i in rows], add_special_tokens=False, padding=True,
                                   return_tensors="pt").to(self.device)
            sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 \
                else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
            with torch.inference_mode():
                out_BT = self.model.generate(
                    **batch, max_new_tokens=max_new_tokens, pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=self.eos_token_id, **sampling,
                )
            new_BN = out_BT[:, batch["input_ids"].shape[1]:].tolist()
            for row, ids in zip(rows, new_BN):
                ends = [k for k, t in enumerate(ids) if t in eos_ids]
                if not ends:
                    unfinished += 1
                ids = ids[: ends[0]] if ends else ids
                answers[row] = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return answers, unfinished


def regenerate_chunk(generator: Generator, records: list[Record], settings: dict[str, Any],
                     stats: dict[str, int]) -> list[dict[str, Any]]:
    """Regenerate a chunk of records turn by turn: round r answers the r-th assistant turn of
    every conversation of the chunk in one batched pass."""
    outputs: list[list[dict[str, str]]] = [[] for _ in records]
    cursors = [0] * len(records)
    active = list(range(len(records)))
    while active:
        prompts, owners = [], []
        for k in active:
            messages = records[k].messages
            while cursors[k] < len(messages) and messages[cursors[k]]["role"] != "assistant":
                outputs[k].append(messages[cursors[k]])
                cursors[k] += 1
            if cursors[k] == len(messages):
                continue
            try:
                too_long = generator.prompt_length(outputs[k]) > settings["max_prompt_length"]
            except Exception:  # noqa: BLE001 - a template may refuse a conversation (jinja raise)
                stats["num_template_errors"] += 1
                continue  # cut here, like an over-long prompt
            if too_long:
                stats["num_cut"] += 1  # the rest of this conversation is dropped
                continue
            prompts.append(outputs[k])
            owners.append(k)
        answers, unfinished = generator.answer(
            prompts, settings["max_new_tokens"], settings["temperature"], settings["top_p"],
            settings["batch_size"],
        ) if prompts else ([], 0)
        stats["num_unfinished"] += unfinished
        stats["num_turns"] += len(answers)
        stats["num_empty"] += sum(not answer.strip() for answer in answers)
        for k, answer in zip(owners, answers):
            outputs[k].append({"role": "assistant", "content": answer})
            cursors[k] += 1
        active = owners
    return [to_output(record, messages) for record, messages in zip(records, outputs)]


CHUNK_STATS = ("num_turns", "num_unfinished", "num_empty", "num_cut", "num_template_errors")


def regenerate_span(generator: Generator, records: list[Record], position: int, settings: dict[str, Any]
                    ) -> tuple[str, dict[str, int]]:
    """The output lines (JSONL text) of the chunk of `records` that starts at record
    `position`, and its counts. Sampling is seeded by (seed, position), so a chunk comes out
    the same whichever process, and whichever run, makes it."""
    import torch

    torch.manual_seed(settings["seed"] * 1_000_003 + position)
    stats = dict.fromkeys(CHUNK_STATS, 0)
    lines = regenerate_chunk(generator, records, settings, stats)
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), stats


def _worker_setup(device, target: str, tokenizer, settings: dict[str, Any]):
    return Generator(target, device=str(device), tokenizer=tokenizer), settings


def _worker_span(state, item) -> tuple[str, dict[str, int]]:
    generator, settings = state
    position, records = item
    return regenerate_span(generator, records, position, settings)


def regenerate(paths, target, out, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0,
               top_p: float = 1.0, batch_size: int = 32, max_prompt_length: int = 3072,
               device: str = "auto", seed: int = 0, limit: int | None = None, log=print,
               model=None, tokenizer=None, workers: int = 1, servers: list[str] | None = None,
               server_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `out` (JSONL, one line per valid input record, in the record's own format) with
    every assistant turn replaced by the target's response. Resumes an existing `out`; with
    `limit`, stops after that many more records. With `workers` > 1, chunks are regenerated by
    that many processes (workers.parallel_map) and appended in order, so the output is the same.
    With `servers` (base URLs), the turns are sent to those serving engines instead
    (serving.ServerPool, which takes `server_options`: concurrency, model, timeout, retries) and
    only the target's tokenizer is loaded. Returns a summary with the skipped records."""
    from dflash_train.target import resolve_device
    from dflash_train.workers import parallel_map

    problems = [f"{name}={value}" for name, value in
                (("max_new_tokens", max_new_tokens), ("batch_size", batch_size), ("workers", workers)) if value < 1]
    if temperature < 0 or not 0 < top_p <= 1:
        problems.append(f"temperature={temperature}, top_p={top_p} (need temperature >= 0, 0 < top_p <= 1)")
    if workers > 1 and model is not None:
        problems.append("workers > 1 loads the target in each worker: pass a target path, not a model object")
    if servers and (workers != 1 or device != "auto" or model is not None):
        problems.append("--server sends every turn to the servers: --workers and --device (and a model "
                        "object) are for local generation only; leave them out")
    if problems:
        raise DataError("invalid regenerate settings: " + "; ".join(problems))
    out = Path(out)
    records: list[Record] = []
    skipped: list[Skip] = []
    for item in iter_records(paths):
        (skipped if isinstance(item, Skip) else records).append(item)
    done = resume_point(out, records)
    summary = {"num_records": len(records) + len(skipped), "num_skipped": len(skipped),
               "skipped": [s.as_dict() for s in skipped], "num_resumed": done,
               "num_written": 0, **dict.fromkeys(CHUNK_STATS, 0)}
    if done:
        log(f"data regenerate: resuming {out} after {done} of {len(records)} records")
    stop = len(records) if limit is None else min(len(records), done + limit)
    if done >= stop:
        return summary
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "batch_size": batch_size, "max_prompt_length": max_prompt_length, "seed": seed}
    # Chunks sit on fixed boundaries, so a resumed run batches records as a fresh run does.
    chunk = CHUNK_BATCHES * batch_size
    spans, position = [], done
    while position < stop:
        spans.append((position, min(stop, (position // chunk + 1) * chunk)))
        position = spans[-1][1]
    if servers:
        results = _server_results(servers, server_options or {}, target, tokenizer, records, spans, settings, log)
    elif workers == 1:
        generator = Generator(target, device=device, model=model, tokenizer=tokenizer)
        results = (regenerate_span(generator, records[a:b], a, settings) for a, b in spans)
    else:
        results = parallel_map(_worker_setup, (str(target), tokenizer, settings), _worker_span,
                               [(a, records[a:b]) for a, b in spans], num_workers=workers,
                               device=resolve_device(device, setting="--device"))
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for (a, b), (text, stats) in zip(spans, results):
        # Appended whole chunks in order: a run killed at any point leaves a prefix of the
        # output (at worst a partial last line, cut off on resume).
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        for key, value in stats.items():
            summary[key] += value
        summary["num_written"] += b - a
        log(f"data regenerate: {b}/{len(records)} records, {summary['num_turns']} turns, "
            f"{time.perf_counter() - started:.0f} s")
    return summary


# Regeneration through serving engines (serving.py): the same chunks and rounds, every turn
# of a round sent to the servers at once, several chunks in flight.
def _server_results(servers: list[str], options: dict[str, Any], target, tokenizer, records: list[Record],
                    spans: list[tuple[int, int]], settings: dict[str, Any], log):
    """regenerate_span's results of `spans`, in order, answered by `servers`. The servers are
    checked before the first chunk starts; the pool closes when the last chunk is done or one fails."""
    from dflash_train.serving import ServerGenerator, ServerPool, in_order

    with ServerPool(servers, **options) as pool:
        models = pool.check()
        log("data regenerate: " + ", ".join(f"{url} ({name})" for url, name in models.items())
            + f", concurrency {pool.concurrency}")
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(target)
        generator = ServerGenerator(pool, tokenizer, records, settings["seed"])
        # A chunk's round waits for its longest turn: enough chunks at once to keep every slot busy.
        chunk = CHUNK_BATCHES * settings["batch_size"]
        ahead = -(-pool.concurrency // chunk) + 1
        yield from in_order(lambda span: regenerate_span(generator, records[span[0]:span[1]], span[0], settings),
                            spans, ahead)


def run_regenerate(args) -> int:
    """`dflash-train data regenerate`."""
    try:
        summary = regenerate(args.data, args.target, args.out, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p, batch_size=args.batch_size,
                             max_prompt_length=args.max_prompt_length, device=args.device,
                             seed=args.seed, limit=args.limit, workers=args.workers, servers=args.server,
                             server_options={"concurrency": args.concurrency, "model": args.server_model,
                                             "timeout": args.timeout, "retries": args.retries})
    except (DataError, WorkerError) as err:
        print(f"error: {err}")
        return 1
    except ServerError as err:
        print(f"error: {err}")
        if Path(args.out).exists():
            print(f"the records already written to {args.out} stay; the same command resumes after them")
        return 1
    for skip in summary["skipped"][:SHOWN_SKIPS]:
        print(f"skipped {skip['file']}:{skip['line']}: {skip['reason']}")
    if len(summary["skipped"]) > SHOWN_SKIPS:
        print(f"... and {len(summary['skipped']) - SHOWN_SKIPS} more skipped records")
    print(json.dumps({k: v for k, v in summary.items() if k != "skipped"}))
    return 0
