"""What an evaluation reports, in both `dflash-train eval` modes (prompts decoded, data walked).

Owns the statistics of a decoded turn (TurnStats) and of a prompt set (SetResult: tau, the
histogram, the lossless mismatches, the timed turns), the speedup fields and where a timed
turn's seconds go, tau on turns that end in a loop apart from the others, the JSON document
(`combine`), its markdown summary and the acceptance-length histogram (PNG).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.data.preparation import LOOP_MIN_TOKENS, LOOP_REPEATS, loop_period
from dflash_train.engine.acceptance import acceptance_histogram, mean_acceptance, turn_mean_tau

# --------------------------------------------------------------------------- loops

def loop_fields(turns: list[list[int]], outputs: list[list[int]]) -> dict:
    """How many turns end in a loop (loop_period of their output ids) and tau over cycles on
    those turns and on the others (None where there is no such turn)."""
    looped = [loop_period(o) is not None for o in outputs]
    loop = [n for t, hit in zip(turns, looped) if hit for n in t]
    other = [n for t, hit in zip(turns, looped) if not hit for n in t]
    return {"loop_turns": sum(looped),
            "loop_tau_cycles": mean_acceptance(loop) if loop else None,
            "other_tau_cycles": mean_acceptance(other) if other else None}


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
            "tau": turn_mean_tau(self.turns()),
            "tau_cycles": mean_acceptance(lengths),
            "num_prompts": len(self.prompts),
            "num_turns": len(self.turns()),
            "num_cycles": len(lengths),
            "new_tokens": self.new_tokens,
            "histogram": acceptance_histogram(lengths, self.block_size),
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
        "histogram": acceptance_histogram(lengths, block_size),
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
    # Imported only when a plot is drawn: matplotlib is slow to import and nothing else of an
    # evaluation needs it; the Agg backend (files, no display) must be chosen before pyplot.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot takes the backend chosen when it is imported

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


# An earlier result larger than this is not read to be recognised (a result holds every turn's
# acceptance lengths and ids: about 10 KB a prompt).
RESULT_READ_BYTES = 256 * 2**20


def is_result(path: Path) -> bool:
    """Whether `path` holds a result `write_outputs` wrote (a JSON object with tau and per_set)."""
    try:
        if path.stat().st_size > RESULT_READ_BYTES:
            return False
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "tau" in doc and "per_set" in doc


def outputs_problem(output: str | Path) -> str | None:
    """What `write_outputs` would write over that no evaluation wrote: OUTPUT, where it exists and
    is not a result (a data or prompts file named by mistake), or, where OUTPUT is not a result,
    the .md or .png beside it (a user's notes). None when nothing else is in the way: an earlier
    result and its two siblings are replaced."""
    out = Path(output)
    if out.is_file():
        return None if is_result(out) else f"{out} exists and is not an eval result; writing would replace it"
    taken = [str(p) for p in (out.with_suffix(".md"), out.with_suffix(".png")) if p.exists()]
    if not taken:
        return None
    verb, them = ("exists", "it") if len(taken) == 1 else ("exist", "them")
    return (f"{' and '.join(taken)} {verb} beside it and no eval wrote {them} (there is no {out.name}); "
            f"writing would replace {them}")


def write_outputs(result: dict, output: str | Path) -> list[Path]:
    """OUTPUT (JSON), OUTPUT with .md (summary) and OUTPUT with .png (histogram)."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    md.write_text(markdown_summary(result))
    plot_histogram(result["histogram"], png, f"tau {result['tau']:.2f} (block {result['block_size']})")
    return [out, md, png]
