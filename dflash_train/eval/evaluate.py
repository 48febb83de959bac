"""Served tau and speedup of a drafter on prompt sets: `dflash-train eval --prompts` and the
served check of a training run.

Owns decoding a prompt set on one decoding engine (decoder.Decoder): every turn of a record
speculatively, a later turn seeing our own earlier answers, with each turn's sampling seed taken
from the record's place in its set; in this process, or spread over worker processes, and with a
batch size above 1 a batch of records per `Decoder.speculate` call, turn by turn. With the
speedup on, every turn is also decoded target-only (the losslessness check), and the speedup
over target-only decoding is timed at batch size 1 in one uncontended process on the first turns
of each set (on a GPU, again without graphs: what the graphs buy). Also the checks of the model
folders made before anything is loaded, and the evaluator the trainer calls every `eval.every`
steps. How prompts are formed is prompts.py's; the JSON document, summary and histogram are
results.py's. The in-training evaluator and `dflash-train eval` run the same `run_prompt_set`, so
an exported drafter evaluated here gives the acceptance lengths training reported for the same
prompts (exactly, in the same dtype; see docs/EVALUATION.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from dflash_train.core.devices import resolve_device, resolve_dtype
from dflash_train.core.drafter import DFlashDrafter
from dflash_train.core.errors import InputError, problems_of
from dflash_train.core.export import drafter_config, load_drafter
from dflash_train.core.target import load_target_model, resolve_target_path
from dflash_train.data.workers import parallel_map
from dflash_train.engine.acceptance import turn_mean_tau
from dflash_train.engine.decoder import Decoder, Generation
from dflash_train.engine.proposer import DFlashProposer
from dflash_train.engine.sampling import stop_token_ids
from dflash_train.eval.prompts import PromptRecord, load_prompts, prompt_ids, set_label
from dflash_train.eval.results import SetResult, TurnStats, combine, sets_speedup

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_SPEEDUP_TURNS = 10  # per set; each is decoded both ways once more when workers or batch size > 1
DEFAULT_EAGER_TURNS = 2  # per set, on a GPU: the timed turns again without graphs (what the graphs buy)


@dataclass(frozen=True)
class Decoding:
    """How every turn is decoded: at most `max_new_tokens` new tokens, at `temperature` (0:
    greedy), each turn's sampling seed drawn from `seed` (record_turn_seed)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class Timing:
    """What an evaluation times. With `speedup`, every turn is also decoded target-only (the
    losslessness check) and the first `speedup_turns` turns of each set are the timed ones of
    the speedup; on a GPU the first `eager_turns` of those are timed again without graphs."""

    speedup: bool = True
    speedup_turns: int = DEFAULT_SPEEDUP_TURNS
    eager_turns: int = DEFAULT_EAGER_TURNS

    @property
    def timed(self) -> int:
        """Timed turns per set: none without the speedup."""
        return self.speedup_turns if self.speedup else 0


@dataclass(frozen=True)
class Placement:
    """Where and how the records are decoded: on `device` in `dtype` (`auto`: resolve_device,
    resolve_dtype), by `workers` processes, `batch_size` records of a set per batch, with CUDA
    graphs or eagerly."""

    device: str = "auto"
    dtype: str = "auto"
    workers: int = 1
    batch_size: int = 1
    graphs: bool = True

    @property
    def spread(self) -> bool:
        """Whether the main pass runs over workers or batches (the speedup is then timed after it)."""
        return self.workers > 1 or self.batch_size > 1


def record_turn_seed(seed: int, index: int, turn: int) -> int:
    """The sampling seed of a turn: from the record's place in its set, not from where or with
    which other records it is decoded."""
    return seed * 1_000_003 + index * 101 + turn


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length when it is a
    prefix of the other), None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _add_turn(entry: dict, stats: list[TurnStats], messages: list[dict[str, str]], tokenizer,
              gen: Generation, base: Generation | None, prompt_tokens: int = 0) -> None:
    """Book one decoded turn of a record: `gen`'s acceptance lengths, output and timing, with
    `base` (the target-only decoding, if run) its timing and whether the outputs differ; our
    answer becomes the next assistant message, which the record's next turn sees."""
    entry["acceptance_lengths"].append(gen.acceptance_lengths)
    entry["output_ids"].append(gen.output_ids)
    stat = TurnStats(gen.seconds, len(gen.output_ids), len(gen.acceptance_lengths), record_id=entry["id"],
                     turn=len(stats), prompt_tokens=prompt_tokens, spec_first_token_s=gen.first_token_seconds,
                     spec_first_cycle_s=gen.first_cycle_seconds)
    if base is not None:
        stat.baseline_seconds, stat.baseline_tokens = base.seconds, len(base.output_ids)
        stat.first_difference = first_difference(gen.output_ids, base.output_ids)
    stats.append(stat)
    answer = gen.output_ids[:-1] if gen.stopped else gen.output_ids
    # the text as generated (regenerate decodes it the same way): transformers 4.x would strip
    # spaces before punctuation under some tokenizers' clean-up setting, and 5.x warns of it
    text = tokenizer.decode(answer, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    messages.append({"role": "assistant", "content": text})


def decode_record(engine: Decoder, tokenizer, record: PromptRecord, index: int, *, name: str,
                  max_new_tokens: int, seed: int, stop_ids: list[int], baseline: bool) -> tuple[dict, list[TurnStats]]:
    """Speculative decoding of every turn of one record on `engine` (a later turn sees our
    earlier answers); with `baseline`, each turn is also decoded target-only with the same
    prompt, budget, stop tokens and seed, and a turn whose two outputs differ is marked
    mismatched. `index` (the record's place in its set) picks the sampling seeds, so a record
    decodes the same wherever it runs."""
    return decode_records(engine, tokenizer, [(index, record)], name=name, max_new_tokens=max_new_tokens, seed=seed,
                          stop_ids=stop_ids, baseline=baseline)[0]


def decode_records(engine: Decoder, tokenizer, records: list[tuple[int, PromptRecord]], *, name: str,
                   max_new_tokens: int, seed: int, stop_ids: list[int],
                   baseline: bool) -> list[tuple[dict, list[TurnStats]]]:
    """decode_record for several (index, record) pairs as one batch: round t decodes turn t of
    every record that has it in one `engine.speculate` call (and, with `baseline`, one
    `engine.generate` call), so a record's second turn still sees its own first answer. Same
    entries and mismatches as decode_record on each record; a turn's seconds are its batch's
    (comparable with batch-1 timings only at one record)."""
    messages: list[list[dict[str, str]]] = [r.first_messages()[:-1] for _, r in records]  # the system message
    entries = [{"id": r.id, "set": name, "acceptance_lengths": [], "output_ids": []} for _, r in records]
    stats: list[list[TurnStats]] = [[] for _ in records]
    for turn in range(max(len(r.turns) for _, r in records)):
        rows = [k for k, (_, r) in enumerate(records) if turn < len(r.turns)]
        for k in rows:
            messages[k].append({"role": "user", "content": records[k][1].turns[turn]})
        prompts = [prompt_ids(tokenizer, messages[k]) for k in rows]
        seeds = [record_turn_seed(seed, records[k][0], turn) for k in rows]
        gens = engine.speculate(prompts, max_new_tokens, stop_ids=stop_ids, seed=seeds)
        bases = engine.generate(prompts, max_new_tokens, stop_ids=stop_ids, seed=seeds) if baseline \
            else [None] * len(rows)
        for k, gen, base, prompt in zip(rows, gens, bases, prompts):
            _add_turn(entries[k], stats[k], messages[k], tokenizer, gen, base, len(prompt))
    for entry in entries:
        entry["tau"] = turn_mean_tau(entry["acceptance_lengths"])
    return list(zip(entries, stats))


def run_prompt_set(engine: Decoder, tokenizer, records: list[PromptRecord], *, name: str = "prompts",
                   max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, seed: int = 0, measure_speedup: bool = False,
                   speedup_turns: int | None = None, log=None) -> SetResult:
    """Speculative decoding of every turn of every record on `engine` (at its temperature),
    stopped by the stop ids of the tokenizer and the engine's target. With `measure_speedup`,
    every turn is also decoded target-only (`mismatched_turns`), and the first `speedup_turns`
    turns (None: all) are the timed ones of the speedup."""
    stop_ids = stop_token_ids(tokenizer, getattr(engine.model, "generation_config", None))
    result = SetResult(name, int(engine.proposer.block_size))
    for i, record in enumerate(records):
        entry, turns = decode_record(engine, tokenizer, record, i, name=name, max_new_tokens=max_new_tokens,
                                     seed=seed, stop_ids=stop_ids, baseline=measure_speedup)
        result.add_record(entry, turns)
        result.add_timings(turns, speedup_turns)
        if log is not None:
            log(f"[{name}] {i + 1}/{len(records)} {record.id}: tau {entry['tau']:.2f}")
    return result


def warm_up(engine: Decoder, tokenizer, stop_ids, capacity: int) -> None:
    """Capture every batch-1 graph up to `capacity` positions, then one short run of each
    decoder, so the timed prompts pay no one-off costs (the capture time is reported)."""
    engine.capture(rows=1, capacity=capacity)
    ids = prompt_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    engine.generate([ids], 4, stop_ids=stop_ids)
    engine.speculate([ids], 4, stop_ids=stop_ids)


# --------------------------------------------------------------------------- loading and the CLI


def model_problems(target: str, drafter: str) -> list[str]:
    """What is wrong with --target (a model folder) and --drafter (a DFlash drafter folder for
    that target), read from their config files alone, before anything is loaded."""
    problems = problems_of(lambda: resolve_target_path(target, "--target"))
    config = None if problems else AutoConfig.from_pretrained(resolve_target_path(target, "--target"))
    return problems + problems_of(lambda: drafter_config(drafter, "--drafter", config))


def option_problems(limit: int | None, decoding: Decoding, timing: Timing, placement: Placement) -> list[str]:
    """The options of `dflash-train eval --prompts` out of their range, in the words of its flags."""
    checks = (("--workers", placement.workers, placement.workers >= 1, ">= 1"),
              ("--batch-size", placement.batch_size, placement.batch_size >= 1, ">= 1"),
              ("--speedup-turns", timing.speedup_turns, timing.speedup_turns >= 0, ">= 0 (0 times no turn)"),
              ("--eager-turns", timing.eager_turns, timing.eager_turns >= 0, ">= 0"),
              ("--max-new-tokens", decoding.max_new_tokens, decoding.max_new_tokens >= 1, ">= 1"),
              ("--limit", limit, limit is None or limit >= 1, ">= 1 (leave it out for every prompt)"))
    return [f"{flag} must be {need}, got {value}" for flag, value, ok, need in checks if not ok]


def checked_inputs(target: str, drafter: str, device: str, dtype: str, problems: list[str]):
    """(device, dtype) of an evaluation, after `problems` (the caller's own option checks), the
    model folders (`model_problems`) and the device are all checked, from config files alone,
    before anything is loaded: one InputError naming every problem."""
    problems = problems + model_problems(target, drafter) + problems_of(lambda: resolve_device(device, setting="--device"))
    if problems:
        raise InputError("; ".join(problems))
    dev = resolve_device(device, setting="--device")
    return dev, resolve_dtype(dtype, dev)


def load_models(target: str, drafter: str, device: torch.device, dtype: torch.dtype, temperature: float = 0.0,
                graphs: bool = True):
    """(decoding engine of the target and a DFlashProposer of the drafter folder, tokenizer,
    stop ids) on `device`; the engine (decoder.Decoder) keeps its graphs for the process."""
    model, tokenizer = load_target_model(target, device, dtype)
    draft = load_drafter(drafter, "--drafter", dtype=dtype, device=device).eval()
    proposer = DFlashProposer.for_target(draft, model, graphs=graphs)
    engine = Decoder(model, proposer, temperature=temperature, graphs=graphs)
    return engine, tokenizer, stop_token_ids(tokenizer, model.generation_config)


# --------------------------------------------------------------------------- the passes of an evaluation


def _worker_setup(device, target: str, drafter: str, dtype: torch.dtype, decoding: Decoding, baseline: bool):
    return load_models(target, drafter, device, dtype, decoding.temperature), (decoding, baseline)


def _worker_decode(state, item) -> tuple[tuple[int, list[int]], list[tuple[dict, list[TurnStats]]]]:
    """A chunk of (index, record) pairs of one set: one record at a time (batch size 1, the
    chunk holds one record), or all of them as one batch."""
    (engine, tokenizer, stop_ids), (decoding, baseline) = state
    name, chunk, batched = item
    options = dict(name=name, max_new_tokens=decoding.max_new_tokens, seed=decoding.seed, stop_ids=stop_ids,
                   baseline=baseline)
    if batched:
        decoded = decode_records(engine, tokenizer, chunk, **options)
    else:
        decoded = [decode_record(engine, tokenizer, record, index, **options) for index, record in chunk]
    return (int(engine.proposer.block_size), stop_ids), decoded


def decode_here(loaded, sets: list[tuple[str, list[PromptRecord]]], decoding: Decoding, timing: Timing,
                log) -> list[SetResult]:
    """The main pass in this process at batch size 1, on `loaded` (load_models): every set
    through `run_prompt_set`, its timed turns timed as they are decoded, on an engine warmed up
    first."""
    engine, tokenizer, stop_ids = loaded
    if timing.speedup:
        warm_up(engine, tokenizer, stop_ids, warm_capacity(tokenizer, sets, decoding.max_new_tokens,
                                                            engine.proposer.block_size))
    return [run_prompt_set(engine, tokenizer, records, name=name, max_new_tokens=decoding.max_new_tokens,
                           seed=decoding.seed, measure_speedup=timing.speedup, speedup_turns=timing.timed, log=log)
            for name, records in sets]


def decode_spread(sets: list[tuple[str, list[PromptRecord]]], placement: Placement, setup: tuple,
                  device: torch.device, log):
    """The main pass over workers or batches: chunks of `placement.batch_size` records of one
    set (one record at batch size 1) decoded by `placement.workers` processes
    (workers.parallel_map; a record's turns stay together), or here when there is one, each
    process loading the models with `setup` (_worker_setup's arguments). Returns the sets'
    results in prompt order, the stop ids, and the models when they were loaded here."""
    size = placement.batch_size
    chunks = [(k, name, list(enumerate(records))[a : a + size])
              for k, (name, records) in enumerate(sets) for a in range(0, len(records), size)]
    items = [(name, chunk, size > 1) for _, name, chunk in chunks]
    loaded = None
    if placement.workers > 1:
        mapped = parallel_map(_worker_setup, setup, _worker_decode, items, num_workers=placement.workers,
                              device=device)
    else:
        state = _worker_setup(device, *setup)
        loaded = state[0]
        mapped = (_worker_decode(state, item) for item in items)
    found: dict[int, SetResult] = {}
    stop_ids = None
    for (k, name, chunk), ((block_size, stop_ids), decoded) in zip(chunks, mapped):
        for (i, record), (entry, turns) in zip(chunk, decoded):
            found.setdefault(k, SetResult(name, block_size)).add_record(entry, turns)
            log(f"[{name}] {i + 1}/{len(sets[k][1])} {record.id}: tau {entry['tau']:.2f}")
    return [found[k] for k in range(len(sets))], stop_ids, loaded


def time_first_turns(engine: Decoder, tokenizer, stop_ids, sets: list[tuple[str, list[PromptRecord]]],
                     results: list[SetResult], num_turns: int, decoding: Decoding) -> None:
    """The speedup measurement: the first `num_turns` turns of each set decoded both ways and
    timed in this process on `engine`, with nothing else decoding (run after the workers have
    exited); the timings go into `results`."""
    for (name, records), result in zip(sets, results):
        for index, record in enumerate(records):
            needed = num_turns - result.timed_turns
            if needed <= 0:
                break
            # A turn depends only on the turns before it, so later ones can be left out.
            part = PromptRecord(record.id, record.turns[:needed], record.system)
            _, turns = decode_record(engine, tokenizer, part, index, name=name, max_new_tokens=decoding.max_new_tokens,
                                     seed=decoding.seed, stop_ids=stop_ids, baseline=True)
            result.add_timings(turns, num_turns)


def time_after_spread(loaded, sets: list[tuple[str, list[PromptRecord]]], results: list[SetResult],
                      decoding: Decoding, num_turns: int) -> None:
    """The speedup of a spread main pass: the engine of `loaded` warmed up, then the first
    `num_turns` turns of each set timed (time_first_turns)."""
    engine, tokenizer, stop_ids = loaded
    warm_up(engine, tokenizer, stop_ids, warm_capacity(tokenizer, sets, decoding.max_new_tokens,
                                                        engine.proposer.block_size))
    time_first_turns(engine, tokenizer, stop_ids, sets, results, num_turns, decoding)


def eager_engine(engine: Decoder) -> Decoder:
    """The same target and drafter with every step run eagerly (no graphs): what the graphs buy."""
    proposer = engine.proposer
    eager = DFlashProposer(proposer.drafter, proposer.embed_weight, proposer.lm_head_weight, graphs=False)
    return Decoder(engine.model, eager, temperature=engine.temperature, top_p=engine.top_p, graphs=False)


def time_eagerly(loaded, sets: list[tuple[str, list[PromptRecord]]], results: list[SetResult], decoding: Decoding,
                 timing: Timing) -> list[SetResult] | None:
    """The first `timing.eager_turns` timed turns of each set timed again without graphs, when
    the engine of `loaded` runs graphs (on a GPU) and the speedup times turns; else None."""
    if not (timing.timed and timing.eager_turns and loaded is not None and loaded[0].target.graphs.enabled):
        return None
    engine, tokenizer, stop_ids = loaded
    eager = [SetResult(name, r.block_size) for (name, _), r in zip(sets, results)]
    time_first_turns(eager_engine(engine), tokenizer, stop_ids, sets, eager, min(timing.eager_turns, timing.timed),
                     decoding)
    return eager


def warm_capacity(tokenizer, sets: list[tuple[str, list[PromptRecord]]], max_new_tokens: int, block_size: int) -> int:
    """Positions the timed turns can need, so that none of them grows the engine's caches (a
    growth drops every graph, and rebuilding them falls inside a timed turn): over the records,
    the longest conversation rendered with every user turn and empty answers, plus each turn's
    budget with a quarter more (an answer's text can tokenize to more ids than it was decoded
    from), and two blocks."""
    def need(record: PromptRecord) -> int:
        messages = record.first_messages()[:-1]
        for turn in record.turns:
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
        rendered = len(prompt_ids(tokenizer, messages[:-1]))
        return rendered + len(record.turns) * (max_new_tokens + max_new_tokens // 4 + 1)

    return max(need(r) for _, records in sets for r in records) + 2 * block_size + 2


def evaluate(target: str, drafter: str, prompts: list[str], *, limit: int | None = None,
             decoding: Decoding = Decoding(), timing: Timing = Timing(), placement: Placement = Placement(),
             log=print) -> dict:
    """Load the target and a published-format drafter folder, run every prompt set (the first
    `limit` records of each), return the JSON document of `combine`. With `placement.workers`
    > 1 the records are decoded by that many processes (workers.parallel_map; a record's turns
    stay together); with `placement.batch_size` > 1, each process decodes that many records of a
    set per batch (decode_records). In both cases the speedup is then measured in this process
    alone, at batch size 1, after the main pass; the results are those of workers = batch size
    = 1 except timings. Both decoders of the speedup run on the engine with its graphs captured
    first; on a GPU the first `timing.eager_turns` turns of each set are timed again without
    graphs (`speedup_eager`)."""
    problems = option_problems(limit, decoding, timing, placement)
    dev, torch_dtype = checked_inputs(target, drafter, placement.device, placement.dtype, problems)
    sets = [(set_label(p), load_prompts(p, limit)) for p in prompts]  # bad names fail before loading
    timed = timing.timed
    started = time.perf_counter()
    if placement.spread:
        setup = (target, drafter, torch_dtype, decoding, timing.speedup)  # _worker_setup: engines with graphs
        results, stop_ids, loaded = decode_spread(sets, placement, setup, dev, log)
    else:
        loaded = load_models(target, drafter, dev, torch_dtype, decoding.temperature, placement.graphs)
        stop_ids = loaded[2]
        results = decode_here(loaded, sets, decoding, timing, log)
    decode_s = time.perf_counter() - started
    if placement.spread and timed:
        loaded = loaded or load_models(target, drafter, dev, torch_dtype, decoding.temperature, placement.graphs)
        stop_ids = loaded[2]
        time_after_spread(loaded, sets, results, decoding, timed)
    speedup_s = time.perf_counter() - started - decode_s
    eager = time_eagerly(loaded, sets, results, decoding, timing)
    eager_s = time.perf_counter() - started - decode_s - speedup_s
    settings = {"target": target, "drafter": str(drafter), "prompts": list(prompts), "limit": limit,
                "max_new_tokens": decoding.max_new_tokens, "temperature": decoding.temperature, "seed": decoding.seed,
                "device": str(dev), "dtype": str(torch_dtype).removeprefix("torch."), "stop_ids": stop_ids,
                "workers": placement.workers, "batch_size": placement.batch_size, "speedup_turns": timed,
                "graphs": bool(loaded is not None and loaded[0].target.graphs.enabled),
                "eager_turns": min(timing.eager_turns, timed) if eager is not None else 0}
    doc = combine(results, settings)
    if eager is not None:
        doc["speedup_eager"] = sets_speedup(eager)
    doc["wall_s"] = {"decode": decode_s, "speedup": speedup_s, "eager": eager_s,
                     "capture": loaded[0].capture_seconds if loaded is not None else 0.0}
    return doc


# --------------------------------------------------------------------------- during training


class TrainingEvaluator:
    """tau of the drafter being trained on a small held-out prompt set (config section `eval`).
    Loads its own full copy of the target once (the trainer's target drops the layers after the
    last tap), in the trainer's target dtype, on the trainer's device. The drafter is evaluated
    as it is served: a replica in the target's dtype (bf16 on a GPU, as exported), into which
    each evaluation copies the current weights, on one decoding engine kept for the run (its
    graphs captured at the first evaluation stay valid: the replica's storage never moves)."""

    def __init__(self, eval_cfg, target_cfg, device: torch.device) -> None:
        self.cfg = eval_cfg
        self.records = load_prompts(eval_cfg.prompts, eval_cfg.limit)
        self.dtype = resolve_dtype(target_cfg.dtype, device)
        self.device = device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.model, self.tokenizer = load_target_model(target_cfg.path, device, self.dtype)
        self.replica = None
        self.engine: Decoder | None = None

    def __call__(self, drafter, autocast=None) -> dict:
        """Metrics of the current weights (no noise: the proposer never adds any; no gradients:
        inference mode). `autocast` is not needed: the replica runs in the target's dtype."""
        drafter = getattr(drafter, "module", drafter)  # DDP
        if self.replica is None:
            self.replica = DFlashDrafter(drafter.config).to(self.device, self.dtype).eval().requires_grad_(False)
            proposer = DFlashProposer.for_target(self.replica, self.model)
            self.engine = Decoder(self.model, proposer)
        with torch.no_grad():
            for name, value in drafter.state_dict().items():
                self.replica.state_dict()[name].copy_(value)
        result = run_prompt_set(self.engine, self.tokenizer, self.records, name=set_label(self.cfg.prompts),
                                max_new_tokens=self.cfg.max_new_tokens)
        summary = result.summary()
        return {
            "eval_tau": summary["tau"],
            "eval_tau_cycles": summary["tau_cycles"],
            "eval_histogram": summary["histogram"],
            "eval_acceptance_lengths": [p["acceptance_lengths"] for p in result.prompts],
        }
