"""The handlers of `dflash-train` commands: the parsed arguments in, one call into the package,
an exit status out. The parser (cli.py) hands each command its handler; errors are said there."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from dflash_train.app import recipe
from dflash_train.bench.decoding import (
    DEFAULT_DRAFTER_LAYERS,
    DEFAULT_NEW_TOKENS,
    DEFAULT_PROMPT,
    DEFAULT_ROWS,
    DecodeBench,
    EngineSettings,
    Requests,
    run_decode_bench,
)
from dflash_train.bench.distributed import world_size
from dflash_train.bench.memory import (
    Layout,
    MemoryPlan,
    Planner,
    bench_micro_batch,
    format_table,
    gib,
    layout_flags,
    plan_layouts,
    plan_summary,
    refusal,
    worst_case_micro_batch,
)
from dflash_train.bench.training import format_report, run_bench
from dflash_train.bench.workloads import workload_settings
from dflash_train.core.config import ConfigError, load_config
from dflash_train.core.devices import resolve_device
from dflash_train.core.errors import INTERRUPTED, InputError, folder_problem, output_file_problem, problems_of
from dflash_train.core.export import check_export_folder, export_drafter
from dflash_train.core.target import resolve_target_path, target_config_of
from dflash_train.data import target_prompts
from dflash_train.data.chat_files import DataError
from dflash_train.data.preparation import no_samples, prepare
from dflash_train.data.regenerate import SHOWN_SKIPS, RegenerationOptions, regenerate
from dflash_train.data.serving import ServerError, ServingOptions
from dflash_train.data.sources import write_source
from dflash_train.eval.during_training import DuringTraining
from dflash_train.eval.evaluate import Decoding, Placement, Timing, evaluate
from dflash_train.eval.results import markdown_summary, outputs_problem, write_outputs
from dflash_train.eval.walk import evaluate_walk
from dflash_train.train.checkpoint import drafter_from_checkpoint
from dflash_train.train.loop import train
from dflash_train.train.metrics import quiet_progress_bars
from dflash_train.train.plot import summary_lines, write_report


def run_train(args) -> int:
    """`dflash-train train`: with no arguments on a GPU the recipe; with a target alone (no data
    and no config) the recipe on data the target makes itself; otherwise the run the config and
    overrides describe."""
    overrides = list(args.overrides)
    if args.config is None and not overrides and gpu_default_applies():
        plan = recipe.gpu_default(args.output_dir)
        recipe.check_own_data(plan)
        print(recipe.notice(plan), flush=True)
        return recipe.run_recipe(plan)
    own = own_data_plan(args) if args.config is None else None
    if own is not None:
        recipe.check_own_data(own)  # a wrong folder is said before the run says what it will do
        print(recipe.own_data_notice(own), flush=True)
        return recipe.run_recipe(own)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    cfg = load_config(args.config, overrides)
    if args.config is None and not args.overrides:
        print(embedded_default_notice(cfg), flush=True)
    train(cfg, evaluation=DuringTraining())
    return 0


# The overrides a target given alone may come with; anything else is a run of the user's own design.
OWN_DATA_KEYS = ("target.path", "train.device", "train.max_time_s", "output_dir")


def own_data_plan(args) -> recipe.Recipe | None:
    """The recipe on the target's own data when the overrides name `target.path` and nothing but
    OWN_DATA_KEYS (no data.paths): the device's sizes, `train.max_time_s` as the budget of the
    data and the training together, `output_dir` (or --output-dir, which wins) its folder. Other
    override sets: None."""
    settings = dict(item.split("=", 1) for item in args.overrides if "=" in item)
    if "target.path" not in settings or set(settings) - set(OWN_DATA_KEYS) or len(settings) != len(args.overrides):
        return None
    cfg = load_config(None, list(args.overrides))  # checked as any override is
    device = resolve_device(cfg.train.device)
    return recipe.Recipe.own_data(cfg.target.path, device.type, args.output_dir or settings.get("output_dir"),
                                  cfg.train.max_time_s)


def gpu_default_applies() -> bool:
    """The embedded default runs the recipe on the bundled target's own data (recipe.gpu_default)
    where a CUDA GPU is visible and the process is not one rank of several (torchrun keeps the
    smoke-sized run)."""
    return torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) == 1


def embedded_default_notice(cfg) -> str:
    """The first line of `dflash-train train` with no --config and no overrides: what the run is."""
    return (f"dflash-train train: the embedded default, a smoke-sized run ({cfg.drafter.num_layers}-layer drafter, "
            f"block {cfg.drafter.block_size}, {cfg.train.max_steps} steps on the bundled ShareGPT for "
            f"{cfg.target.path}): it checks the install end to end and does not make a drafter that accelerates "
            f"(served tau about 1.04); on a machine with a CUDA GPU the same command runs the recipe on data the "
            f"bundled target makes itself instead (README 'The two commands')")


def run_export(args) -> int:
    """`dflash-train export`: a checkpoint's drafter in the served format. Only the drafter's
    files of the checkpoint are read; an export already at --out is replaced with --force only."""
    check_export_folder(args.out, "--out", force=args.force)
    drafter = drafter_from_checkpoint(Path(args.checkpoint))
    out = export_drafter(drafter, args.out, getattr(torch, args.dtype))
    print(f"exported {args.checkpoint} -> {out}")
    return 0


def run_prepare(args) -> int:
    """`dflash-train data prepare`: an empty result is an error (the report says why). `--target`
    is a folder or a bundled name, as everywhere."""

    prepared = prepare(args.data, resolve_target_path(args.target, "--target", weights=False), args.out,
                       max_length=args.max_length, overlong=args.overlong, strict=args.strict,
                       max_record_bytes=args.max_record_bytes)
    if prepared.report["num_samples"] == 0:
        raise DataError(no_samples(prepared))
    return 0


def run_source(args) -> int:
    """`dflash-train data source`: an offline source, or the target's own conversations."""
    given = [f"--{name.replace('_', '-')}" for name in TARGET_PROMPT_FLAGS if getattr(args, name) not in (None, False)]
    if args.source == target_prompts.SOURCE:
        return run_target_prompts(args)
    if given:
        raise InputError(f"{', '.join(given)}: options of --source {target_prompts.SOURCE}, not of {args.source}")
    packages = None if args.packages is None else [p.strip() for p in args.packages.split(",") if p.strip()]
    count = write_source(args.source, args.out, args.limit, args.seed, packages, replace=args.force)
    print(f"data source {args.source}: {count} records -> {args.out} (regenerate them with the target: "
          f"dflash-train data regenerate --data {args.out} --target ...)")
    return 0


# `data source` flags of target-prompts -> TargetPromptOptions fields
TARGET_PROMPT_FLAGS = {"target": None, "temperature": "temperature", "top_p": "top_p", "turns": "max_turns",
                       "system_share": "system_share", "max_prompt_tokens": "max_prompt_tokens",
                       "max_new_tokens": "max_new_tokens", "max_length": "max_length",
                       "near_duplicate": "near_duplicate", "batch_size": "batch_size", "device": "device",
                       "no_graphs": None}


def run_target_prompts(args) -> int:
    """`dflash-train data source --source target-prompts`."""
    problems = [] if args.target else ["--target: give the target model folder that writes the conversations"]
    if args.limit is None:
        problems.append("--limit: the target writes without end: give --limit N")
    if args.packages is not None:
        problems.append(f"--packages is an option of --source python-packages, not of {target_prompts.SOURCE}")
    if args.force:
        problems.append(f"--force: --source {target_prompts.SOURCE} resumes its own output and never replaces a "
                        "file; choose another --out to start anew")
    if problems:
        raise InputError("; ".join(problems))
    settings = {field: getattr(args, flag) for flag, field in TARGET_PROMPT_FLAGS.items()
                if field is not None and getattr(args, flag) is not None}
    options = target_prompts.TargetPromptOptions(limit=args.limit, seed=args.seed, graphs=not args.no_graphs,
                                                 **settings)
    counts = target_prompts.write_target_prompts(args.target, args.out, options)
    print(json.dumps(counts))
    print(f"data source {target_prompts.SOURCE}: {counts['kept']} conversations of the target's own -> {args.out} "
          f"(answered at T=0 already: train on them as they are, e.g. data.paths=[{args.out}])")
    return 0


def run_regenerate(args) -> int:
    """`dflash-train data regenerate`."""
    try:
        options = RegenerationOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      top_p=args.top_p, batch_size=args.batch_size,
                                      max_prompt_length=args.max_prompt_length, device=args.device, seed=args.seed,
                                      limit=args.limit, workers=args.workers, graphs=not args.no_graphs,
                                      overlap=not args.no_overlap, continue_turns=args.continue_turns,
                                      max_record_bytes=args.max_record_bytes)
        serving = ServingOptions(tuple(args.server), concurrency=args.concurrency, model=args.server_model,
                                 timeout=args.timeout, retries=args.retries) if args.server else None
        summary = regenerate(args.data, args.target, args.out, options, serving)
    except ServerError as err:
        if Path(args.out).exists():
            err.add_note(f"the records already written to {args.out} stay; the same command resumes after them")
        raise
    for skip in summary["skipped"][:SHOWN_SKIPS]:
        print(f"skipped {skip['file']}:{skip['line']}: {skip['reason']}")
    if len(summary["skipped"]) > SHOWN_SKIPS:
        print(f"... and {len(summary['skipped']) - SHOWN_SKIPS} more skipped records")
    print(json.dumps({k: v for k, v in summary.items() if k != "skipped"}))
    return INTERRUPTED if summary.get("stopped") else 0


def run_plot_cli(args) -> int:
    problem = output_file_problem(args.out) if args.out else folder_problem(Path(args.run_dir) / "plots")
    if problem is not None:
        raise InputError(f"{args.out or args.run_dir}: {problem}")
    summary = write_report(Path(args.run_dir), args.out)
    for line in summary_lines(summary):
        print(line)
    return 0


def run_eval(args) -> int:
    """`dflash-train eval`: prompts decoded (here), or data walked (`--walk`, walk.py)."""
    if bool(args.prompts) == bool(getattr(args, "walk", None)):
        raise InputError("give --prompts (served tau by decoding) or --walk DATA (walked tau on data), "
                         "not both or neither")
    prompts = [p.strip() for item in args.prompts or [] for p in item.split(",") if p.strip()]
    problem = output_file_problem(args.output)
    if problem is not None:  # before the decoding, not after it
        raise InputError(f"--output {args.output}: {problem}")
    problem = outputs_problem(args.output)
    if problem is not None:
        raise InputError(f"--output {args.output}: {problem}; choose another --output")
    if args.walk:

        quiet_progress_bars()
        result = evaluate_walk(args.target, args.drafter, list(args.walk), limit=args.limit,
                               device=args.device, dtype=args.dtype)
    else:
        decoding = Decoding(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
        timing = Timing(speedup=not args.no_speedup, speedup_turns=args.speedup_turns, eager_turns=args.eager_turns)
        placement = Placement(device=args.device, dtype=args.dtype, workers=args.workers, batch_size=args.batch_size,
                              graphs=not args.no_graphs)
        result = evaluate(args.target, args.drafter, prompts, limit=args.limit, decoding=decoding, timing=timing,
                          placement=placement)
    written = write_outputs(result, args.output)
    print(markdown_summary(result))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def shaped_overrides(args) -> list[str]:
    """A bench workload's overrides, with `--target DIR` as `target.path=DIR`: its random target
    takes that folder's shape (workloads.workload_settings)."""
    return [*args.overrides, *([f"target.path={args.target}"] if args.target else [])]


def run_bench_cli(args) -> int:
    overrides = shaped_overrides(args)
    output = Path(args.output) if args.output else None
    summary = None
    if args.profile and world_size() > 1:
        raise ConfigError(["--profile is for one process: launch without torchrun"])
    problem = output_file_problem(output) if output is not None else None
    if problem is not None:
        raise ConfigError([f"--output {output}: {problem}"])
    if args.profile:
        summary = (output.parent if output else Path(".")) / f"bench-{args.workload}-kernels.txt"
    report = run_bench(args.workload, steps=args.steps, warmup=args.warmup, overrides=overrides,
                       drafter_only=args.drafter_only, profile=args.profile_steps, profile_summary=summary,
                       peak_tflops=args.peak_tflops)
    if report is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    for line in format_report(report):
        print(line)
    if summary is not None and summary.exists():
        print(f"kernel summary written to {summary}")
    line = json.dumps(report)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(line + "\n")
    print(line, flush=True)
    if report["skipped_steps"]:
        # A skipped step (non-finite loss or gradients) did no update: its time is not a training
        # step's, and on synthetic data it means a broken setting. The report stays written.
        print(f"bench: {report['skipped_steps']} of {report['steps']} timed steps were skipped as non-finite "
              f"(no optimizer step): these figures do not time training; find what made the loss or "
              f"gradients NaN or inf (overrides: {report['overrides'] or 'none'}) before reading them",
              file=sys.stderr, flush=True)
        return 1
    return 0


def run_decode_bench_cli(args) -> int:
    """`dflash-train bench --workload decode`."""

    def counts(flag: str, text: str | None) -> tuple[int, ...] | None:
        try:
            values = tuple(int(r) for r in str(text).split(",")) if text else None
        except ValueError:
            values = ()
        if values is not None and not (values and all(v >= 1 for v in values)):
            problems.append(f"{flag} {text}: give row counts >= 1 separated by commas, e.g. 1,64,256")
        return values

    problems = []
    rows, eager = counts("--rows", args.rows) or DEFAULT_ROWS, counts("--eager-rows", args.eager_rows)
    for flag, value in (("--new-tokens", args.new_tokens), ("--drafter-layers", args.drafter_layers)):
        if value is not None and value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    lengths = DEFAULT_PROMPT
    if args.prompt_lengths is not None:
        try:
            lengths = tuple(int(v) for v in args.prompt_lengths.split(","))
        except ValueError:
            lengths = ()
        if len(lengths) != 2 or not 1 <= lengths[0] <= lengths[1]:
            problems.append(f"--prompt-lengths {args.prompt_lengths}: give the shortest and longest prompt, "
                            f"1 <= LO <= HI, e.g. 64,512")
    problem = output_file_problem(args.output) if args.output else None
    if problem is not None:
        problems.append(f"--output {args.output}: {problem}")
    problems += problems_of(lambda: resolve_device(args.device, setting="--device"))
    if args.target:
        problems += problems_of(lambda: resolve_target_path(args.target, "--target"))
    if problems:
        raise InputError("; ".join(problems))
    profile = None
    if args.profile:
        profile = (Path(args.output).parent if args.output else Path(".")) / "bench-decode-kernels.txt"
    bench = DecodeBench(rows=rows, eager_rows=eager, profile_path=profile,
                        requests=Requests(new_tokens=args.new_tokens or DEFAULT_NEW_TOKENS, prompt_lengths=lengths),
                        engine=EngineSettings(attention=args.attention, overlap=not args.no_overlap),
                        drafter_layers=args.drafter_layers or DEFAULT_DRAFTER_LAYERS)
    report = run_decode_bench(bench, target=args.target, device=args.device)
    line = json.dumps(report)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(line + "\n")
    print(line, flush=True)
    return 0


def run_bench_command(args) -> int:
    if args.workload == "decode":

        return run_decode_bench_cli(args)

    return run_bench_cli(args)


SHOWN_MISSES = 3  # layouts that do not fit listed after those that do (all of them with --all)


def run_plan(args) -> int:
    """`dflash-train plan`: the layouts of --gpus GPUs planned, those that fit first, or the one
    layout the options (or the settings) name, refused when it does not fit. Nothing loads."""
    cfg, config = plan_settings(args)
    micro_batch = (bench_micro_batch(args.workload, cfg) if args.workload
                   else worst_case_micro_batch(cfg, args.supervised_share))
    planner = Planner.of(config, cfg, micro_batch, args.gpu_memory_gib)
    layout = named_layout(args, cfg)
    if layout is not None:
        plans = [planner.plan(layout)]
        if not plans[0].fits:
            raise InputError(refusal(planner, plans[0]))
    else:
        plans = plan_layouts(planner, args.gpus, args.nodes)
    fitting = [p for p in plans if p.fits]
    shown = plans if args.all else fitting + [p for p in plans if not p.fits][: SHOWN_MISSES + 2 * (not fitting)]
    for line in [*plan_summary(planner), "", *format_table(shown)]:
        print(line)
    if not fitting:  # the lowest peak says how far off, and what would fit
        raise InputError(refusal(planner, plans[0], named=False) if plans
                         else f"--gpus {args.gpus}: no layout of these GPUs can run this target (its tensor-parallel "
                         f"splits: core/target.py tensor_parallel_problems)")
    print(best_line(fitting[0]))
    return 0


def plan_settings(args):
    """(the settings, the target's transformers config) of `dflash-train plan`: a bench workload's
    (on --target's shape where given), or the config file's defaults <- --config <- overrides
    with --target or target.path."""
    problems = []
    for flag, value, low in (("--gpus", args.gpus, 1), ("--nodes", args.nodes, 1), ("--target-tp", args.target_tp, 1),
                             ("--target-ranks", args.target_ranks, 1)):
        if value is not None and value < low:
            problems.append(f"{flag} must be >= {low}, got {value}")
    if not args.gpu_memory_gib > 0:
        problems.append(f"--gpu-memory-gib must be > 0, got {args.gpu_memory_gib:g}")
    if not 0 < args.supervised_share <= 1:
        problems.append(f"--supervised-share must be in (0, 1], got {args.supervised_share:g}")
    if args.workload and args.config:
        problems.append("--workload brings its own settings: drop --config")
    if problems:
        raise InputError("; ".join(problems))
    if args.workload:  # with --target: the workload's settings and batches on that target's shape
        return workload_settings(args.workload, shaped_overrides(args))
    cfg = load_config(args.config, list(args.overrides), base={})
    setting = "--target" if args.target else "target.path"
    return cfg, target_config_of(args.target or cfg.target.path, setting)


def named_layout(args, cfg) -> Layout | None:
    """The layout the options name (--target-tp, --target-ranks, --fsdp) or the settings do
    (topology.mode=disaggregated, topology.target_tp, train.fsdp); None: plan every layout."""
    tp = args.target_tp or cfg.topology.target_tp
    fsdp = args.fsdp or cfg.train.fsdp
    ranks = args.target_ranks or (cfg.topology.num_target_ranks if cfg.topology.mode == "disaggregated" else None)
    if args.target_tp is None and ranks is None and tp == 1 and not fsdp:
        return None
    return Layout(args.gpus, "disaggregated" if ranks else "colocated", ranks, tp, fsdp, args.nodes)


def best_line(plan: MemoryPlan) -> str:
    """The last line of a plan that fits: the best layout, its options and its settings."""
    lay = plan.layout
    settings = [f"topology.mode={lay.mode}"] + ([f"topology.num_target_ranks={lay.target_ranks}"]
                                                if lay.mode == "disaggregated" else [])
    settings += [f"topology.target_tp={lay.target_tp}", f"train.fsdp={str(lay.fsdp).lower()}"]
    return (f"best: {lay.name()}, peak {gib(plan.peak)} of {gib(plan.usable)} GiB usable per GPU "
            f"({layout_flags(lay)}; in a run: {' '.join(settings)})")
