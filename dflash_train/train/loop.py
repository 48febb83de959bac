"""The training run: `build(cfg) -> Run`, which declares every part of a rank, and its two loops.

Owns building a run from the config (the data, its validation split and its batch plan, the
target or its heads, the drafter, the producer and the drafter step, transport, stop control,
checkpoints, compilation) and the loops: `train_drafter` (a drafter rank, or a colocated rank,
or the single process) takes one step after another and holds the cadence in plain
`step % every == 0` checks: log (the one host sync of an interval), evaluate (walked tau on
the validation split, served tau on prompts), checkpoint, export at the end (the best walked
tau's checkpoint with checkpoint.keep_best); `train_target` (a target rank of a disaggregated
run) makes and sends the micro-batches of the steps ahead, joining each step's stop agreement
and checkpoint when it falls due.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch
from transformers import AutoConfig

from dflash_train.core import locks
from dflash_train.core.assets import atomic_write_lines
from dflash_train.core.config import BUNDLED_DATA, Config, ConfigError, dump_yaml, to_dict
from dflash_train.core.devices import resolve_device
from dflash_train.core.drafter import (
    DFlashDrafter,
    build_drafter_config,
    mask_token_string,
    resolve_mask_token_id,
    set_mask_token,
)
from dflash_train.core.errors import UserError, folder_problem, problems_of
from dflash_train.core.export import drafter_config, export_drafter, load_drafter
from dflash_train.core.loss import LossSettings
from dflash_train.core.locks import command_line
from dflash_train.core.target import (
    Target,
    TargetHeads,
    load_target,
    load_tokenizer,
    resolve_target_path,
    tensor_parallel_problems,
)
from dflash_train.data import chat_files, preparation
from dflash_train.data.batching import BatchPlan, BatchStream, conversation_keys, one_version_each, validation_split
from dflash_train.data.preparation import LOOP_REPEATS, without_loop_tails
from dflash_train.train.checkpoint import (
    CHECKPOINTS,
    DRAFTER_CONFIG,
    SHARDED,
    BestCheckpoint,
    CheckpointManager,
    DataPosition,
    GlobalSums,
    RngState,
    checkpoint_root,
    drafter_from_checkpoint,
    list_checkpoints,
    settings_check,
)
from dflash_train.train.compilation import Compilation, fp8_linear_layers
from dflash_train.train.control import Control, DeferredSkips, Stop, TrainingStopped
from dflash_train.train.dist import Assignment, Dist
from dflash_train.train.faults import Faults
from dflash_train.train.graphed_target import GraphedTarget
from dflash_train.train.metrics import (
    Accumulator,
    MetricsSink,
    NullSink,
    StageTimer,
    WandbRun,
    peak_memory_gib,
    quiet_progress_bars,
)
from dflash_train.train.plot import report_run
from dflash_train.train.produce import FeatureNoise, Packing, Producer
from dflash_train.train.sharding import ShardedState, Sharding
from dflash_train.train.step import DrafterStep, StepSetup
from dflash_train.train.transport import Receiver, Sender


def check_inputs(cfg: Config) -> None:
    """What needs nothing heavy, checked before anything is loaded, every problem at once (one
    ConfigError): the output folder (and data.cache_dir) can be written, the data paths exist and
    hold chat files, the target folder is a usable model (its config, tokenizer and weight
    files), drafter.init_from is a DFlash drafter folder for that target (config files alone),
    the device is there, and a run already in output_dir was trained with settings this run
    may resume with (checkpoint.settings_check)."""

    problems = []
    for name, folder in (("output_dir", cfg.output_dir), ("data.cache_dir", cfg.data.cache_dir)):
        problem = folder_problem(folder) if folder else None
        if problem:
            problems.append(f"{name} {folder}: {problem}: choose a folder you can write in")
    for folder in data_folders_holding(cfg.data.paths, Path(cfg.output_dir)):
        problems.append(f"output_dir {cfg.output_dir} is inside data.paths folder {folder}: the run's files there "
                        f"(validation.jsonl: its held-out conversations; metrics.jsonl) would be read as data by the "
                        f"next run; choose an output_dir outside it")
    problem = run_folder_problem(cfg.output_dir, with_data_cache=not cfg.data.cache_dir)
    if problem:
        problems.append(problem)
    paths = cfg.data.paths
    if BUNDLED_DATA in paths and len(paths) > 1:
        problems.append(f"data.paths: '{BUNDLED_DATA}' cannot be mixed with files")
    elif paths != [BUNDLED_DATA] and not (len(paths) == 1 and preparation.is_prepared_folder(Path(paths[0]))):
        for path in paths:
            try:
                chat_files.data_files([path])
            except UserError as err:
                problems.append(f"data.paths: {err} (give chat files, folders of them, a folder written by "
                                f"`dflash-train data prepare`, or '{BUNDLED_DATA}')")
    target = problems_of(lambda: resolve_target_path(cfg.target.path))
    problems += target + problems_of(lambda: resolve_device(cfg.train.device))
    if cfg.drafter.init_from:
        target_config = None if target else AutoConfig.from_pretrained(resolve_target_path(cfg.target.path))
        problems += problems_of(lambda: drafter_config(cfg.drafter.init_from, "drafter.init_from", target_config))
    if problems:
        raise ConfigError(problems)
    newest = list_checkpoints(cfg.output_dir)
    if newest:  # a run is there: this one resumes it (the checkpoint resume takes is checked again)
        settings_check(cfg, newest[-1])


def load_data(cfg: Config, target_dir: Path, log=print):
    """The prepared dataset (cached) for the configured chat data, whole: before the validation
    split and data.limit (`split_data`)."""
    if len(cfg.data.paths) == 1 and preparation.is_prepared_folder(Path(cfg.data.paths[0])):
        # A folder written by `dflash-train data prepare` (or a trainer's cache) is used as is.
        dataset = preparation.load_prepared(cfg.data.paths[0])
        log(f"data: {len(dataset)} prepared samples from {cfg.data.paths[0]}")
        return dataset
    if cfg.data.paths == [BUNDLED_DATA]:
        prepared = preparation.default_dataset(target_dir, max_length=cfg.data.max_length, log=log,
                                               max_record_bytes=cfg.data.max_record_bytes)
    else:
        out = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.output_dir) / "data"
        prepared = preparation.prepare(cfg.data.paths, target_dir, out, max_length=cfg.data.max_length,
                                       overlong=cfg.data.overlong, log=log,
                                       max_record_bytes=cfg.data.max_record_bytes)
    if len(prepared.dataset) == 0:
        raise ConfigError([f"data.paths: {preparation.no_samples(prepared)}"])
    return prepared.dataset


def split_data(cfg: Config, dataset, log=print, limit: bool = True):
    """(training samples, validation samples or None): the conversations `data.validation`
    holds out (batching.validation_split, chosen from the whole data so that data.limit does
    not move it), then the first data.limit training samples (`limit`)."""
    validation = None
    if cfg.data.validation:
        keys = conversation_keys(dataset)
        try:
            train_idx, val_idx = validation_split(keys, cfg.data.validation, cfg.data.validation_seed)
        except ValueError as err:
            raise ConfigError([str(err)]) from err
        walked, versions = one_version_each(dataset, val_idx, keys)
        if len(walked):
            validation = dataset.select(walked)
        if len(val_idx):
            dataset = dataset.select(train_idx)
        measured = f"walked every {cfg.eval.every} steps" if cfg.eval.every else "not measured: eval.every is 0"
        log(f"data: {len({keys[i] for i in val_idx})} conversations ({len(walked)} samples) held out for "
            f"validation (data.validation={cfg.data.validation:g}; {measured}), {len(dataset)} samples for training"
            + (f"; {versions} samples of theirs from other versions of a held-out conversation (sampled replies, "
               f"records of the same opening) neither walked nor trained on" if versions else ""))
    if limit and cfg.data.limit is not None and cfg.data.limit < len(dataset):
        dataset = dataset.select(range(cfg.data.limit))
    if cfg.objective.loop_tails == "skip":  # the training samples only: validation keeps every token

        dataset, cut, supervised = without_loop_tails(dataset)
        log(f"data: objective.loop_tails=skip: {cut} of {supervised} supervised tokens "
            f"({100 * cut / max(1, supervised):.1f}%) lie in loops past their first {LOOP_REPEATS} periods "
            "and are not supervised")
    return dataset, validation


VALIDATION_FILE = "validation.jsonl"


def write_validation_prompts(path: Path, validation, log=print) -> None:
    """The held-out conversations as one JSONL file that both evaluations read: {"id": its
    file:line, "turns": its user turns and "system": its system message if it opens with one
    (`eval --prompts FILE` serves them), "messages": the whole conversation (`eval --walk FILE`
    walks it)}, so that served and walked tau can be had on the very prompts the run validates
    on. Samples built in code (no source) are not written."""
    if "source" not in validation.column_names:
        return
    sources = list(dict.fromkeys(validation["source"]))
    if path.is_file():  # a resumed run: the same split, already written (the data files are not read again)
        with open(path, encoding="utf-8") as f:
            if [json.loads(line).get("id") for line in f] == sources:
                return

    records = preparation.records_at(sources)
    entries = []
    for record in records:
        turns = [m["content"] for m in record.messages if m["role"] == "user"]
        entry = {"id": f"{record.file}:{record.line}", "turns": turns, "messages": record.messages}
        first = record.messages[0]
        if first["role"] == "system":  # served as the walk renders it, not with the template's default
            entry["system"] = first["content"]
        entries.append(json.dumps(entry, ensure_ascii=False) + "\n")
    atomic_write_lines(path, entries)
    missing = f"; {len(sources) - len(records)} not found in their files (moved or changed?)" \
        if len(records) < len(sources) else ""
    log(f"data: the {len(records)} held-out records -> {path} (eval --prompts / --walk read it){missing}")


def build_drafter(cfg: Config, target_config, tokenizer) -> DFlashDrafter:
    """A new drafter for the target, or `init_from` checked against it; all problems at once."""
    d = cfg.drafter
    vocab_rows = int(target_config.get_text_config().vocab_size)
    if d.init_from:
        drafter_config(d.init_from, "drafter.init_from", target_config)
        return load_drafter(d.init_from, "drafter.init_from")
    try:
        mask_id = resolve_mask_token_id(tokenizer, vocab_rows, d.mask_token_id)
        dcfg = build_drafter_config(
            target_config, num_layers=d.num_layers, block_size=d.block_size, mask_token_id=mask_id,
            target_layer_ids=d.target_layer_ids, num_taps=d.num_taps, sliding_window=d.sliding_window,
            layer_types=d.layer_types, intermediate_size=d.intermediate_size,
        )
    except ValueError as err:
        raise ConfigError([str(err)]) from err
    set_mask_token(dcfg, mask_token_string(tokenizer, mask_id))
    return DFlashDrafter(dcfg)


def distill_problem(target_config) -> str | None:
    """Why the target's logits are not `final hidden state @ lm_head^T` (what distillation
    recomputes), or None: a logit soft cap or scale changes the distribution."""
    text = target_config.get_text_config()
    changed = {}
    if getattr(text, "final_logit_softcapping", None):  # None or 0: no cap
        changed["final_logit_softcapping"] = text.final_logit_softcapping
    for name in ("logits_scaling", "logit_scale"):  # scales (Granite, Cohere)
        if getattr(text, name, None) not in (None, 1.0):
            changed[name] = getattr(text, name)
    if changed:
        found = ", ".join(f"{k}={v}" for k, v in changed.items())
        return (f"the target's logits are modified ({found}), but distillation takes them as its final hidden "
                f"state times the lm_head; use objective.labels=target (its greedy token) instead")
    return None


class Evaluation(Protocol):
    """What an evaluation step measures, on the leader: (walked fields, served fields) of
    `drafter`, the run's drafter as it is now, whole (DrafterStep.whole_drafter).
    eval.during_training.DuringTraining is the project's."""

    def __call__(self, run: "Run", drafter: DFlashDrafter) -> tuple[dict, dict]: ...


@dataclass
class Run:
    """Every part of one rank's run. A part this rank's role lacks is None: a drafter rank of a
    disaggregated run has no producer, a target rank no drafter step; only disaggregated ranks
    have a sender (targets) or a receiver (drafters)."""

    cfg: Config
    dist: Dist
    out: Path
    assign: Assignment
    plan: BatchPlan
    stream: BatchStream
    total_steps: int
    producer: Producer | None
    step: DrafterStep | None
    sender: Sender | None
    receiver: Receiver | None
    control: Control
    checkpoints: CheckpointManager
    faults: Faults
    timer: StageTimer
    log: Callable  # the leader's messages (a no-op elsewhere)
    steps_done: int = 0
    waits_logged: list[float] | None = None
    validation: object | None = None  # the held-out samples (data.validation), or None
    evaluation: Evaluation | None = None  # what an evaluation step measures (eval.during_training)
    best: BestCheckpoint | None = None  # checkpoint.keep_best: the best walked tau so far


def intra_op_threads(setting: int | None, device: torch.device) -> int | None:
    """train.num_threads resolved for a run's device: the setting, else 1 on a GPU (the host's
    CPU tensor work is small bookkeeping whose parallel regions stall when the host is busy:
    docs/PERFORMANCE.md) and torch's choice (None) on CPU."""
    if setting:
        return setting
    return 1 if device.type == "cuda" else None


def build(cfg: Config, log=print, *, target_config=None, build_target=None, build_heads=None, dataset=None,
          checkpointing: bool = True, dist: Dist | None = None, evaluation: Evaluation | None = None) -> Run:
    """One rank's run from `cfg`. Alone (no torchrun) the rank is target and drafter at once;
    under torchrun it is, by `topology`, a colocated data-parallel replica, a target rank or a
    drafter rank. Benchmarks (bench.harness) replace the target folder and the chat data with
    `target_config` (a transformers config of the target's shape), `build_target(layer_ids,
    labels)` (labels: objective.labels) and `dataset` (rows of input_ids, loss_mask, length);
    there is no tokenizer then, so drafter.mask_token_id must be set, and a drafter rank of a
    disaggregated run calls `build_heads()` (embedding and lm_head, as target.TargetHeads).
    `checkpointing=False`: nothing is resumed or saved, on every rank alike. `dist`: this rank's
    Dist, when the caller made it already (default: from torchrun's environment). `evaluation`:
    what the leader measures every eval.every steps (none: nothing is evaluated). The cheap
    checks of `cfg` (check_inputs) are the caller's: `train` makes them before it owns the folder."""
    assert (target_config is None) == (build_target is None) == (dataset is None), "inject all three or none"
    dist = Dist.from_env(cfg.topology, cfg.train.device) if dist is None else dist
    device, lead_log = dist.device, dist.log_fn(log)
    prefix = f"{dist.name()}: " if dist.world_size > 1 else ""
    log_any = lambda text: log(prefix + text)  # noqa: E731
    threads = intra_op_threads(cfg.train.num_threads, device)
    if threads:
        torch.set_num_threads(threads)
    # Everything cheap and checkable first: config errors surface before heavy loading.
    target_dir, target_config, tokenizer = target_files(cfg, target_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)  # initial weights are a function of the seed alone
        drafter = build_drafter(cfg, target_config, tokenizer)
    stream, validation = build_stream(cfg, dist, dataset, target_dir, tokenizer, lead_log)
    assign = dist.assignment(cfg.train.grad_accum)
    M = assign.micro_per_step
    total_steps = cfg.train.max_steps or cfg.train.epochs * max(1, stream.plan.num_batches // M)
    attention = cfg.train.attention if cfg.train.attention != "auto" else "flex" if device.type == "cuda" else "sdpa"
    compilation = Compilation.decide(cfg, device, attention, head_dim=drafter.config.head_dim)
    faults, timer = Faults(cfg.faults, dist.rank), StageTimer(device)
    noise = FeatureNoise(cfg.objective.noise, cfg.objective.noise_std, cfg.train.seed, device)
    target = producer = step = None
    if dist.is_target:
        labels = cfg.objective.labels
        target = (build_target(drafter.target_layer_ids, labels) if build_target is not None
                  else load_target(cfg.target.path, device, cfg.target.dtype, drafter.target_layer_ids, labels,
                                   dist.tp_mesh)[0])
        packing = Packing(device, cfg.data.token_budget, cfg.topology.split_fc, M, cfg.objective.num_anchors)
        producer = Producer(target, stream, packing, noise=noise, faults=faults, timer=timer, log=log_any,
                            turns=dist.target_turns(assign))
    if dist.is_drafter:
        loss = LossSettings.of(cfg.objective, compilation.loss_chunks, compilation.loss_kernel)
        sharding = Sharding(dist) if cfg.train.fsdp else None
        setup = StepSetup(dist, attention, loss, noise, M, total_steps, faults,
                          Accumulator(drafter.block_size, device), timer, sharding)
        heads = _heads(cfg, device, target, build_target, build_heads)
        step = DrafterStep(cfg, trainable_drafter(cfg, drafter, device, lead_log, sharding), heads, setup)
    compilation.apply(drafter=step.drafter if step is not None else None, target=target)
    # A tensor-parallel target's forward holds its group's collectives: it runs eagerly.
    if producer is not None and device.type == "cuda" and cfg.target.cuda_graphs and isinstance(target, Target) \
            and not target.sharded:
        producer.target = GraphedTarget(target, device, log_any)  # captured in warm_up
    control = Control(cfg.train, dist, M)
    best = BestCheckpoint() if cfg.checkpoint.keep_best and step is not None else None
    checkpoints = _checkpoint_manager(cfg, dist, DataPosition(stream, assign), step, control, faults,
                                      checkpointing, lead_log, best)
    disaggregated = dist.disaggregated
    return Run(cfg, dist, Path(cfg.output_dir), assign, stream.plan, stream, total_steps, producer, step,
               Sender(dist, cfg.topology.queue_depth) if disaggregated and dist.is_producer else None,
               Receiver(dist) if disaggregated and dist.is_drafter else None,
               control, checkpoints, faults, timer, lead_log,
               validation=validation, best=best, evaluation=evaluation)


def target_files(cfg: Config, target_config=None):
    """(the target's folder, its transformers config, its tokenizer) read from target.path; with
    an injected `target_config` (benchmarks), no folder and no tokenizer. Distillation's
    requirement on the target's logits, and topology.target_tp's on its model type and sizes,
    are checked here, before anything heavy."""
    target_dir = tokenizer = None
    if target_config is None:
        target_dir = resolve_target_path(cfg.target.path)
        target_config = AutoConfig.from_pretrained(target_dir)
        tokenizer = load_tokenizer(target_dir)
    problems = tensor_parallel_problems(target_config, cfg.topology.target_tp)
    problem = distill_problem(target_config) if cfg.objective.labels == "distill" else None
    if problem:
        problems.append(f"objective.labels=distill: {problem}")
    if problems:
        raise ConfigError(problems)
    return target_dir, target_config, tokenizer


def build_stream(cfg: Config, dist: Dist, dataset, target_dir, tokenizer, log) -> tuple[BatchStream, object]:
    """The training batches (prepared from data.paths, or the injected `dataset`) and the
    held-out validation samples (None without a split); the leader writes the held-out prompts."""
    loaded = dataset is None
    dataset = load_data(cfg, target_dir, log) if loaded else dataset
    dataset, validation = split_data(cfg, dataset, log, limit=loaded)
    if validation is not None and dist.is_leader:
        write_validation_prompts(Path(cfg.output_dir) / VALIDATION_FILE, validation, log)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    stream = BatchStream(dataset, batch_plan(cfg, dataset["length"]), pad_id=0 if pad_id is None else pad_id)
    return stream, validation


def trainable_drafter(cfg: Config, drafter: DFlashDrafter, device, log,
                      sharding: Sharding | None = None) -> DFlashDrafter:
    """The drafter on the device in float32, training; with train.fp8, its linear layers'
    products in float8; with train.fsdp (`sharding`), sharded over the drafter ranks."""
    drafter = drafter.to(device, torch.float32).train()
    if cfg.train.fp8 is not None:
        converted = fp8_linear_layers(drafter, cfg.train.fp8)
        log(f"train.fp8={cfg.train.fp8}: float8 matrix products in {len(converted)} linear layers of the drafter")
    if sharding is not None:
        sharding.shard(drafter)
        log(f"train.fsdp: the drafter, its gradients and its optimizer state sharded over {sharding.mesh.size()} "
            f"drafter rank(s) (FSDP2: each of its {len(drafter.layers)} layers, then the rest)")
    return drafter


def _heads(cfg: Config, device, target, build_target, build_heads):
    """The target's frozen embedding and lm_head on a drafter rank: the target itself where the
    rank holds it, else the weights alone (a drafter rank of a disaggregated run)."""
    if target is not None:
        return target
    if build_target is None:
        return TargetHeads(cfg.target.path, device, cfg.target.dtype)
    if build_heads is None:
        raise ConfigError(["an injected target (bench) on a drafter rank needs build_heads: the "
                           "embedding and lm_head stand-in of a disaggregated run"])
    return build_heads()


def _checkpoint_manager(cfg: Config, dist: Dist, position: DataPosition, step: DrafterStep | None,
                        control: Control, faults: Faults, enabled: bool, log,
                        best: BestCheckpoint | None = None) -> CheckpointManager:
    """The stateful parts of this rank, declared: a target rank holds none of the drafter's."""
    out = Path(cfg.output_dir)
    parts = {"drafter": None, "optimizer": None, "scheduler": None, "metrics": None, "control": control,
             "rng": RngState(dist.device)}
    if best is not None:
        parts["best"] = best
    if step is not None:
        parts.update(drafter=step.drafter, optimizer=step.optimizer, scheduler=step.scheduler,
                     metrics=GlobalSums(step.acc, dist))
    if step is not None and step.sharding is not None:  # train.fsdp: the two in sharded files
        parts.update(drafter=None, optimizer=None)
        parts[SHARDED] = ShardedState(step.sharding, step.drafter, step.optimizer)

    def texts() -> dict[str, str]:  # called on the leader, a drafter rank
        return {"config.yaml": (out / "config.yaml").read_text(),
                DRAFTER_CONFIG: step.drafter.config.to_json_string(use_diff=False)}

    manager = CheckpointManager(out, cfg.checkpoint, dist, position, parts, texts, faults, enabled=enabled, log=log)
    manager.settings_check = lambda found: settings_check(cfg, found)
    return manager


def batch_plan(cfg: Config, lengths) -> BatchPlan:
    """Which samples (by their lengths) form which batch of each epoch, as the config says."""
    d = cfg.data
    return BatchPlan(lengths, token_budget=d.token_budget, max_batch_size=d.max_batch_size,
                     boundaries=d.bucket_boundaries, num_buckets=d.num_buckets, seed=cfg.train.seed)


# --------------------------------------------------------------------------- drafter ranks


def train_drafter(run: Run) -> Path | None:
    """Train to the end (or a stop), then export; returns the exported drafter folder (None on
    ranks other than the leader; the checkpoints folder after a signal)."""
    begin(run)
    sink = MetricsSink(run.out, run.cfg.log, to_dict(run.cfg), run.total_steps, run.steps_done) \
        if run.dist.is_leader else NullSink()
    skips, stop = DeferredSkips(run.control, sink.event), None
    try:
        with run.control:
            while run.steps_done < run.total_steps and stop is None:
                result = take_step(run)
                n = run.steps_done
                sink.progress()
                skips.add(result, read_now=is_record_step(run, n))
                run.faults.after_step(n)
                stop = run.control.agree(n, result)
                if stop is not None:
                    skips.flush()  # the state saved on a stop counts it
                else:
                    fit_schedule(run, n, sink)
                # Not on a signal: the interval's sums are saved and the resumed run logs them.
                if n % run.cfg.log.every == 0 or n == run.total_steps or stop not in (None, Stop.SIGNAL):
                    log_step(run, n, stop, sink)
                stop = save_or_stop(run, n, stop, sink)
            end_loop(run, stop, sink)
    finally:
        sink.close()
    return export_result(run, stop)


def fit_schedule(run: Run, n: int, sink) -> None:
    """After step n, at the fitting steps (a collective of the drafter ranks): the learning rate's
    schedule made to end where train.max_time_s will (Control.fit_to_time), and said."""
    end = run.control.fit_to_time(n, run.total_steps)
    if end is None:
        return
    warmup = run.step.schedule.fitted_warmup(end, n)
    shortened = warmup < run.step.schedule.warmup
    if shortened:
        run.control.warmup = warmup
    run.step.end_schedule_at(end, warmup)
    sink.end_at(end)
    sink.event(f"train.max_time_s={run.cfg.train.max_time_s:g}: at this pace, the learning rate's schedule and the "
               f"run now end at step {end} of {run.total_steps}"
               f"{f', its warm-up at step {warmup}' if shortened else ''}" if end < run.total_steps else
               f"train.max_time_s={run.cfg.train.max_time_s:g}: at this pace, the schedule's {run.total_steps} steps "
               f"fit again")


def begin(run: Run) -> None:
    """Resume where a checkpoint is, warm up, and write the run's config.yaml (the leader)."""
    resume(run)
    end = run.control.resumed(run.steps_done)
    if run.step is not None:
        run.step.end_schedule_at(min(end or run.total_steps, run.total_steps), run.control.warmup)
    warm_up(run)  # resumed or not: compiled shapes, and on CUDA the target's graphs
    if run.dist.is_leader:  # after resume: a refused checkpoint leaves the folder as it was
        run.out.mkdir(parents=True, exist_ok=True)
        write_config(run)


HISTORY = "# resumed at step "  # the comment lines of config.yaml that keep its settings' history


def write_config(run: Run) -> None:
    """OUTPUT/config.yaml: this run's settings, under comment lines that keep the history of the
    settings changed on each resume (`# resumed at step N: optim.lr 0.001 -> 0.0003`), so the
    file still loads as a --config."""
    path = run.out / "config.yaml"
    history = [line for line in path.read_text().splitlines(keepends=True) if line.startswith(HISTORY)] \
        if path.is_file() and run.steps_done else []
    if run.checkpoints.changes:
        history.append(f"{HISTORY}{run.steps_done}: {', '.join(map(str, run.checkpoints.changes))}\n")
    dump_yaml(run.cfg, path)
    if history:
        path.write_text("".join(history) + path.read_text())


def is_record_step(run: Run, n: int) -> bool:
    """Steps whose records must be exact: log, last and checkpoint steps."""
    return n % run.cfg.log.every == 0 or n == run.total_steps or run.checkpoints.due(n)


def log_step(run: Run, n: int, stop: Stop | None, sink) -> None:
    """The log record of step n, evaluated every eval.every steps and at the end (the last step
    or the time box), so the weights a run ends with are measured and keep_best can choose them."""
    every = run.cfg.eval.every
    last = n == run.total_steps or stop is Stop.TIME
    record = log_record(run, evaluate=bool(every) and (n % every == 0 or last))
    sink.log(record)
    # keep_best: evaluation steps are checkpoint steps (config check) or the last step (saved
    # after the loop), so a checkpoint holds these weights and this best.
    if run.best is not None and run.best.offer(n, record.get("walked_tau")):
        sink.event(f"step {n}: best walked tau so far, {run.best.value:.3f}; its checkpoint is kept")


def save_or_stop(run: Run, n: int, stop: Stop | None, sink) -> Stop | None:
    """After step n: a fault stop saves the last good state and raises; a due checkpoint is
    saved (a signal during the save stops the run); returns the stop, if any."""
    control, checkpoints = run.control, run.checkpoints
    if stop is not None and stop.is_fault:
        saved = checkpoints.save(n)
        drain(run)
        raise TrainingStopped(f"stopped: {control.explain(stop, saved)}")
    if checkpoints.due(n):
        checkpoints.save(n)
        if stop is None and control.signalled_after_save(n):
            stop = Stop.SIGNAL
    if stop is Stop.TIME and run.control.at_end(n):
        sink.event(f"step {n}: the end of the learning rate's schedule fitted to train.max_time_s="
                   f"{run.cfg.train.max_time_s:g}; the run ends ({run.total_steps} steps would not fit)")
    elif stop is Stop.TIME and n < run.total_steps:
        sink.event(f"train.max_time_s={run.cfg.train.max_time_s:g} reached: the run ends at step {n} of "
                   f"{run.total_steps}")
    return stop


def end_loop(run: Run, stop: Stop | None, sink) -> None:
    """The last state saved (after a signal: what was saved, where, and the command that
    resumes) and the transport drained."""
    if run.checkpoints.saved_step != run.steps_done:
        run.checkpoints.save(run.steps_done)
    if stop is Stop.SIGNAL:
        saved = checkpoint_root(run.out) / f"step-{run.steps_done}"
        sink.event(f"{run.control.cause()} received: the run stopped after step {run.steps_done} of "
                   f"{run.total_steps} and saved its checkpoint {saved} (weights, optimizer, data position); "
                   f"the same command resumes from it: {command_line()}")
    drain(run)


def export_result(run: Run, stop: Stop | None) -> Path | None:
    """The leader exports the drafter (keep_best: the best walked step's weights) and reports
    the run; a signal leaves the checkpoints to resume from."""
    if stop is Stop.SIGNAL:
        return run.out / "checkpoints"
    # train.fsdp: gathered on the leader's CPU, every drafter rank taking part (no whole copy on its GPU)
    drafter = run.step.whole_drafter(on_device=False)
    if not run.dist.is_leader:
        return None
    best = run.best.step if run.best is not None else None
    if best is not None and best != run.steps_done:
        drafter = drafter_from_checkpoint(checkpoint_root(run.out) / f"step-{best}")
    exported = export_drafter(drafter, run.out / "drafter", getattr(torch, run.cfg.checkpoint.export_dtype))
    report_run(run.out, exported, run.log)  # the summary says which step's weights were exported
    return exported


def take_step(run: Run, watch=None):
    """One optimizer step of a drafter rank: `run.step` on this rank's micro-batches of the next
    step (passed through `watch(shipments)` when given: benchmarks count the work), then the
    step is done. Returns the step.StepResult."""
    shipments = micro_batches(run)
    result = run.step(shipments if watch is None else watch(shipments))
    run.steps_done += 1
    return result


def micro_batches(run: Run):
    """This drafter rank's micro-batches of the next step, made here (colocated) or received from
    their target ranks (disaggregated), one at a time: the next is asked for only after the
    previous one's backward."""
    for index in run.assign.consumed(run.steps_done, run.dist.drafter_index):
        if run.receiver is None:
            yield run.producer(index)
        else:
            run.timer.mark("receive")
            yield run.receiver.recv(run.dist.producers[run.assign.producer(index)], index)


def drain(run: Run) -> None:
    """After a stop at step k, receive (and drop) what the targets had already produced for the
    steps after k (they run up to `lag` steps ahead), so no send is left hanging."""
    if run.receiver is None:
        return
    last = min(run.steps_done + run.dist.lag(run.assign), run.total_steps)
    for step in range(run.steps_done, last):
        for index in run.assign.consumed(step, run.dist.drafter_index):
            run.receiver.recv(run.dist.producers[run.assign.producer(index)], index)


def log_record(run: Run, evaluate: bool) -> dict:
    """The log step's record; with several drafter ranks, their sums are added up first (a
    collective: every drafter rank calls this at the same steps). `evaluate`: add tau of the
    current drafter on the held-out prompts (the leader; its time is kept out of the next
    interval's throughput)."""
    d, step, acc, n = run.dist, run.step, run.step.acc, run.steps_done
    if len(d.drafter_ranks) > 1:
        acc.all_reduce(lambda t: d.all_reduce_drafters([t], f"waiting for the metrics all-reduce of step {n}"))
    record = {"step": n, "epoch": run.stream.epoch_of(n * run.assign.micro_per_step - 1),
              "lr": step.scheduler.get_last_lr()[0]}
    record.update(acc.flush())
    record["stage_s"] = run.timer.flush()
    record["skipped_total"] = run.control.total_skipped
    if run.receiver is not None:
        record["wait_s"] = transport_waits(run)
    record["peak_memory_gib"] = peak_memory_gib(d.device)
    drafter = step.whole_drafter() if evaluate and run.evaluation is not None else None  # fsdp: every rank
    if drafter is not None and d.is_leader:
        walked, served = run.evaluation(run, drafter)
        record = {"step": record.pop("step"), "epoch": record.pop("epoch"), **walked, **record, **served}
        acc.reset()  # just flushed: only its clock moves
    return record


def transport_waits(run: Run) -> dict:
    """Seconds of the interval each drafter rank waited for batches (a starving drafter) and each
    target rank waited for a free send slot (a blocked target), as lists by drafter / target
    index. A target's figure arrives in its headers, so it is as of the last batch it sent to any
    drafter."""
    d = run.dist
    D, T = len(d.drafter_ranks), len(d.producers)
    cumulative = torch.zeros(D + T, dtype=torch.float64, device=d.device)
    cumulative[d.drafter_index] = run.receiver.wait_s
    for target, us in run.receiver.sender_wait_us.items():
        cumulative[D + target] = us / 1e6
    d.all_reduce_drafters([cumulative], f"waiting for the wait-time all-reduce of step {run.steps_done}", op="max")
    values = cumulative.tolist()  # host sync: log step only
    previous = run.waits_logged or [0.0] * (D + T)
    run.waits_logged = values
    delta = [round(v - p, 4) for v, p in zip(values, previous)]
    return {"drafter_recv": delta[:D], "target_send": delta[D:]}


# --------------------------------------------------------------------------- target ranks


def train_target(run: Run, on_step=None) -> None:
    """A target rank of a disaggregated run: make and send the micro-batches of steps step+1,
    step+2, ..., at most `lag` steps ahead of the drafters, joining each step's stop agreement
    (and checkpoint) when it falls due. `on_step(step)` (bench) is called after the micro-batches
    of each 1-based step have been handed to the sender."""
    resume(run)
    warm_up(run)
    lag, me = run.dist.lag(run.assign), run.dist.target_index
    joined, stop = run.steps_done, None  # agreements of drafter steps 1..joined are done
    with run.control:
        for step in range(run.steps_done + 1, run.total_steps + 1):
            while stop is None and joined < step - lag - 1:
                joined += 1
                stop = target_agree(run, joined)
            if stop is not None:
                break
            for index in run.assign.produced(step - 1, me):
                if run.sender is None:  # a target group's other ranks only join its forwards
                    run.producer.join(index)
                    continue
                shipment = run.producer(index)
                run.timer.mark("send")
                run.sender.send(run.dist.drafter_ranks[run.assign.consumer(index)], shipment)
            run.timer.mark(None)
            if on_step is not None:
                on_step(step)
            run.faults.after_step(step)
        while stop is None and joined < run.total_steps:
            joined += 1
            stop = target_agree(run, joined)
        if run.sender is not None:
            run.sender.flush()
    run.steps_done = joined
    if stop is not None and stop.is_fault:
        raise TrainingStopped(f"stopped with the drafter ranks at step {joined} (their message says why)")


def target_agree(run: Run, step: int) -> Stop | None:
    """A target rank's part in the agreement (and checkpoint) after drafter step `step`, in the
    order the drafter ranks take them."""
    stop = run.control.agree(step)
    if run.checkpoints.due(step) or stop is not None or step == run.total_steps:
        run.checkpoints.save(step)
    if stop is None and run.checkpoints.due(step) and run.control.signalled_after_save(step):
        stop = Stop.SIGNAL
    return stop


# --------------------------------------------------------------------------- both


def resume(run: Run) -> bool:
    """Continue from the newest good checkpoint, if any; settings changed since it was saved
    (only those a resumed run may change: checkpoint.settings_check) are applied and logged."""
    step = run.checkpoints.resume()
    if step is not None:
        run.steps_done = step
        changes = run.checkpoints.changes
        if changes:
            run.log(f"resumed with changed settings, applied from step {step}: {', '.join(map(str, changes))}")
            if run.step is not None:
                run.step.apply_settings(run.cfg.optim)
    return step is not None


def warm_up(run: Run) -> None:
    """The target once on every batch shape of the plan (CUDA: allocator, kernels, compiled graphs,
    the target's CUDA graphs with target.cuda_graphs, and any out-of-memory surface before the
    first step; CPU has nothing to warm)."""
    if run.dist.device.type != "cuda" or run.producer is None:
        return
    started = time.perf_counter()
    run.producer.warm_up(run.plan.shapes)
    torch.cuda.synchronize(run.dist.device)
    target = run.producer.target
    captured = f", {len(target.steps)} of them captured as CUDA graphs" if isinstance(target, GraphedTarget) else ""
    run.log(f"warmed up {len(run.plan.shapes)} target shapes in {time.perf_counter() - started:.1f} s{captured}")


RUN_LOCK = ".dflash-train.lock"  # in the run folder: held by the run's first process, left there after it
# What a run writes in its folder (data: the prepared cache, unless data.cache_dir puts it elsewhere).
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "summary.json", VALIDATION_FILE, "eval.json", CHECKPOINTS,
               "drafter", "plots", "tensorboard", "wandb", WandbRun.ID_FILE)


def data_folders_holding(paths: list[str], out: Path) -> list[str]:
    """The folders of `paths` (data.paths) that `out` is, or lies inside: every chat file under
    them is read as data, so the run's own JSONL files written there would be too."""
    where = out.expanduser().resolve()
    return [path for path in paths if path != BUNDLED_DATA and Path(path).expanduser().is_dir()
            and where.is_relative_to(Path(path).expanduser().resolve())]


def run_folder_problem(output_dir: str, with_data_cache: bool) -> str | None:
    """Where a run in `output_dir` would write over files no run wrote: the folder exists, no run
    has held it (no RUN_LOCK), and it holds entries a run writes (a folder of the user's given as
    `output_dir=.`, its config.yaml or validation.jsonl theirs). None for a new folder, one holding
    other files only, or a run's own (resumed or trained further)."""
    out = Path(output_dir)
    if not out.is_dir() or (out / RUN_LOCK).exists():
        return None
    names = RUN_OUTPUTS + (("data",) if with_data_cache else ())
    taken = [name for name in names if (out / name).exists()]
    if not taken:
        return None
    return (f"output_dir {output_dir} holds {', '.join(taken)}, which a run writes, and no run has used it (no "
            f"{RUN_LOCK}): a run there would replace them; choose a new or empty output_dir")


def train(cfg: Config, log=print, evaluation: Evaluation | None = None) -> Path | None:
    """Train the run `cfg` describes, holding its output folder (`run_folder`) from the
    checks to the export."""
    quiet_progress_bars()
    check_inputs(cfg)
    with run_folder(cfg.output_dir, log):
        run = build(cfg, log, evaluation=evaluation)
        try:
            result = train_drafter(run) if run.step is not None else train_target(run)
        finally:
            if run.step is not None and run.step.sharding is not None:
                run.step.sharding.close()  # the process group of a sharded drafter on one process
        run.dist.close()
    return result


@contextlib.contextmanager
def run_folder(output_dir: str, log=print) -> Iterator[None]:
    """The run folder, owned by this run: its first process (global rank 0, or the only one)
    holds OUTPUT/.dflash-train.lock, so a second run on the folder is refused at once, naming
    the holder (locks.hold); the lock of a killed run is taken over. A run refused before it
    wrote anything leaves no folder or lock file behind."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    out = Path(output_dir)
    lock = out / RUN_LOCK
    with locks.discard_if_created(lock, out), locks.hold(
            lock, f"output_dir {out}", "wait for that run to end (the same command then resumes it), or choose "
            "another output_dir", log):
        yield
