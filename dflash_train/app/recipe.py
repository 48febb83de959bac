"""The quality recipe and the embedded default on a GPU.

`QUALITY_TRAIN_ARGS` are the training settings chosen on walked validation tau (docs/QUALITY.md:
5 layers, 16K-token batches, 512 anchors, lr 1e-3, compiled target and drafter, D-PACE position
weights, loop tails skipped), and `QUALITY_SOURCES` the offline prompt sources (sources.py)
regenerated and trained on beside the chats (python-functions and word-problems chosen on the
pooled held-out chats and source records, docs/QUALITY.md "Fifth measurement"; python-packages
on held-out chats, source records and package records, "Seventh measurement");
`scripts/quality_run.sh` reads both from here, and so does the embedded default on a GPU.

A target given alone (`dflash-train train target.path=DIR`, no data) runs that recipe end to end
on data it makes itself (`Recipe.own_data`): conversations the target writes, the first 6,000
bundled ShareGPT chats and the prompt sources, all answered by it at T=0 (into the run's folder,
so a stopped run resumes), a drafter trained on them with a held-out validation split (the best
walked checkpoint exported), then served at T=0 on MT-Bench, HumanEval and GSM8K, ending with
the served tau of each set; one budget covers the data and the training. `dflash-train train`
with no arguments on a machine with a CUDA GPU is the same for the bundled SmolLM2, fitted to
15 minutes (`gpu_default`). On CPU the embedded default stays the smoke-sized run of
config.EMBEDDED_DEFAULT.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import math
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig, AutoTokenizer

from dflash_train.bench.memory import Layout, Planner, largest_fitting, refusal
from dflash_train.core.assets import cache_root, sharegpt_json
from dflash_train.core.config import load_config
from dflash_train.core.errors import INTERRUPTED, InputError, folder_problem, problems_of
from dflash_train.core.signals import StopFlag
from dflash_train.core.target import resolve_target_path, weight_bytes
from dflash_train.data import regenerate, sources, target_prompts
from dflash_train.data.batching import PAD_MULTIPLE
from dflash_train.data.chat_files import DataError
from dflash_train.engine.decode import kv_bytes_per_row
from dflash_train.eval import evaluate, results
from dflash_train.eval.during_training import DuringTraining
from dflash_train.train.checkpoint import list_checkpoints
from dflash_train.train.loop import run_folder_problem, train

QUALITY_TRAIN_ARGS: tuple[str, ...] = (
    "drafter.num_layers=5", "data.max_length=2048", "data.token_budget=16384", "data.max_batch_size=64",
    "objective.num_anchors=512", "optim.lr=1e-3", "target.compile=true", "train.compile=true",
    "objective.weighting=dpace", "objective.loop_tails=skip",
)
# python-functions ends where the running Python's standard library does (2,893 functions on 3.12,
# 3,454 on 3.11): 10,000 takes all of it. python-packages: the first 8,000 of the installed
# libraries' documented functions (about 19,000 with torch and transformers installed), shuffled
QUALITY_SOURCES: tuple[tuple[str, int], ...] = (("python-functions", 10_000), ("word-problems", 4_000),
                                                ("python-packages", 8_000))
EVAL_SETS = ("mt-bench", "humaneval", "gsm8k")
# A target given alone on a GPU: how many conversations it writes itself, and the time for making the
# data and training together (the recipe's quality bound for SmolLM2-135M).
OWN_DATA_TARGET_PROMPTS = 10_000
OWN_DATA_BUDGET_S = 1800.0
# ... and its schedule: 4,300 steps walked 5.18 on the validation split where 3,300 walked 4.77, on the
# same data (docs/QUALITY.md, a target given alone)
OWN_DATA_STEPS = 4300
# ... and its drafter's depth: 8 layers walked 6.05 at step 4,000 where 5 walked 5.10 (3 layers: 4.29), on
# the same data, split and schedule; a batch-1 cycle costs 1.633 target steps against 1.475, so 8 layers
# pays above 5.73 (docs/QUALITY.md, a target given alone)
OWN_DATA_DRAFTER_LAYERS = 8
# The embedded default on a GPU (`make train`, the bundled SmolLM2 given alone): 15 minutes end to end.
# At equal end-to-end time, 5,000 own conversations and a 470 s training box walked 5.49 where 10,000
# and 320 s walked 4.90 (docs/QUALITY.md, a target given alone). The budget covers the data (about
# 280 s on an H100) and training; data prepare, the warm-up and serving come on top (about 140 s).
GPU_DEFAULT_TARGET_PROMPTS = 5_000
GPU_DEFAULT_BUDGET_S = 740.0
# A target given alone on a CPU: its written turns cut at this many tokens, so that a written turn
# and its answer leave room for another in the smoke run's 288-token conversations (at the GPU's
# 512 none did: every conversation had one turn, and every system message was dropped), and a 0.5B
# target writes its conversations in minutes on two cores, not in a quarter of an hour.
CPU_PROMPT_MAX_TOKENS = 96
# ... and the smoke-sized drafter of config.EMBEDDED_DEFAULT.
CPU_TRAIN_ARGS: tuple[str, ...] = ("drafter.num_layers=1", "data.max_length=512", "data.token_budget=2048",
                                   "data.max_batch_size=16", "objective.num_anchors=16", "optim.lr=1e-3",
                                   "train.anchor_multiple=16")
# A turn the target writes (its own conversations) that has not ended within this many tokens is
# dropped: target_prompts' own default, named in the file of the conversations when it differs
PROMPT_MAX_TOKENS = target_prompts.TargetPromptOptions.max_prompt_tokens
# A turn whose prompt passes this many tokens is not answered (the chats, the sources), and the target's
# own conversations take no turn past it and its answer; their file is named by it where it differs
MAX_PROMPT_LENGTH = 1024
MIN_GPU_GIB = 32.0  # above the recipe's training peak (docs/QUALITY.md)
# The target's own conversations are written beside the other data stages where two copies of its
# weights take at most this share of the GPU's memory (SmolLM2-135M: 0.3 GB, Qwen2.5-0.5B: 1 GB)
OWN_ASIDE_WEIGHT_SHARE = 0.05


@dataclass(frozen=True)
class Recipe:
    """One run of the recipe end to end, every stage's settings. A target given alone, and the
    embedded default on a GPU (the bundled target given alone: gpu_default), get
    `Recipe.own_data`; the class's own defaults are the chats and sources alone, no conversations
    of the target's own (tests shrink either)."""

    target: str = "bundled:smollm2-135m-instruct"
    data: str | None = None  # None: the bundled ShareGPT JSON
    records: int = 6000  # conversations regenerated (the first ones of the file); 0: none
    target_prompts: int = 0  # conversations the target writes itself (data source target-prompts)
    prompt_turns: int = 3  # ... with user turns drawn from 1..prompt_turns
    prompt_system_share: float = 0.25  # ... a share of them opening with a system message it writes
    prompt_temperature: float = 1.0
    prompt_top_p: float = 0.95
    prompt_max_candidates: int | None = None  # target_prompts.TargetPromptOptions.max_candidates
    prompt_max_tokens: int = PROMPT_MAX_TOKENS  # a written turn not ended within this many tokens is dropped
    data_dir: str | None = None  # where the data is made; None: the asset cache (shared by runs)
    max_new_tokens: int = 320
    max_prompt_length: int = MAX_PROMPT_LENGTH
    regen_batch_size: int = 1024
    regen_temperature: float = 0.0
    reply_samples: int = 0
    """Sampled replies per prompt beyond the greedy one: once the greedy data is made, each of its
    files is answered this many more times at `sample_temperature` / `sample_top_p` (seeds 1..N,
    one pass over every file per seed), resumed like the rest and within the data's share of the
    budget, and trained on beside it; the validation split walks only the greedy replies of the
    conversations it holds out (docs/DATA.md)."""
    sample_temperature: float = 1.0
    sample_top_p: float = 0.95
    regenerated: str | None = None  # None: a file in the asset cache named by target and settings
    sources: tuple[tuple[str, int], ...] = field(default=QUALITY_SOURCES)  # (name, count): sources.py
    output_dir: str = "runs/default-gpu"
    steps: int = 2000
    max_time_s: float = 600.0
    validation: int = 128
    eval_every: int = 400
    train_args: tuple[str, ...] = field(default=QUALITY_TRAIN_ARGS)
    eval_limit: int = 200  # per set: all of MT-Bench (80), HumanEval's and GSM8K's first 200
    eval_max_new_tokens: int = 256
    speedup_turns: int = 10
    workers: int = 4
    eval_batch_size: int = 32
    device: str = "cuda"
    budget_s: float | None = None
    """Seconds for making the data and training together (None: each stage runs to its size).
    The data stages stop starting new work at `data_share` of it (what they made is kept, and a
    rerun resumes them); training then has the rest, at most `max_time_s`."""
    data_share: float = 0.5
    prompts_aside: bool = True
    """The offline sources' prompts written in processes of their own while the target makes the
    chats (CPU work: python-packages parses docstrings for about a minute); False: each source's
    stage writes its own, in turn."""
    own_aside: bool = True
    """The target's own conversations written by a process of its own (its own copy of the target)
    while this one answers the chats and the sources at half its rows (all of them in a stage that
    starts after it ended: stage_rows): each stage is bound by its
    process's host work, so side by side they take little more than the longer one. Only where two
    copies of the target's weights take at most OWN_ASIDE_WEIGHT_SHARE of the GPU (run_recipe);
    False: in turn."""

    @classmethod
    def own_data(cls, target: str, device: str, output_dir: str | None = None,
                 budget_s: float | None = None) -> "Recipe":
        """A target given alone (`dflash-train train target.path=DIR`): the target writes its own
        conversations and answers the bundled chats and the offline prompt sources; sized for a GPU
        by `budget_s` (default: OWN_DATA_BUDGET_S; a larger one scales its own conversations, the
        chats and the schedule's steps with it, a smaller one cuts the data at its share of the
        budget and fits the schedule to the time left), on a CPU to a smoke run of minutes."""
        out = output_dir or f"runs/{_slug(target.removeprefix('bundled:'))}"
        if device == "cuda":
            budget = budget_s or OWN_DATA_BUDGET_S
            scale = max(1.0, budget / OWN_DATA_BUDGET_S)  # a larger budget buys data and steps alike
            return cls(target=target, target_prompts=round(OWN_DATA_TARGET_PROMPTS * scale),
                       records=round(cls.records * scale), output_dir=out, data_dir=f"{out}/target-data",
                       steps=round(OWN_DATA_STEPS * scale), max_time_s=1e9, budget_s=budget,
                       train_args=replaced(QUALITY_TRAIN_ARGS, f"drafter.num_layers={OWN_DATA_DRAFTER_LAYERS}"))
        return cls(target=target, records=16, target_prompts=8, prompt_max_candidates=64,
                   prompt_max_tokens=CPU_PROMPT_MAX_TOKENS, max_new_tokens=32, max_prompt_length=256,
                   regen_batch_size=8, sources=(("word-problems", 8),), output_dir=out,
                   data_dir=f"{out}/target-data", steps=12, max_time_s=budget_s or 1e9, validation=4, eval_every=6,
                   train_args=CPU_TRAIN_ARGS, eval_limit=2, eval_max_new_tokens=16, speedup_turns=1, workers=1,
                   eval_batch_size=2, device="cpu", prompts_aside=False, own_aside=False)

    def data_root(self) -> Path:
        """Where the data is made: beside a `regenerated` file given, else `data_dir`, else the
        asset cache."""
        if self.regenerated is not None:
            return Path(self.regenerated).parent
        return Path(self.data_dir) if self.data_dir is not None else cache_root() / "regenerated"

    def target_prompt_path(self) -> Path:
        """The target's own conversations, named by the target and the settings that make them."""
        name = _slug(self.target.removeprefix("bundled:"))
        cut = "" if self.prompt_max_tokens == PROMPT_MAX_TOKENS else f"-cut{self.prompt_max_tokens}"
        length = "" if self.max_prompt_length == MAX_PROMPT_LENGTH else f"-prompt{self.max_prompt_length}"
        return self.data_root() / (f"{name}-target-prompts-turns{self.prompt_turns}-sys{self.prompt_system_share:g}"
                                   f"-t{self.prompt_temperature:g}-p{self.prompt_top_p:g}{cut}{length}"
                                   f"-new{self.max_new_tokens}.jsonl")

    def regenerated_path(self) -> Path:
        if self.regenerated is not None:
            return Path(self.regenerated)

        name = _slug(self.target.removeprefix("bundled:"))
        data = "sharegpt" if self.data is None else _slug(Path(self.data).stem)
        return self.data_root() / (f"{name}-{data}-new{self.max_new_tokens}-prompt{self.max_prompt_length}"
                                   f"-t{self.regen_temperature:g}.jsonl")

    def source_prompts(self, name: str, count: int) -> Path:
        """Where source `name`'s first `count` prompts are written: beside regenerated_path()."""
        return self.data_root() / "sources" / f"{name}-{count}.jsonl"

    def source_answers(self, name: str, count: int, prompts: Path) -> Path:
        """The regenerated file of the prompts written to `prompts`: named by the source, its
        count, a digest of the prompts (python-functions and python-packages change with the
        installed Python and packages; other prompts get another file, not a resume that
        refuses them), the target and the settings."""
        digest = hashlib.sha256(prompts.read_bytes()).hexdigest()[:12]
        return self.data_root() / (
            f"{_slug(self.target.removeprefix('bundled:'))}-{name}-{count}-{digest}"
            f"-new{self.max_new_tokens}-prompt{self.max_prompt_length}-t{self.regen_temperature:g}.jsonl")

    def sampled_path(self, answered: Path, seed: int) -> Path:
        """The replies to the prompts of `answered` (a greedy file the run made) sampled with
        `seed`: beside it, named by the sampling settings."""
        return answered.with_name(f"{answered.stem}-sampled-t{self.sample_temperature:g}-p{self.sample_top_p:g}"
                                  f"-s{seed}{answered.suffix}")

    def train_overrides(self, files: list[Path] | tuple[Path, ...] | None = None,
                        max_time_s: float | None = None) -> list[str]:
        """The training run's overrides: the recipe, the data (`files`; default: the regenerated
        chats), the target and the sizes (`max_time_s`: the time box, default the plan's)."""
        log_every = next(n for n in range(min(10, self.eval_every), 0, -1) if self.eval_every % n == 0)
        paths = ",".join(str(path) for path in (files if files is not None else [self.regenerated_path()]))
        return [*self.train_args, f"data.paths=[{paths}]", f"target.path={self.target}",
                f"output_dir={self.output_dir}", f"train.max_steps={self.steps}",
                f"train.max_time_s={max_time_s if max_time_s is not None else self.max_time_s:g}",
                f"train.device={self.device}", f"data.validation={self.validation}", f"eval.every={self.eval_every}",
                "eval.prompts=null", f"log.every={log_every}", f"checkpoint.every={self.eval_every}",
                "checkpoint.keep=1", "checkpoint.keep_best=true"]


def replaced(args: tuple[str, ...], override: str) -> tuple[str, ...]:
    """`args` (section.key=value overrides) with the one of `override`'s key replaced by it."""
    key = override.split("=", 1)[0]
    if not any(arg.split("=", 1)[0] == key for arg in args):
        raise ValueError(f"{override}: no {key} in {args}")
    return tuple(override if arg.split("=", 1)[0] == key else arg for arg in args)


def _slug(text: str) -> str:
    """`text` as a file name part: runs of other characters than letters, digits, . _ - as one -."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def check_own_data(plan: Recipe) -> None:
    """A target given alone, checked before anything is made or said, every problem in one
    InputError: the run's folder can be made and written in, the target's folder (or bundled name)
    resolves, and its tokenizer has the chat template its own conversations and the chats'
    replies are written through."""
    problem = folder_problem(plan.output_dir)
    problems = [f"output_dir {plan.output_dir}: {problem}: choose a folder you can write in"] if problem else []
    replaced = run_folder_problem(plan.output_dir, with_data_cache=True)
    problems += [replaced] if replaced else []
    problems += problems_of(lambda: check_chat_target(plan.target))
    if problems:
        raise InputError("; ".join(problems))


def check_chat_target(target: str) -> None:
    """`target`'s folder resolves (an error naming target.path) and its tokenizer has a chat
    template (InputError when it has none)."""
    folder = resolve_target_path(target, "target.path")
    problem = target_prompts.template_problem(AutoTokenizer.from_pretrained(str(folder)), f"target.path {target}")
    if problem:
        raise InputError(problem)


def _lines(path: Path) -> int:
    """The lines of a JSONL file the run made or reads: its records."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def check_gpu_memory(total_bytes: int) -> None:
    """The recipe's training needs about MIN_GPU_GIB of GPU memory: on a smaller GPU, say so and
    how to run instead, before anything runs."""
    gib = total_bytes / 2**30
    if gib < MIN_GPU_GIB:
        raise InputError(
            f"the recipe (the embedded default on a GPU, a target given alone) needs about {MIN_GPU_GIB:g} GiB "
            f"of GPU memory (it peaked at 28.4 GiB on an H200); this GPU has {gib:.1f} GiB. Run the smoke-sized "
            f"default on it with `dflash-train train train.device=cuda`, or the recipe with smaller batches: "
            f"scripts/quality_run.sh with a lower data.token_budget added to its TRAIN_ARGS (README 'The quality run')")


def fitted_to_gpu(plan: Recipe, target_config, gpu_memory_gib: float, log) -> Recipe:
    """`plan` with its training batches fitted to one GPU of `gpu_memory_gib` for a target of
    `target_config`, before any data is made: unchanged where the memory planner's worst case
    (bench/memory.py) fits; else data.token_budget lowered to the largest that fits (data.max_length
    with it where it must) and train.grad_accum raised to keep the tokens of a step, split evenly
    over its micro-batches (even_micro_batches), said in a line; an InputError naming what would
    fit where nothing does. The recipe's batches were chosen for SmolLM2-135M; a larger target
    given alone would otherwise fail at its first step."""
    cfg = load_config(None, list(plan.train_args))
    planner, layout = Planner.of(target_config, cfg, gpu_memory_gib=gpu_memory_gib), Layout(gpus=1)
    memory = planner.plan(layout)
    if memory.fits:
        return plan
    # Several micro-batches to a step hold the gradients between them: the search counts them
    accumulating = replace(cfg, train=replace(cfg.train, grad_accum=max(2, cfg.train.grad_accum)))
    budget = largest_fitting(replace(planner, cfg=accumulating), layout, "data", "token_budget", PAD_MULTIPLE)
    if budget is None:
        raise InputError(f"the recipe's training does not fit this GPU for {plan.target}: "
                         f"{refusal(planner, memory)}; train with a config of your own (README 'Your target, your "
                         f"data') or on more GPUs")
    accum = cfg.train.grad_accum * math.ceil(cfg.data.token_budget / budget)
    budget = even_micro_batches(cfg, budget, accum)
    args = replaced(plan.train_args, f"data.token_budget={budget}")
    if budget < cfg.data.max_length:
        args = replaced(args, f"data.max_length={budget}")
    args = (*args, f"train.grad_accum={accum}")
    log(f"dflash-train train: the recipe's {cfg.data.token_budget:,}-token batches would take "
        f"{memory.peak / 2**30:.0f} GiB of this {gpu_memory_gib:.0f} GiB GPU at worst for {plan.target}; it trains "
        f"micro-batches of {budget:,} tokens{f' (samples up to {budget:,})' if budget < cfg.data.max_length else ''}, "
        f"{accum} to a step")
    return replace(plan, train_args=args)


def even_micro_batches(cfg, largest: int, accum: int) -> int:
    """The micro-batch token budget for `accum` micro-batches to a step of the recipe's
    `cfg.data.token_budget` tokens, at most `largest` (what fits): the step's tokens split evenly
    (a multiple of PAD_MULTIPLE), so the step keeps the recipe's size instead of `accum` times the
    largest (Qwen2.5-0.5B on 80 GB: 2 x 12,480 = 24,960 tokens, 52% above the recipe's 16,384), but
    never below the longest sample that fits (`data.max_length`), so samples are not cut for it."""
    even = PAD_MULTIPLE * math.ceil(math.ceil(cfg.data.token_budget / accum) / PAD_MULTIPLE)
    return min(largest, max(even, min(cfg.data.max_length, largest)))


def regen_rows(plan: Recipe, free_bytes: int, config) -> int:
    """Rows the regeneration decodes at once: plan.regen_batch_size, or fewer (a multiple of 64)
    where their key/value caches would take more than half of the free GPU memory."""

    per_row = kv_bytes_per_row(config, plan.max_prompt_length + plan.max_new_tokens + 2, torch.bfloat16)
    fit = int(free_bytes // 2 // per_row)
    rows = min(plan.regen_batch_size, max(1, fit))
    return rows if rows < 64 else rows // 64 * 64


GPU_DEFAULT_OUTPUT = "runs/default-gpu"


def gpu_default(output_dir: str | None = None) -> Recipe:
    """The embedded default on a GPU (`dflash-train train` with no arguments): the bundled
    target given alone (Recipe.own_data) fitted to 15 minutes (GPU_DEFAULT_TARGET_PROMPTS of its
    own conversations, GPU_DEFAULT_BUDGET_S), its data made in `output_dir` (default
    GPU_DEFAULT_OUTPUT)."""
    plan = Recipe.own_data(Recipe.target, "cuda", output_dir or GPU_DEFAULT_OUTPUT, GPU_DEFAULT_BUDGET_S)
    return replace(plan, target_prompts=GPU_DEFAULT_TARGET_PROMPTS)


def notice(plan: Recipe) -> str:
    """The first line of the embedded default on a GPU: what the run does."""
    return (f"dflash-train train: the embedded default on a GPU: {plan.target} given alone "
            f"(docs/QUALITY.md): it {_data_made(plan)} (a rerun resumes), then up to {plan.steps:,} training steps "
            f"within {plan.budget_s:g} s for data and training, then served tau on {', '.join(EVAL_SETS)} (first "
            f"{plan.eval_limit} each); for the CPU smoke run instead: `dflash-train train train.device=cpu`")


def own_data_notice(plan: Recipe) -> str:
    """The first line of `dflash-train train target.path=DIR` alone: what the run does."""
    budget = f"within {plan.budget_s:g} s for data and training" if plan.budget_s else f"{plan.steps:,} training steps"
    return (f"dflash-train train: no data given: {plan.target} {_data_made(plan)}; a drafter trained on them with a "
            f"held-out split ({budget}), the best walked checkpoint exported, then served on {', '.join(EVAL_SETS)}; "
            f"give data.paths to train on data of your own")


def _data_made(plan: Recipe) -> str:
    """The data a plan makes, as both first lines say it."""
    prompts = "".join(f" and up to {count:,} {name} prompts" for name, count in plan.sources)
    samples = (f", then {plan.reply_samples} sampled repl{'y' if plan.reply_samples == 1 else 'ies'} more to each "
               f"prompt (T={plan.sample_temperature:g}, top-p {plan.sample_top_p:g})") if plan.reply_samples else ""
    return (f"writes {plan.target_prompts:,} conversations of its own and answers up to {plan.records:,} bundled "
            f"ShareGPT conversations{prompts}{samples} into {plan.data_root()}")


def run_recipe(plan: Recipe = Recipe(), log=print) -> int:
    """Make the data (resumed), train (resumed), serve; returns the exit status (130 when a signal
    stopped a stage: rerunning the command resumes it)."""
    started = time.time()
    rows = plan.regen_batch_size
    if plan.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        check_gpu_memory(total)
        folder = resolve_target_path(plan.target)
        target_config = AutoConfig.from_pretrained(folder)
        plan = fitted_to_gpu(plan, target_config, total / 2**30, log)
        rows = regen_rows(plan, free, target_config)
        if plan.own_aside and 2 * weight_bytes(folder) > OWN_ASIDE_WEIGHT_SHARE * total:
            plan = replace(plan, own_aside=False)
    deadline = started + plan.data_share * plan.budget_s if plan.budget_s else None
    files = data_of_run_in_progress(plan, log) or make_data(plan, rows, deadline, log)
    if files is None:
        return INTERRUPTED
    _release()
    time_box = plan.max_time_s
    if plan.budget_s:
        time_box = min(time_box, max(60.0, started + plan.budget_s - time.time()))
        log(f"dflash-train train: the data took {time.time() - started:.0f} s of the {plan.budget_s:g} s budget; "
            f"training has {time_box:.0f} s")
    cfg = load_config(None, plan.train_overrides(files, time_box))
    drafter = Path(cfg.output_dir) / "drafter"
    result = train(cfg, log, evaluation=DuringTraining())
    if result is None or Path(result).resolve() != drafter.resolve():
        log(f"dflash-train train: training stopped before its end; the same command resumes it ({cfg.output_dir})")
        return INTERRUPTED
    _release()
    serve(plan, drafter, Path(cfg.output_dir), log)
    return 0


def data_of_run_in_progress(plan: Recipe, log) -> list[Path] | None:
    """The training files of a run stopped in plan.output_dir (checkpoints, no exported drafter
    yet): a rerun resumes that training on the data it started with, instead of making more (a
    data stage that stopped at the budget would go on, and the run would train on other data than
    it resumes). None when there is no such run."""
    out = Path(plan.output_dir)
    if not list_checkpoints(out) or (out / "drafter" / "config.json").is_file():
        return None
    try:
        saved = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    paths = ((saved.get("data") or {}).get("paths") or []) if isinstance(saved, dict) else []
    if not paths:
        return None
    log(f"dflash-train train: {out} holds a run in progress; it resumes on the data it started with")
    return [Path(path) for path in paths]


def make_data(plan: Recipe, rows: int, deadline: float | None, log) -> list[Path] | None:
    """The training files: the chats regenerated, the target's own conversations, the prompt
    sources regenerated, each resumed, then plan.reply_samples sampled replies to all of them; a
    stage past `deadline` keeps what it made. None when a signal stopped a stage. The sources'
    prompts are written aside meanwhile (plan.prompts_aside), and so are the target's own
    conversations (plan.own_aside)."""
    writers = start_prompt_writers(plan)
    own = start_own_writer(plan, rows, deadline) if plan.own_aside and plan.target_prompts else None
    try:
        files = _make_data(plan, rows, deadline, log, writers, own)
    finally:
        stop_prompt_writers(writers if own is None else {**writers, "own": own})
    if files is None or not plan.reply_samples:
        return files
    sampled = sampled_replies(plan, files, rows, deadline, log)
    return None if sampled is None else files + sampled


def sampled_replies(plan: Recipe, files: list[Path], rows: int, deadline: float | None, log) -> list[Path] | None:
    """The prompts of each greedy file in `files` answered again, sampled (plan.sample_temperature,
    plan.sample_top_p) with seeds 1..plan.reply_samples, into plan.sampled_path: every file once
    per seed before any file twice, each resumed; none started past `deadline` (said once). The
    files made, in that order; None when a signal stopped one."""
    made = []
    for seed in range(1, plan.reply_samples + 1):
        for answered in files:
            if _past(deadline, f"the sampled replies from {answered.name} (seed {seed}) on", log):
                return made
            _release()
            out = plan.sampled_path(answered, seed)
            what = f"sampled replies (seed {seed}) of {answered.name}"
            if _regenerate_up_to(plan, answered, out, _lines(answered), rows, what, deadline, log, seed=seed):
                return None
            if out.is_file() and out.stat().st_size:
                made.append(out)
    return made


def _make_data(plan: Recipe, rows: int, deadline: float | None, log,
               writers: dict[str, multiprocessing.Process],
               own: multiprocessing.Process | None) -> list[Path] | None:
    files = []
    if plan.records:
        path = plan.regenerated_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        if _regenerate_up_to(plan, plan.data or sharegpt_json(), path, plan.records,
                             stage_rows(rows, own, "the chats", log), "conversations", deadline, log):
            return None
        files.append(path)
    if own is None and plan.target_prompts:
        files.append(_own_conversations(plan, rows, deadline, log))
    for name, count in plan.sources:
        if _past(deadline, f"the {name} prompts", log):
            continue
        _release()
        answered = _regenerate_source(plan, name, count, stage_rows(rows, own, f"the {name} prompts", log),
                                      deadline, log, writers.get(name))
        if answered is None:
            return None
        files.append(answered)
    if own is not None:
        if not _waited_for(own):
            return None
        files.insert(1 if plan.records else 0, _own_written_aside(plan, rows, deadline, log, own))
    files = [path for path in files if path is not None and path.is_file() and path.stat().st_size]
    if not files:
        raise InputError(f"no training data was made for {plan.target} (see the lines above); give data.paths, or "
                         f"a larger budget")
    return files


def stage_rows(rows: int, own: multiprocessing.Process | None, what: str, log) -> int:
    """A data stage's engine rows, chosen as it starts: half while the own conversations' process
    runs beside it (its two engines hold the rest), all of them once it has ended (said)."""
    if own is None:
        return rows
    if own.is_alive():
        return max(1, rows // 2)
    log(f"dflash-train train: the own conversations' process has ended; {what} are answered on all {rows:,} rows")
    return rows


def _past(deadline: float | None, stage: str, log) -> bool:
    """True (and said) when the data's share of the budget is spent: `stage` is not started (nor
    its model loaded); a later run with a larger budget makes it."""
    if deadline is None or time.time() < deadline:
        return False
    log(f"dflash-train train: the data's share of the budget is spent; {stage} are not made")
    return True


def _own_conversations(plan: Recipe, rows: int, deadline: float | None, log) -> Path | None:
    """The target's own conversations on two engines of rows // 2 rows each (_target_prompts),
    in this process, unless the data's share of the budget is spent (None)."""
    if _past(deadline, "the target's own conversations", log):
        return None
    _release()
    return _target_prompts(plan, max(1, rows // 2), deadline, log)


def _target_prompts(plan: Recipe, rows: int, deadline: float | None, log) -> Path | None:
    """The target's own conversations (resumed) on two engines of `rows` rows each (the sampled
    turns and the greedy answers); a target that writes nothing usable is said and the run goes on
    with the other data."""
    path = plan.target_prompt_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    options = target_prompts.TargetPromptOptions(
        limit=plan.target_prompts, max_turns=plan.prompt_turns, system_share=plan.prompt_system_share,
        temperature=plan.prompt_temperature, top_p=plan.prompt_top_p, max_new_tokens=plan.max_new_tokens,
        max_length=plan.max_prompt_length + plan.max_new_tokens, batch_size=rows, device=plan.device,
        deadline=deadline, max_candidates=plan.prompt_max_candidates, max_prompt_tokens=plan.prompt_max_tokens)
    try:
        counts = target_prompts.write_target_prompts(plan.target, path, options, log=log)
    except DataError as err:
        log(f"dflash-train train: {err}; going on without them")
        return path if path.is_file() else None
    log(f"dflash-train train: {counts['kept']:,} conversations the target wrote itself in {path}"
        f"{' (stopped at the data budget)' if counts.get('out_of_time') else ''}")
    return path


def serve(plan: Recipe, drafter: Path, out: Path, log) -> None:
    """The exported drafter served at T=0 on the evaluation sets; the summary and served line. The
    speedup is timed as served, with CUDA graphs; the timing without them (`eval --eager-turns`,
    a diagnostic of the engine, about 30 s on a GPU) is left out."""
    result = evaluate.evaluate(plan.target, str(drafter), list(EVAL_SETS), limit=plan.eval_limit,
                               decoding=evaluate.Decoding(max_new_tokens=plan.eval_max_new_tokens, temperature=0.0),
                               timing=evaluate.Timing(speedup_turns=plan.speedup_turns, eager_turns=0),
                               placement=evaluate.Placement(device=plan.device, workers=plan.workers,
                                                            batch_size=plan.eval_batch_size), log=log)
    written = results.write_outputs(result, out / "eval.json")
    log(results.markdown_summary(result))
    log("wrote " + ", ".join(str(p) for p in written))
    log(served_line(result, drafter))


def _regenerate_up_to(plan: Recipe, data, out: Path, want: int, rows: int, what: str, deadline: float | None,
                      log, seed: int = 0) -> bool:
    """`out` regenerated from `data` until it holds `want` records (resumed; nothing to do when
    it does) or `deadline` passes, logged as `what`: at plan.regen_temperature, or with `seed`
    (1 and up) sampled at plan.sample_temperature / plan.sample_top_p. True when a signal stopped it."""
    have = _lines(out) if out.is_file() else 0
    if have >= want:
        log(f"dflash-train train: {out} already holds {have} regenerated {what}")
        return False
    sampling = {"temperature": plan.sample_temperature, "top_p": plan.sample_top_p, "seed": seed} if seed else \
        {"temperature": plan.regen_temperature}
    options = regenerate.RegenerationOptions(max_new_tokens=plan.max_new_tokens, batch_size=rows,
                                             max_prompt_length=plan.max_prompt_length, device=plan.device,
                                             limit=want - have, deadline=deadline, **sampling)
    summary = regenerate.regenerate([str(data)], plan.target, out, options, log=log)
    if summary.get("stopped"):
        return True
    log(f"dflash-train train: regenerated {summary['num_written']} {what} "
        f"({summary.get('tokens_per_s') or 0:,.0f} new tokens/s) into {out}"
        f"{' (stopped at the data budget)' if summary.get('out_of_time') else ''}")
    return False


def start_prompt_writers(plan: Recipe) -> dict[str, multiprocessing.Process]:
    """With plan.prompts_aside, a process per offline source writing its prompts to
    plan.source_prompts (spawned, as CUDA wants; python-functions starts a pool of its own, so
    they are not daemons): {source: its process}. None of them holds anything the run needs: a
    stage whose writer failed writes its prompts itself."""
    if not plan.prompts_aside:
        return {}
    context = multiprocessing.get_context("spawn")
    writers = {}
    for name, count in plan.sources:
        path = plan.source_prompts(name, count)
        path.parent.mkdir(parents=True, exist_ok=True)
        writers[name] = context.Process(target=write_prompts_aside, args=(name, str(path), count),
                                        name=f"dflash-train prompts {name}")
        writers[name].start()
    return writers


def write_prompts_aside(name: str, path: str, count: int) -> None:
    """A prompt writer's process: the source's prompts written (atomically), else exit status 1
    and nothing written (its stage then writes them itself, and says what failed)."""
    try:
        sources.write_source(name, path, limit=count, replace=True)
    except Exception:  # said by the stage that writes them again in the run's process
        sys.exit(1)


def start_own_writer(plan: Recipe, rows: int, deadline: float | None) -> multiprocessing.Process:
    """A spawned process writing the target's own conversations (_target_prompts, resumed) on two
    engines of rows // 2 rows each, with the run's deadline; its lines go to the same output."""
    process = multiprocessing.get_context("spawn").Process(
        target=write_own_aside, args=(plan, rows, deadline), name="dflash-train own conversations")
    process.start()
    return process


def write_own_aside(plan: Recipe, rows: int, deadline: float | None) -> None:
    """The own conversations' process: exit status 0 when its stage ran (what it wrote is resumed
    by any later run), 1 when it failed (the run's process then writes them itself and says why).
    A signal to the run stops it through stop_prompt_writers; an interrupt typed at the terminal
    reaches the run's process, which stops it the same way."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_with_parent()
    log = functools.partial(print, flush=True)  # its lines as they come, not when the process ends
    try:
        _own_conversations(plan, rows, deadline, log)
    except Exception as err:  # the run's process then writes them itself
        log(f"dflash-train train: the target's own conversations failed in their process: {type(err).__name__}: "
            f"{err}")
        sys.exit(1)


def _end_with_parent() -> None:
    """This process ends once the process that started it is gone (one killed before it could stop
    its writers): a thread watching the parent's pid. What it wrote is whole records, resumed later."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="dflash-train parent watch", daemon=True).start()


def _waited_for(process: multiprocessing.Process) -> bool:
    """`process` waited for; False when SIGTERM or SIGINT came first (the caller stops it)."""
    flag = StopFlag().install() if threading.current_thread() is threading.main_thread() else None
    try:
        while process.is_alive():
            if flag is not None and flag.requested:
                return False
            process.join(timeout=0.5)
        return True
    finally:
        if flag is not None:
            flag.restore()


def _own_written_aside(plan: Recipe, rows: int, deadline: float | None, log,
                       own: multiprocessing.Process) -> Path | None:
    """The own conversations' file once their process ended; where it failed, written here."""
    if own.exitcode == 0:
        path = plan.target_prompt_path()
        return path if path.is_file() else None
    log(f"dflash-train train: the process writing the target's own conversations failed (exit status "
        f"{own.exitcode}); they are written here")
    return _own_conversations(plan, rows, deadline, log)


def stop_prompt_writers(writers: dict[str, multiprocessing.Process]) -> None:
    """The writers still running (their stage was not reached: a budget or a signal) stopped; a
    prompt writer's file is written atomically, so a stopped one leaves none, and the own
    conversations keep their whole records, which the next run resumes."""
    for writer in writers.values():
        if writer.is_alive():
            writer.terminate()
        writer.join()


def _regenerate_source(plan: Recipe, name: str, count: int, rows: int, deadline: float | None, log,
                       writer: multiprocessing.Process | None = None) -> Path | None:
    """Source `name`'s first `count` prompts, written by `writer` (waited for) or here (seconds to a
    minute; the same every time on one installation, so a stopped regeneration resumes), and
    regenerated like the chats. Returns the regenerated file, None when a signal stopped it."""
    prompts = plan.source_prompts(name, count)
    prompts.parent.mkdir(parents=True, exist_ok=True)
    if writer is not None:
        writer.join()
    if writer is not None and writer.exitcode == 0:
        total = _lines(prompts)
    else:
        total = sources.write_source(name, prompts, limit=count, replace=True)
    answered = plan.source_answers(name, count, prompts)
    if _regenerate_up_to(plan, prompts, answered, total, rows, f"{name} records", deadline, log):
        return None
    return answered


def _release() -> None:
    """Between stages: the last stage's engine and caches freed now (its captured graphs reach
    their owners in cycles that only the collector frees), and their GPU memory returned."""

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def served_line(result: dict, drafter: Path) -> str:
    """The last line: served tau per set, overall, and the speedup when it was timed."""
    sets = ", ".join(f"{name} {v['tau']:.3f}" for name, v in result["per_set"].items())
    speed = f", {result['speedup']:.2f}x at batch 1" if result.get("speedup") is not None else ""
    return f"dflash-train train: served tau {sets} (all {result['tau']:.3f}{speed}); the drafter: {drafter}"
