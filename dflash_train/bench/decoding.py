"""Speed of the decoding engine (`dflash-train bench --workload decode`).

Owns the decoding benchmark: regeneration throughput (slots.SlotDecoder, rows refilled as they
finish) at several row counts, and batch-1 milliseconds per token of target-only and
speculative decoding (decoder.Decoder), each with CUDA graphs and eagerly, in one process, on a
randomly initialised target of a real shape (SmolLM2-135M by default; `--target` takes a real
folder) and a random drafter. A random drafter is rarely accepted, so the speculative figure
that matters is the cost of one cycle (drafter block step + verify step + host work) in target
decode steps: speedup = tau / that ratio. Capture time is measured and kept out of the rates.
With `--profile`, a few regeneration steps at the largest row count are run again under
torch.profiler once every row is live, and its operator table (device time on a GPU) is written
to bench-decode-kernels.txt. The last line is one JSON object.

Shape legend: R rows, P prompt tokens, N new tokens per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_train.bench.workloads import SMOLLM2_135M
from dflash_train.core.devices import resolve_device, resolve_dtype, synchronize
from dflash_train.core.drafter import DFlashDrafter, build_drafter_config
from dflash_train.core.target import load_target_model
from dflash_train.engine.decode import PREFILL_TOKENS
from dflash_train.engine.decoder import Decoder
from dflash_train.engine.fusion import KINDS, fuse_kernels
from dflash_train.engine.proposer import DFlashProposer
from dflash_train.engine.slots import SlotDecoder

DEFAULT_ROWS = (1, 64, 256, 512)
DEFAULT_PROMPT = (64, 512)  # prompt lengths drawn uniformly from this range
DEFAULT_NEW_TOKENS = 128
DEFAULT_DRAFTER_LAYERS = 5
BLOCK_SIZE = 16
PROFILE_STEPS = 10


@dataclass(frozen=True)
class Requests:
    """The requests the bench decodes: prompts of random ids, their lengths drawn uniformly from
    `prompt_lengths` (shortest, longest), each run for `new_tokens` new tokens (no stop tokens)."""

    new_tokens: int = DEFAULT_NEW_TOKENS
    prompt_lengths: tuple[int, int] = DEFAULT_PROMPT


@dataclass(frozen=True)
class EngineSettings:
    """How the engine decodes: the `attention` of the target's steps (decode.TargetSteps), and
    with `overlap` the host's work between regeneration steps overlapped with the device's
    (slots.SlotDecoder)."""

    attention: str = "auto"
    overlap: bool = True


@dataclass(frozen=True)
class DecodeBench:
    """What the decoding bench measures: regeneration at each of `rows` row counts, with graphs
    where they run and eagerly at `eager_rows` (None: at every count), over `requests_per_row`
    requests per row (at least 2); batch 1 over `turns` prompts of the longest length; with
    `profile_path`, the largest row count's regeneration profiled there (profile_regeneration)."""

    rows: tuple[int, ...] = DEFAULT_ROWS
    eager_rows: tuple[int, ...] | None = None
    requests_per_row: int = 2
    turns: int = 3
    requests: Requests = Requests()
    engine: EngineSettings = EngineSettings()
    profile_path: Path | None = None
    drafter_layers: int = DEFAULT_DRAFTER_LAYERS
    """Layers of the random drafter whose speculative cycle is timed."""


def build_models(target: str | None, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 num_layers: int = DEFAULT_DRAFTER_LAYERS):
    """(target model, drafter): `target` is a folder (or bundled name) or None for a random
    SmolLM2-135M-shaped one; the drafter is random, `num_layers` layers (as many taps, fewer on
    a target of fewer tappable layers), block 16, in the target's dtype."""
    torch.manual_seed(seed)
    if target is None:
        fields = dict(SMOLLM2_135M)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
        model.requires_grad_(False)
    else:
        model, _ = load_target_model(target, device, dtype)
    vocab, layers = int(model.config.vocab_size), int(model.config.get_text_config().num_hidden_layers)
    # as many taps as layers, but no more than the target's layers before its last
    cfg = build_drafter_config(model.config, num_layers=num_layers, block_size=BLOCK_SIZE,
                               num_taps=min(num_layers, layers - 1), mask_token_id=vocab - 1)
    drafter = DFlashDrafter(cfg).to(device, dtype).eval().requires_grad_(False)
    return model, drafter


def _prompts(num: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 1, int(n)).tolist() for n in rng.integers(lengths[0], lengths[1] + 1, num)]


def regeneration_rate(model, rows: int, *, graphs: bool, count: int, requests: Requests = Requests(),
                      engine: EngineSettings = EngineSettings(), seed: int = 0,
                      profile_path: Path | None = None) -> dict:
    """Tokens/s of SlotDecoder with `rows` rows over `count` of `requests` (no stop tokens: every
    request runs its whole budget), after one warm-up pass that captures the graphs; with
    `profile_path`, then profile_regeneration."""
    new_tokens, prompt_lengths = requests.new_tokens, requests.prompt_lengths
    device = model.get_input_embeddings().weight.device
    vocab = int(model.config.vocab_size)
    budget = new_tokens if profile_path is None else max(new_tokens, profile_budget(rows, prompt_lengths[1]))
    slots = SlotDecoder.for_model(model, rows, prompt_lengths[1] + budget + 2, graphs=graphs,
                                  attention=engine.attention, overlap=engine.overlap)
    with torch.inference_mode():
        for i, p in enumerate(_prompts(min(rows, count), prompt_lengths, vocab, seed + 1)):  # warm-up
            slots.add(("warm", i), p, new_tokens, i)
        for _ in slots.run():
            pass
        warm_capture = slots.steps.graphs.capture_seconds
        for i, p in enumerate(_prompts(count, prompt_lengths, vocab, seed)):
            slots.add(i, p, new_tokens, i)
        synchronize(device)
        before, host, started = slots.generated, dict(slots.seconds), time.perf_counter()
        steps = 0
        while slots.busy:
            slots.step()
            steps += 1
        synchronize(device)
    capture = slots.steps.graphs.capture_seconds - warm_capture
    seconds = time.perf_counter() - started - capture
    tokens = slots.generated - before
    entry = {"rows": rows, "graphs": graphs, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
             "steps": steps, "ms_per_step": 1e3 * seconds / max(steps, 1), "capture_s": warm_capture + capture,
             "graphs_captured": slots.steps.graphs.num_captured, "attention": slots.steps.attention,
             "overlap": slots.overlap, **{k: v - host[k] for k, v in slots.seconds.items()}}
    if profile_path is not None:
        entry["profile"] = profile_regeneration(slots, rows, new_tokens, prompt_lengths, vocab, seed, profile_path)
    return entry


def profile_budget(rows: int, longest_prompt: int, prefill_tokens: int = PREFILL_TOKENS,
                   steps: int = PROFILE_STEPS) -> int:
    """New tokens a profiled request needs so that none finishes before the profiled window
    ends: a bound on the fill (one refill admits every waiting request, so it takes one step;
    this allows ceil(rows / per_step) steps of `prefill_tokens` prompt tokens each), then the
    window."""
    per_step = max(1, prefill_tokens // max(1, longest_prompt))
    return -(-rows // per_step) + steps + 2


def profile_regeneration(slots, rows: int, new_tokens: int, prompt_lengths: tuple[int, int], vocab: int, seed: int,
                         path: Path, steps: int = PROFILE_STEPS) -> dict:
    """`steps` decode steps of `slots` with all `rows` rows live under torch.profiler: fresh
    requests are stepped in first until none is pending (the refill that admits them),
    so no prefill falls in the window and every profiled step decodes every row. Its
    operator table, sorted by device time on a GPU (self CPU time on a CPU), is written to
    `path`. Returns what was profiled, with the steps the fill took and the live rows."""
    device = slots.device
    budget = max(new_tokens, profile_budget(rows, prompt_lengths[1], slots.prefill_tokens, steps))
    with torch.inference_mode():
        for i, p in enumerate(_prompts(rows, prompt_lengths, vocab, seed + 2)):
            slots.add(("profile", i), p, budget, i)
        fill_steps = 0
        while slots.pending:  # the refills (prefills) and their steps, outside the window
            slots.step()
            fill_steps += 1
        live = slots.num_live
        if live != rows:
            raise RuntimeError(f"profile: {live} of {rows} rows live after the fill; a request of {budget} new tokens "
                               f"finished during it")
        synchronize(device)
        cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        started = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                slots.step()
            synchronize(device)
        seconds = time.perf_counter() - started
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{steps} regeneration steps at {rows} rows, every row live (graphs: {slots.steps.graphs.enabled}), "
                    f"prompts of {prompt_lengths[0]}..{prompt_lengths[1]} tokens, {seconds * 1e3:.1f} ms under the "
                    f"profiler, sorted by {sort}\n{table}\n")
    return {"rows": rows, "steps": steps, "seconds": seconds, "path": str(path), "sorted_by": sort,
            "fill_steps": fill_steps, "live_rows": live}


def batch_one(model, drafter, *, graphs: bool, new_tokens: int, prompt_len: int, turns: int, seed: int = 0,
              attention: str = "auto", kernels: tuple[str, ...] = KINDS) -> dict:
    """Batch-1 ms per token of target-only and speculative decoding on one engine (graphs
    captured first), and the cost of a speculative cycle in target decode steps; the `kernels`
    kinds of the target and the drafter (engine/fusion.py) as one kernel each where the device
    allows, the rest by their own forward."""
    proposer = DFlashProposer.for_target(drafter, model, graphs=graphs, kernels=kernels)
    engine = Decoder(model, proposer, graphs=graphs, attention=attention)
    # the engine fused all it could; counted (and given back where not wanted) here
    target_fused, drafter_fused = fuse_kernels(model, kernels), fuse_kernels(drafter, kernels)
    prompts = _prompts(turns, (prompt_len, prompt_len), int(model.config.vocab_size), seed)
    engine.capture(rows=1, capacity=prompt_len + new_tokens + 2 * BLOCK_SIZE + 2)
    base_s = base_n = spec_s = spec_n = cycles = 0
    for p in prompts:
        engine.generate([p[:8]], 4)  # keeps both paths warm between measurements
        base = engine.generate([p], new_tokens)[0]
        spec = engine.speculate([p], new_tokens)[0]
        base_s, base_n = base_s + base.seconds, base_n + len(base.output_ids)
        spec_s, spec_n = spec_s + spec.seconds, spec_n + len(spec.output_ids)
        cycles += len(spec.acceptance_lengths)
    engine.close()
    step_ms, token_ms = 1e3 * base_s / base_n, 1e3 * spec_s / spec_n
    cycle_ms = 1e3 * spec_s / max(cycles, 1)
    return {"graphs": graphs, "target_ms_per_token": step_ms, "spec_ms_per_token": token_ms,
            "spec_ms_per_cycle": cycle_ms, "cycle_in_target_steps": cycle_ms / step_ms,
            "tau": (spec_n - len(prompts)) / max(cycles, 1), "capture_s": engine.capture_seconds,
            "attention": engine.target.attention, "kernels": list(kernels), "target_fused": target_fused,
            "drafter_fused": drafter_fused,
            "graphs_captured": engine.target.graphs.num_captured + proposer.graphs.num_captured}


def run_decode_bench(bench: DecodeBench = DecodeBench(), *, target: str | None = None, device: str = "auto",
                     dtype: str = "auto", log=print) -> dict:
    """The whole benchmark on `target` (None: a random SmolLM2-135M-shaped one); returns the
    report (the JSON object). With `bench.profile_path`, the largest row count's regeneration
    (with graphs where they run) is profiled too."""
    dev = resolve_device(device, setting="--device")
    torch_dtype = resolve_dtype(dtype, dev)
    model, drafter = build_models(target, dev, torch_dtype, num_layers=bench.drafter_layers)
    modes = [True, False] if dev.type == "cuda" else [False]
    rows, requests, engine = tuple(bench.rows), bench.requests, bench.engine
    eager_rows = rows if bench.eager_rows is None else tuple(bench.eager_rows)
    report = {"workload": "decode", "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "dtype": str(torch_dtype).removeprefix("torch."), "target": target or "random SmolLM2-135M shape",
              "drafter_layers": bench.drafter_layers, "new_tokens": requests.new_tokens,
              "prompt_lengths": list(requests.prompt_lengths), "regeneration": [],
              "batch_one": [], "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    measured = [r for r in rows if modes[0] or r in eager_rows]  # in the first pass
    largest = max(measured) if measured else None
    for graphs in modes:
        for r in rows:
            if not graphs and r not in eager_rows:
                continue
            profiled = bench.profile_path if graphs == modes[0] and r == largest else None
            entry = regeneration_rate(model, r, graphs=graphs, count=max(2, bench.requests_per_row * r),
                                      requests=requests, engine=engine, profile_path=profiled)
            report["regeneration"].append(entry)
            log(f"bench decode: regeneration rows {r:>4} {'graphs' if graphs else 'eager '}: "
                f"{entry['tokens_per_s']:>9,.0f} tokens/s, {entry['ms_per_step']:.2f} ms/step "
                f"(capture {entry['capture_s']:.1f} s, attention {entry['attention']}, overlap {entry['overlap']})")
            if profiled is not None:
                log(f"bench decode: {PROFILE_STEPS} steps at {r} rows profiled: {profiled}")
        # On a GPU with graphs, also without the rotations' kernel and without any: what each saves
        for kernels in ([KINDS, ("norms",), ()] if graphs else [KINDS]):
            entry = batch_one(model, drafter, graphs=graphs, new_tokens=requests.new_tokens,
                              prompt_len=requests.prompt_lengths[1], turns=bench.turns, attention=engine.attention,
                              kernels=kernels)
            report["batch_one"].append(entry)
            log(f"bench decode: batch 1 {'graphs' if graphs else 'eager '}, kernels "
                f"{'+'.join(kernels) or 'none'} ({entry['target_fused']} target, {entry['drafter_fused']} drafter "
                f"modules): target {entry['target_ms_per_token']:.2f} "
                f"ms/token, speculative cycle {entry['spec_ms_per_cycle']:.2f} ms = "
                f"{entry['cycle_in_target_steps']:.2f} target steps (capture {entry['capture_s']:.1f} s)")
    fuse_kernels(model), fuse_kernels(drafter)
    return report
