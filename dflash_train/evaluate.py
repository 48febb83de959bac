"""tau and speedup of a drafter on prompt sets: `dflash-train eval` and the in-training check.

Owns the prompt sets (MT-Bench, HumanEval, GSM8K from the installed data packages, or a JSONL
file of {"turns": [...]} records), forming prompts as the DFlash paper's benchmark does (the
target's chat template with the generation prompt, no system prompt unless a prompts file
gives one; GSM8K and HumanEval
wrapped in their instruction; a second turn sees our own first answer), running a set through
`specdec.speculative_generate` (in this process, or spread over worker processes; with a batch
size above 1, a batch of records per `specdec.speculative_generate_batch` call, turn by turn),
the speedup over target-only decoding measured at batch size 1 in one uncontended process on
the first turns of each set,
the outputs (JSON, markdown summary, PNG histogram), and the evaluator the trainer
calls every `eval.every` steps. The in-training evaluator and `dflash-train eval` run the same
`run_prompt_set`, so an exported drafter evaluated here gives the acceptance lengths training
reported for the same prompts (exactly, in the same dtype; see docs/EVALUATION.md).
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_train import specdec
from dflash_train.config import PROMPT_SETS
from dflash_train.data import LOOP_MIN_TOKENS, LOOP_REPEATS, loop_period
from dflash_train.errors import InputError, output_file_problem, problems_of
from dflash_train.target import load_target_model, resolve_device, resolve_dtype, resolve_target_path
from dflash_train.workers import parallel_map

GSM8K_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:\n"
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_SPEEDUP_TURNS = 10  # per set; each is decoded both ways once more when workers or batch size > 1
DEFAULT_EAGER_TURNS = 2  # per set, on a GPU: the timed turns again without graphs (what the graphs buy)


# --------------------------------------------------------------------------- prompt sets


@dataclass
class PromptRecord:
    id: str
    turns: list[str]
    """User turns, already wrapped in the set's instruction."""
    system: str | None = None
    """A system message before the first turn (a prompts file's "system"); None: the template's
    default."""

    def first_messages(self) -> list[dict[str, str]]:
        """The conversation up to the first turn: the system message (if any), the first turn."""
        opening = [{"role": "system", "content": self.system}] if self.system is not None else []
        return opening + [{"role": "user", "content": self.turns[0]}]


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        try:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise InputError(f"{path}:{number}: not valid JSON ({err.msg})") from err
        except UnicodeDecodeError as err:
            raise InputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start} of a line); give a JSONL "
                             f"file of {{\"turns\": [...]}} records") from err
    return rows


def gsm8k_turn(question: str) -> str:
    return question + GSM8K_INSTRUCTION


def humaneval_turn(prompt: str) -> str:
    return f"{HUMANEVAL_INSTRUCTION}```python\n{prompt}\n```"


def load_prompts(name_or_file: str, limit: int | None = None) -> list[PromptRecord]:
    """The records of a prompt set (`mt-bench`, `humaneval`, `gsm8k`) or of a JSONL file of
    {"turns": [str, ...]} records (optional "id", and "system": a system message); the first
    `limit` of them."""
    from dflash_train import assets

    if name_or_file == "mt-bench":
        rows = _read_jsonl(assets.mtbench_jsonl())
        records = [PromptRecord(str(r["question_id"]), list(r["turns"])) for r in rows]
    elif name_or_file == "humaneval":
        rows = _read_jsonl(assets.humaneval_jsonl_gz())
        records = [PromptRecord(r["task_id"], [humaneval_turn(r["prompt"])]) for r in rows]
    elif name_or_file == "gsm8k":
        rows = _read_jsonl(assets.gsm8k_jsonl())
        records = [PromptRecord(f"gsm8k/{i}", [gsm8k_turn(r["question"])]) for i, r in enumerate(rows)]
    else:
        path = Path(name_or_file)
        if not path.is_file():
            raise InputError(f"prompts {name_or_file!r}: not one of {', '.join(PROMPT_SETS)} and not a file")
        records = []
        for i, r in enumerate(_read_jsonl(path)):
            turns = r.get("turns") if isinstance(r, dict) else None
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                raise InputError(f"{path}: record {i + 1} needs \"turns\": a non-empty list of strings")
            system = r.get("system")
            if system is not None and not isinstance(system, str):
                raise InputError(f"{path}: record {i + 1}: \"system\" must be a string (or left out)")
            records.append(PromptRecord(str(r.get("id", i)), turns, system))
    if limit is not None:
        records = records[:limit]
    if not records:
        what = "--limit leaves none" if limit is not None else "an empty file?"
        raise InputError(f"prompts {name_or_file!r}: no records ({what})")
    return records


def set_label(name_or_file: str) -> str:
    """How a set is named in results: the set name, or the file's stem."""
    return name_or_file if name_or_file in PROMPT_SETS else Path(name_or_file).stem


def prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation ending with a user turn, rendered by the target's chat
    template with the generation prompt (the template adds any special tokens it wants)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- loops

def loop_fields(turns: list[list[int]], outputs: list[list[int]]) -> dict:
    """How many turns end in a loop (loop_period of their output ids) and tau over cycles on
    those turns and on the others (None where there is no such turn)."""
    looped = [loop_period(o) is not None for o in outputs]
    loop = [n for t, hit in zip(turns, looped) if hit for n in t]
    other = [n for t, hit in zip(turns, looped) if not hit for n in t]
    return {"loop_turns": sum(looped),
            "loop_tau_cycles": specdec.mean_acceptance(loop) if loop else None,
            "other_tau_cycles": specdec.mean_acceptance(other) if other else None}


# --------------------------------------------------------------------------- running a set


@dataclass
class TurnStats:
    """One turn's decoding: the speculative call, and the target-only call when it was made."""

    spec_seconds: float
    spec_tokens: int
    spec_cycles: int = 0
    baseline_seconds: float | None = None
    baseline_tokens: int = 0
    first_difference: int | None = None
    """Where the speculative output first differs from the target-only one (a token index; the
    shorter output's length when one is a prefix of the other); None when they are equal."""
    record_id: str = ""
    turn: int = 0
    prompt_tokens: int = 0
    spec_first_token_s: float | None = None
    spec_first_cycle_s: float | None = None

    @property
    def mismatched(self) -> bool:
        return self.first_difference is not None

    def timing(self) -> dict:
        """The turn in the set summary's `timed` list (timed turns only)."""
        return {"id": self.record_id, "turn": self.turn, "prompt_tokens": self.prompt_tokens,
                "new_tokens": self.spec_tokens, "cycles": self.spec_cycles, "spec_s": self.spec_seconds,
                "spec_first_token_s": self.spec_first_token_s, "spec_first_cycle_s": self.spec_first_cycle_s,
                "baseline_s": self.baseline_seconds, "baseline_tokens": self.baseline_tokens}


@dataclass
class SetResult:
    name: str
    block_size: int
    prompts: list[dict] = field(default_factory=list)
    new_tokens: int = 0
    """Speculative output tokens over every turn."""
    spec_seconds: float = 0.0
    spec_tokens: int = 0
    spec_cycles: int = 0
    baseline_seconds: float = 0.0
    baseline_tokens: int = 0
    timed_turns: int = 0
    """Turns whose two decodings the speedup uses (the first ones of the set); the
    seconds and tokens above are theirs."""
    timed: list[dict] = field(default_factory=list)
    """Those turns one by one (TurnStats.timing): what a turn's fixed cost and a cycle's cost
    are can be fitted from them."""
    mismatches: list[dict] = field(default_factory=list)
    """The mismatched turns: record id, turn, the first differing token, the tokens decoded."""
    checked: bool = False
    """Whether every turn was also decoded target-only (the losslessness check)."""

    @property
    def mismatched_turns(self) -> int:
        return len(self.mismatches)

    def turns(self) -> list[list[int]]:
        return [t for p in self.prompts for t in p["acceptance_lengths"]]

    def add_record(self, entry: dict, turns: list[TurnStats]) -> None:
        """A decoded record: its entry (acceptance lengths, output ids) and the mismatches."""
        self.prompts.append(entry)
        self.new_tokens += sum(t.spec_tokens for t in turns)
        self.mismatches += [{"id": t.record_id, "turn": t.turn, "first_difference": t.first_difference,
                             "new_tokens": t.spec_tokens} for t in turns if t.mismatched]
        self.checked = self.checked or any(t.baseline_seconds is not None for t in turns)

    def add_timings(self, turns: list[TurnStats], limit: int | None) -> None:
        """Count the timings of `turns` (each decoded both ways) until `limit` turns are timed."""
        for t in turns:
            if t.baseline_seconds is None or (limit is not None and self.timed_turns >= limit):
                return
            self.spec_seconds += t.spec_seconds
            self.spec_tokens += t.spec_tokens
            self.spec_cycles += t.spec_cycles
            self.baseline_seconds += t.baseline_seconds
            self.baseline_tokens += t.baseline_tokens
            self.timed_turns += 1
            self.timed.append(t.timing())

    def summary(self) -> dict:
        lengths = [n for t in self.turns() for n in t]
        return {
            "tau": specdec.turn_mean_tau(self.turns()),
            "tau_cycles": specdec.mean_acceptance(lengths),
            "num_prompts": len(self.prompts),
            "num_turns": len(self.turns()),
            "num_cycles": len(lengths),
            "new_tokens": self.new_tokens,
            "histogram": specdec.acceptance_histogram(lengths, self.block_size),
            **sets_speedup([self]),
            "speedup_turns": self.timed_turns,
            "timed": self.timed,
            "mismatched_turns": self.mismatched_turns if self.checked else None,
            "mismatches": self.mismatches if self.checked else None,
            **(loop_fields(self.turns(), [o for p in self.prompts for o in p["output_ids"]])
               if all("output_ids" in p for p in self.prompts) else {}),
        }


def speedup_fields(base_s: float, base_tokens: int, spec_s: float, spec_tokens: int, spec_cycles: int = 0) -> dict:
    """Seconds per token of each decoder and their ratio (None without a baseline), and what a
    speculative cycle costs: its seconds (`spec_s_per_cycle`) and those in target-only steps
    (`cycle_target_steps`, the decoding engine's figure of merit: speedup = tau over cycles of
    the timed turns / cycle_target_steps). Per-turn prefills are in both decoders' seconds."""
    per_cycle = spec_s / spec_cycles if spec_cycles else None
    if not base_tokens or not spec_tokens:
        return {"speedup": None, "baseline_s_per_token": None,
                "spec_s_per_token": spec_s / spec_tokens if spec_tokens else None,
                "spec_s_per_cycle": per_cycle, "cycle_target_steps": None}
    base, spec = base_s / base_tokens, spec_s / spec_tokens
    return {"speedup": base / spec, "baseline_s_per_token": base, "spec_s_per_token": spec,
            "spec_s_per_cycle": per_cycle, "cycle_target_steps": per_cycle / base if per_cycle else None}


def sets_speedup(sets: list["SetResult"]) -> dict:
    """speedup_fields over the timed turns of several sets."""
    total = lambda key: sum(getattr(s, key) for s in sets)  # noqa: E731
    return speedup_fields(total("baseline_seconds"), total("baseline_tokens"), total("spec_seconds"),
                          total("spec_tokens"), total("spec_cycles"))


def turn_costs(timed: list[dict]) -> dict | None:
    """Where a timed speculative turn's seconds go, from the timed turns (SetResult.timed): its
    time to the first token (the prefill and its token choice), then to the end of its first
    cycle, then per later cycle (the steady cost); and the target-only seconds per token beside
    them (every timed turn was decoded both ways). None without timed turns that ran a cycle."""
    cycled = [t for t in timed if t["spec_first_cycle_s"] is not None]
    if not cycled:
        return None
    later = sum(t["cycles"] - 1 for t in cycled)
    base_tokens = sum(t["baseline_tokens"] for t in cycled)
    return {
        "turns": len(cycled),
        "spec_first_token_s": sum(t["spec_first_token_s"] for t in cycled) / len(cycled),
        "spec_first_cycle_s": sum(t["spec_first_cycle_s"] - t["spec_first_token_s"] for t in cycled) / len(cycled),
        "spec_s_per_later_cycle": sum(t["spec_s"] - t["spec_first_cycle_s"] for t in cycled) / later
        if later else None,
        "baseline_s_per_token": sum(t["baseline_s"] for t in cycled) / base_tokens if base_tokens else None,
    }


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
              gen: specdec.Generation, base: specdec.Generation | None, prompt_tokens: int = 0) -> None:
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


def decode_record(engine: specdec.Decoder, tokenizer, record: PromptRecord, index: int, *, name: str,
                  max_new_tokens: int, seed: int, stop_ids: list[int], baseline: bool) -> tuple[dict, list[TurnStats]]:
    """Speculative decoding of every turn of one record on `engine` (a later turn sees our
    earlier answers); with `baseline`, each turn is also decoded target-only with the same
    prompt, budget, stop tokens and seed, and a turn whose two outputs differ is marked
    mismatched. `index` (the record's place in its set) picks the sampling seeds, so a record
    decodes the same wherever it runs."""
    return decode_records(engine, tokenizer, [(index, record)], name=name, max_new_tokens=max_new_tokens, seed=seed,
                          stop_ids=stop_ids, baseline=baseline)[0]


def decode_records(engine: specdec.Decoder, tokenizer, records: list[tuple[int, PromptRecord]], *, name: str,
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
        entry["tau"] = specdec.turn_mean_tau(entry["acceptance_lengths"])
    return list(zip(entries, stats))


def run_prompt_set(model, tokenizer, proposer, records: list[PromptRecord], *, name: str = "prompts",
                   max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0, seed: int = 0,
                   stop_ids: list[int] | None = None, measure_speedup: bool = False,
                   speedup_turns: int | None = None, log=None, engine: specdec.Decoder | None = None) -> SetResult:
    """Speculative decoding of every turn of every record, in this process (on `engine`, or
    on one built for this call). With `measure_speedup`, every turn is also decoded
    target-only (`mismatched_turns`), and the first `speedup_turns` turns (None: all) are the
    timed ones of the speedup."""
    if stop_ids is None:
        stop_ids = specdec.stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    engine = engine or specdec.Decoder(model, proposer, temperature=temperature)
    result = SetResult(name, int(proposer.block_size))
    for i, record in enumerate(records):
        entry, turns = decode_record(engine, tokenizer, record, i, name=name, max_new_tokens=max_new_tokens,
                                     seed=seed, stop_ids=stop_ids, baseline=measure_speedup)
        result.add_record(entry, turns)
        result.add_timings(turns, speedup_turns)
        if log is not None:
            log(f"[{name}] {i + 1}/{len(records)} {record.id}: tau {entry['tau']:.2f}")
    return result


def warm_up(engine: specdec.Decoder, tokenizer, stop_ids, capacity: int) -> None:
    """Capture every batch-1 graph up to `capacity` positions, then one short run of each
    decoder, so the timed prompts pay no one-off costs (the capture time is reported)."""
    engine.capture(rows=1, capacity=capacity)
    ids = prompt_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    engine.generate([ids], 4, stop_ids=stop_ids)
    engine.speculate([ids], 4, stop_ids=stop_ids)


def combine(sets: list[SetResult], settings: dict) -> dict:
    """The JSON document of an evaluation: tau (mean of the sets' taus, as the paper averages
    benchmarks), per-set summaries, the histogram over all cycles, the overall speedup and
    every prompt's acceptance lengths and output ids (one list per turn)."""
    per_set = {s.name: s.summary() for s in sets}
    block_size = sets[0].block_size
    lengths = [n for s in sets for t in s.turns() for n in t]
    taus = [v["tau"] for v in per_set.values() if not math.isnan(v["tau"])]
    overall = sets_speedup(sets)
    return {
        "tau": sum(taus) / len(taus) if taus else float("nan"),
        "per_set": per_set,
        "histogram": specdec.acceptance_histogram(lengths, block_size),
        "speedup": overall["speedup"],
        "cycle_target_steps": overall["cycle_target_steps"],
        "turn_costs": turn_costs([t for s in sets for t in s.timed]),
        "speedup_turns": sum(s.timed_turns for s in sets),
        "block_size": block_size,
        "settings": settings,
        "prompts": [p for s in sets for p in s.prompts],
    }


# --------------------------------------------------------------------------- outputs


def markdown_summary(result: dict) -> str:
    fmt = lambda v, spec: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)  # noqa: E731
    s = result["settings"]
    decoded = (f"temperature {s.get('temperature')}, max new tokens {s.get('max_new_tokens')}" if "walk" not in s
               else "walked on the data's own replies (one forward per sample, no generation)")
    lines = [
        "# DFlash evaluation", "",
        f"- target: `{s.get('target')}`", f"- drafter: `{s.get('drafter')}`",
        f"- block size {result['block_size']}, {decoded}, device {s.get('device')}, dtype {s.get('dtype')}", "",
        "| set | prompts | turns | cycles | tau | tau (cycles) | speedup | lossless mismatches |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, v in result["per_set"].items():
        lines.append(
            f"| {name} | {v['num_prompts']} | {v['num_turns']} | {v['num_cycles']} | {fmt(v['tau'], '.3f')} "
            f"| {fmt(v['tau_cycles'], '.3f')} | {fmt(v['speedup'], '.2f')} | {fmt(v['mismatched_turns'], 'd')} |"
        )
    differ = []
    for name, v in result["per_set"].items():
        firsts = [m["first_difference"] for m in v.get("mismatches") or []]
        if firsts:
            differ.append(f"{name} {len(firsts)} (first differing token: median {statistics.median(firsts):g}, "
                          f"{min(firsts)}-{max(firsts)})")
    if differ:
        lines += ["", "Lossless mismatches, turns whose speculative and target-only outputs differ (in bf16 a "
                  "verify step and a decode step round differently, so a near-tie can go either way; in float32 "
                  "any mismatch is a defect): " + "; ".join(differ)]
    total = sum(result["histogram"]) or 1
    speedup = "speedup not measured" if result["speedup"] is None else (
        f"speedup {result['speedup']:.2f}x (target-only seconds per token / speculative seconds per token, over "
        f"the first {s.get('speedup_turns')} turns of each set ({result.get('speedup_turns')} in all), both "
        "decoded in one process with no other decoding running; a speculative cycle cost "
        f"{fmt(result.get('cycle_target_steps'), '.2f')} target-only steps)")
    lines += ["", f"**tau {fmt(result['tau'], '.3f')}**, {speedup}", ""]
    costs = result.get("turn_costs")
    if costs:
        ms = lambda v: fmt(None if v is None else 1e3 * v, ".2f")  # noqa: E731
        lines += [f"A timed speculative turn ({costs['turns']}): {ms(costs['spec_first_token_s'])} ms to its first "
                  f"token (prefill), {ms(costs['spec_first_cycle_s'])} ms more to the end of its first cycle, then "
                  f"{ms(costs['spec_s_per_later_cycle'])} ms per cycle; target-only "
                  f"{ms(costs['baseline_s_per_token'])} ms per token", ""]
    lines += ["Acceptance lengths: " + ", ".join(f"{k + 1}: {100 * c / total:.1f}%"
                                              for k, c in enumerate(result["histogram"])), ""]
    loops = [f"{name} {v['loop_turns']} of {v['num_turns']} (tau over cycles {fmt(v['loop_tau_cycles'], '.3f')} "
             f"there, {fmt(v['other_tau_cycles'], '.3f')} elsewhere)"
             for name, v in result["per_set"].items() if "loop_turns" in v]
    if loops:
        lines += [f"Turns ending in a loop (their last {LOOP_REPEATS} periods, at least {LOOP_MIN_TOKENS} tokens, "
                  "repeat): " + "; ".join(loops), ""]
    return "\n".join(lines)


def plot_histogram(histogram: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    total = sum(histogram) or 1
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(1, len(histogram) + 1), [c / total for c in histogram], color="#4c72b0")
    ax.set_xlabel("acceptance length (tokens committed per cycle)")
    ax.set_ylabel("fraction of cycles")
    ax.set_xticks(range(1, len(histogram) + 1))
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(result: dict, output: str | Path) -> list[Path]:
    """OUTPUT (JSON), OUTPUT with .md (summary) and OUTPUT with .png (histogram)."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    md.write_text(markdown_summary(result))
    plot_histogram(result["histogram"], png, f"tau {result['tau']:.2f} (block {result['block_size']})")
    return [out, md, png]


# --------------------------------------------------------------------------- loading and the CLI


def model_problems(target: str, drafter: str) -> list[str]:
    """What is wrong with --target (a model folder) and --drafter (a DFlash drafter folder for
    that target), read from their config files alone, before anything is loaded."""
    from transformers import AutoConfig

    from dflash_train.export import drafter_config

    problems = problems_of(lambda: resolve_target_path(target, "--target"))
    config = None if problems else AutoConfig.from_pretrained(resolve_target_path(target, "--target"))
    return problems + problems_of(lambda: drafter_config(drafter, "--drafter", config))


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
    stop ids) on `device`; the engine (specdec.Decoder) keeps its graphs for the process."""
    from dflash_train.export import load_drafter

    model, tokenizer = load_target_model(target, device, dtype)
    draft = load_drafter(drafter, "--drafter", dtype=dtype, device=device).eval()
    proposer = specdec.DFlashProposer.for_target(draft, model, graphs=graphs)
    engine = specdec.Decoder(model, proposer, temperature=temperature, graphs=graphs)
    return engine, tokenizer, specdec.stop_token_ids(tokenizer, model.generation_config)


def _worker_setup(device, target: str, drafter: str, dtype: torch.dtype, options: dict):
    return load_models(target, drafter, device, dtype, options["temperature"]), options


def _decode_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if k != "temperature"}  # the engine's own setting


def _worker_decode(state, item) -> tuple[tuple[int, list[int]], list[tuple[dict, list[TurnStats]]]]:
    """A chunk of (index, record) pairs of one set: one record at a time (batch size 1, the
    chunk holds one record), or all of them as one batch."""
    (engine, tokenizer, stop_ids), options = state
    name, chunk, batched = item
    options = _decode_options(options)
    if batched:
        decoded = decode_records(engine, tokenizer, chunk, name=name, stop_ids=stop_ids, **options)
    else:
        decoded = [decode_record(engine, tokenizer, record, index, name=name, stop_ids=stop_ids, **options)
                   for index, record in chunk]
    return (int(engine.proposer.block_size), stop_ids), decoded


def time_first_turns(engine: specdec.Decoder, tokenizer, stop_ids, sets: list[tuple[str, list[PromptRecord]]],
                     results: list[SetResult], num_turns: int, options: dict) -> None:
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
            _, turns = decode_record(engine, tokenizer, part, index, name=name, stop_ids=stop_ids,
                                     **{**_decode_options(options), "baseline": True})
            result.add_timings(turns, num_turns)


def eager_engine(engine: specdec.Decoder) -> specdec.Decoder:
    """The same target and drafter with every step run eagerly (no graphs): what the graphs buy."""
    proposer = engine.proposer
    eager = specdec.DFlashProposer(proposer.drafter, proposer.embed_weight, proposer.lm_head_weight, graphs=False)
    return specdec.Decoder(engine.model, eager, temperature=engine.temperature, top_p=engine.top_p, graphs=False)


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
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0, seed: int = 0,
             device: str = "auto", dtype: str = "auto", speedup: bool = True,
             speedup_turns: int = DEFAULT_SPEEDUP_TURNS, eager_turns: int = DEFAULT_EAGER_TURNS,
             workers: int = 1, batch_size: int = 1, graphs: bool = True, log=print) -> dict:
    """Load the target and a published-format drafter folder, run every prompt set, return the
    JSON document of `combine`. With `workers` > 1 the records are decoded by that many
    processes (workers.parallel_map; a record's turns stay together); with `batch_size` > 1,
    each process decodes `batch_size` records of a set per batch (decode_records). In both
    cases the speedup is then measured in this process alone, at batch size 1, after the main
    pass; the results are those of `workers` = `batch_size` = 1 except timings. Both decoders
    of the speedup run on the engine with its graphs captured first; on a GPU the first
    `eager_turns` turns of each set are timed again without graphs (`speedup_eager`)."""
    problems = [f"{flag} must be {need}, got {value}" for flag, value, ok, need in (
        ("--workers", workers, workers >= 1, ">= 1"),
        ("--batch-size", batch_size, batch_size >= 1, ">= 1"),
        ("--speedup-turns", speedup_turns, speedup_turns >= 0, ">= 0 (0 times no turn)"),
        ("--eager-turns", eager_turns, eager_turns >= 0, ">= 0"),
        ("--max-new-tokens", max_new_tokens, max_new_tokens >= 1, ">= 1"),
        ("--limit", limit, limit is None or limit >= 1, ">= 1 (leave it out for every prompt)")) if not ok]
    dev, torch_dtype = checked_inputs(target, drafter, device, dtype, problems)
    sets = [(set_label(p), load_prompts(p, limit)) for p in prompts]  # bad names fail before loading
    options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed, "baseline": speedup}
    timed = speedup_turns if speedup else 0
    started = time.perf_counter()
    loaded = None
    if workers == 1 and batch_size == 1:
        loaded = load_models(target, drafter, dev, torch_dtype, temperature, graphs)
        engine, tokenizer, stop_ids = loaded
        if speedup:
            warm_up(engine, tokenizer, stop_ids, warm_capacity(tokenizer, sets, max_new_tokens,
                                                                engine.proposer.block_size))
        results = [run_prompt_set(engine.model, tokenizer, engine.proposer, records, name=name,
                                  max_new_tokens=max_new_tokens, seed=seed, stop_ids=stop_ids,
                                  measure_speedup=speedup, speedup_turns=timed, log=log, engine=engine)
                   for name, records in sets]
        decode_s = time.perf_counter() - started
    else:
        # Work items: chunks of `batch_size` records of one set (one record at batch size 1).
        chunks = [(k, name, list(enumerate(records))[a : a + batch_size])
                  for k, (name, records) in enumerate(sets) for a in range(0, len(records), batch_size)]
        items = [(name, chunk, batch_size > 1) for _, name, chunk in chunks]
        if workers > 1:
            mapped = parallel_map(_worker_setup, (target, drafter, torch_dtype, options), _worker_decode, items,
                                  num_workers=workers, device=dev)
        else:
            state = _worker_setup(dev, target, drafter, torch_dtype, options)
            loaded = state[0]
            mapped = (_worker_decode(state, item) for item in items)
        found: dict[int, SetResult] = {}
        for (k, name, chunk), ((block_size, stop_ids), decoded) in zip(chunks, mapped):
            for (i, record), (entry, turns) in zip(chunk, decoded):
                found.setdefault(k, SetResult(name, block_size)).add_record(entry, turns)
                log(f"[{name}] {i + 1}/{len(sets[k][1])} {record.id}: tau {entry['tau']:.2f}")
        results = [found[k] for k in range(len(sets))]
        decode_s = time.perf_counter() - started
        if timed:
            loaded = loaded or load_models(target, drafter, dev, torch_dtype, temperature, graphs)
            engine, tokenizer, stop_ids = loaded
            warm_up(engine, tokenizer, stop_ids, warm_capacity(tokenizer, sets, max_new_tokens,
                                                                engine.proposer.block_size))
            time_first_turns(engine, tokenizer, stop_ids, sets, results, timed, options)
    speedup_s = time.perf_counter() - started - decode_s
    eager = None
    if timed and eager_turns and loaded is not None and loaded[0].target.graphs.enabled:
        engine, tokenizer, stop_ids = loaded
        eager = [SetResult(name, r.block_size) for (name, _), r in zip(sets, results)]
        time_first_turns(eager_engine(engine), tokenizer, stop_ids, sets, eager, min(eager_turns, timed), options)
    eager_s = time.perf_counter() - started - decode_s - speedup_s
    settings = {"target": target, "drafter": str(drafter), "prompts": list(prompts), "limit": limit,
                "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed,
                "device": str(dev), "dtype": str(torch_dtype).removeprefix("torch."), "stop_ids": stop_ids,
                "workers": workers, "batch_size": batch_size, "speedup_turns": timed,
                "graphs": bool(loaded is not None and loaded[0].target.graphs.enabled),
                "eager_turns": min(eager_turns, timed) if eager is not None else 0}
    doc = combine(results, settings)
    if eager is not None:
        doc["speedup_eager"] = sets_speedup(eager)
    doc["wall_s"] = {"decode": decode_s, "speedup": speedup_s, "eager": eager_s,
                     "capture": loaded[0].capture_seconds if loaded is not None else 0.0}
    return doc


def run_eval(args) -> int:
    """`dflash-train eval`: prompts decoded (here), or data walked (`--walk`, walk.py)."""
    if bool(args.prompts) == bool(getattr(args, "walk", None)):
        raise InputError("give --prompts (served tau by decoding) or --walk DATA (walked tau on data), "
                         "not both or neither")
    prompts = [p.strip() for item in args.prompts or [] for p in item.split(",") if p.strip()]
    problem = output_file_problem(args.output)
    if problem is not None:  # before the decoding, not after it
        raise InputError(f"--output {args.output}: {problem}")
    if args.walk:
        from dflash_train.metrics import quiet_progress_bars
        from dflash_train.walk import evaluate_walk

        quiet_progress_bars()
        result = evaluate_walk(args.target, args.drafter, list(args.walk), limit=args.limit,
                               device=args.device, dtype=args.dtype)
    else:
        result = evaluate(args.target, args.drafter, prompts, limit=args.limit, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, seed=args.seed, device=args.device, dtype=args.dtype,
                          speedup=not args.no_speedup, speedup_turns=args.speedup_turns,
                          eager_turns=args.eager_turns, workers=args.workers, batch_size=args.batch_size,
                          graphs=not args.no_graphs)
    written = write_outputs(result, args.output)
    print(markdown_summary(result))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


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
        self.stop_ids = specdec.stop_token_ids(self.tokenizer, self.model.generation_config)
        self.replica = None
        self.engine: specdec.Decoder | None = None

    def __call__(self, drafter, autocast=None) -> dict:
        """Metrics of the current weights (no noise: the proposer never adds any; no gradients:
        inference mode). `autocast` is not needed: the replica runs in the target's dtype."""
        from dflash_train.drafter import DFlashDrafter

        drafter = getattr(drafter, "module", drafter)  # DDP
        if self.replica is None:
            self.replica = DFlashDrafter(drafter.config).to(self.device, self.dtype).eval().requires_grad_(False)
            proposer = specdec.DFlashProposer.for_target(self.replica, self.model)
            self.engine = specdec.Decoder(self.model, proposer)
        with torch.no_grad():
            for name, value in drafter.state_dict().items():
                self.replica.state_dict()[name].copy_(value)
        result = run_prompt_set(self.model, self.tokenizer, self.engine.proposer, self.records,
                                name=set_label(self.cfg.prompts), max_new_tokens=self.cfg.max_new_tokens,
                                stop_ids=self.stop_ids, engine=self.engine)
        summary = result.summary()
        return {
            "eval_tau": summary["tau"],
            "eval_tau_cycles": summary["tau_cycles"],
            "eval_histogram": summary["histogram"],
            "eval_acceptance_lengths": [p["acceptance_lengths"] for p in result.prompts],
        }
