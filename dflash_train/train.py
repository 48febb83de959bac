"""The training run: build everything from the config, `train_step`, and the loop cadence.

Owns the order of one optimizer step (DESIGN.md): batch -> target -> pack -> anchors/mask ->
drafter -> loss -> backward -> clip -> step, with gradient accumulation whose loss
normalisation is exact (gradients of summed losses, divided once by the total weight), and a
non-finite guard that leaves weights and optimizer state untouched, and a guard that skips a
micro-batch on which the target forward raised (out of memory on an unusual shape). Logging,
checkpoints and export live in the outer loop behind plain `step % every == 0` checks.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train import checkpoint as ckpt
from dflash_train.compilation import Compilation
from dflash_train.config import BUNDLED_DATA, Config, ConfigError, dump_yaml, to_dict
from dflash_train.dist import Dist
from dflash_train.drafter import DFlashDrafter, build_drafter_config, resolve_mask_token_id
from dflash_train.export import export_drafter
from dflash_train.faults import Faults
from dflash_train.loss import BlockLossOutput, block_loss
from dflash_train.masks import ANCHOR_STREAM, build_attention_masks, build_layout, sample_anchors, step_generator
from dflash_train.metrics import Accumulator, MetricsSink, NullSink, StageTimer, peak_memory_gib
from dflash_train.produce import FeatureNoise, Producer, Shipment, context_features
from dflash_train.target import TargetHeads, load_target, resolve_target_path
from dflash_train.transport import Receiver, Sender


class TrainingStopped(RuntimeError):
    """The run stopped itself (too many non-finite steps or failed target forwards); a
    checkpoint of the last good state was written."""


def cosine_with_warmup(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def load_data(cfg: Config, target_dir: Path, log=print):
    """The prepared dataset (cached) for the configured chat data."""
    from dflash_train import data

    if len(cfg.data.paths) == 1 and data.is_prepared_folder(Path(cfg.data.paths[0])):
        # A folder written by `dflash-train data prepare` (or a trainer's cache) is used as is.
        dataset = data.load_prepared(cfg.data.paths[0])
        log(f"data: {len(dataset)} prepared samples from {cfg.data.paths[0]}")
        return _limit(dataset, cfg)
    if cfg.data.paths == [BUNDLED_DATA]:
        prepared = data.default_dataset(target_dir, max_length=cfg.data.max_length, log=log)
    else:
        if BUNDLED_DATA in cfg.data.paths:
            raise ConfigError([f"data.paths: '{BUNDLED_DATA}' cannot be mixed with files"])
        out = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.output_dir) / "data"
        prepared = data.prepare(cfg.data.paths, target_dir, out, max_length=cfg.data.max_length,
                                overlong=cfg.data.overlong, log=log)
    if len(prepared.dataset) == 0:
        raise ConfigError([f"data.paths: no usable samples (see {prepared.path}/report.json)"])
    return _limit(prepared.dataset, cfg)


def _limit(dataset, cfg: Config):
    if cfg.data.limit is not None and cfg.data.limit < len(dataset):
        return dataset.select(range(cfg.data.limit))
    return dataset


def build_drafter(cfg: Config, target_config, tokenizer) -> DFlashDrafter:
    """A new drafter for the target, or `init_from` checked against it; all problems at once."""
    d = cfg.drafter
    vocab_rows = int(target_config.get_text_config().vocab_size)
    if d.init_from:
        drafter = DFlashDrafter.from_pretrained(d.init_from)
        problems = []
        text = target_config.get_text_config()
        if drafter.config.hidden_size != text.hidden_size:
            problems.append(f"drafter.init_from: hidden size {drafter.config.hidden_size} != target's {text.hidden_size}")
        bad = [i for i in drafter.target_layer_ids if i >= text.num_hidden_layers]
        if bad:
            problems.append(f"drafter.init_from: taps {bad} beyond the target's {text.num_hidden_layers} layers")
        if drafter.mask_token_id >= vocab_rows:
            problems.append(f"drafter.init_from: mask token {drafter.mask_token_id} has no embedding row")
        if problems:
            raise ConfigError(problems)
        return drafter
    try:
        mask_id = resolve_mask_token_id(tokenizer, vocab_rows, d.mask_token_id)
        dcfg = build_drafter_config(
            target_config, num_layers=d.num_layers, block_size=d.block_size, mask_token_id=mask_id,
            target_layer_ids=d.target_layer_ids, num_taps=d.num_taps, sliding_window=d.sliding_window,
            layer_types=d.layer_types, intermediate_size=d.intermediate_size,
        )
    except ValueError as err:
        raise ConfigError([str(err)]) from err
    return DFlashDrafter(dcfg)


@dataclass
class StepResult:
    loss_sum: torch.Tensor
    grad_norm: torch.Tensor
    applied: bool
    failed_batches: int = 0
    """Micro-batches of this rank skipped because the target forward raised."""
    all_failed: bool = False
    """Every micro-batch of the step (on every drafter rank) failed: nothing to learn from."""


class Trainer:
    """One rank of a run. Alone (no torchrun) it is target and drafter at once; under torchrun
    it is, by `topology`, a colocated data-parallel replica, a target rank or a drafter rank."""

    def __init__(self, cfg: Config, log=print, *, target_config=None, build_target=None, dataset=None,
                 build_heads=None) -> None:
        """Builds the run from `cfg`. Benchmarks (bench.py) replace the target folder and the
        chat data with `target_config` (a transformers config of the target's shape),
        `build_target(layer_ids, need_logits) -> Target` and `dataset` (rows of input_ids,
        loss_mask, length); there is no tokenizer then, so drafter.mask_token_id must be set.
        A drafter-only rank of a disaggregated run calls `build_heads()` instead of
        `build_target` (something with `embed(ids)` and `lm_head_weight`, as `TargetHeads`)."""
        from transformers import AutoConfig, AutoTokenizer

        from dflash_train.batching import BatchPlan, BatchStream

        assert (target_config is None) == (build_target is None) == (dataset is None), "inject all three or none"
        self.dist = Dist.from_env(cfg.topology, cfg.train.device)
        self.cfg, self.log = cfg, self.dist.log_fn(log)
        prefix = f"{self.dist.name()}: " if self.dist.world_size > 1 else ""
        self.log_any = lambda text: log(prefix + text)  # noqa: E731 (messages every rank prints)
        self.out = Path(cfg.output_dir)
        self.device = self.dist.device
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        # Everything cheap and checkable first: config errors surface before heavy loading.
        target_dir = tokenizer = None
        if target_config is None:
            target_dir = resolve_target_path(cfg.target.path)
            target_config = AutoConfig.from_pretrained(target_dir)
            tokenizer = AutoTokenizer.from_pretrained(target_dir)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.train.seed)  # initial weights are a function of the seed alone
            drafter = build_drafter(cfg, target_config, tokenizer)
        self.block_size = drafter.block_size
        self.dataset = load_data(cfg, target_dir, self.log) if dataset is None else dataset
        plan = BatchPlan(self.dataset["length"], token_budget=cfg.data.token_budget,
                         max_batch_size=cfg.data.max_batch_size, boundaries=cfg.data.bucket_boundaries,
                         num_buckets=cfg.data.num_buckets, seed=cfg.train.seed)
        pad_id = getattr(tokenizer, "pad_token_id", None)
        self.stream = BatchStream(self.dataset, plan, pad_id=0 if pad_id is None else pad_id)
        self.plan = plan
        self.assign = self.dist.assignment(cfg.train.grad_accum)
        self.split = cfg.topology.split_fc
        if build_target is not None and self.dist.is_target:
            self.target = build_target(drafter.target_layer_ids, cfg.objective.labels == "target")
        elif build_target is not None:
            if build_heads is None:
                raise ConfigError(["an injected target (bench) on a drafter rank needs build_heads: the "
                                   "embedding and lm_head stand-in of a disaggregated run"])
            self.target = build_heads()
        elif self.dist.is_target:
            self.target, _ = load_target(cfg.target.path, self.device, cfg.target.dtype, drafter.target_layer_ids,
                                         need_logits=cfg.objective.labels == "target")
        else:  # a drafter rank needs the target's embedding and lm_head only
            self.target = TargetHeads(cfg.target.path, self.device, cfg.target.dtype)
        steps_per_epoch = max(1, plan.num_batches // self.assign.micro_per_step)
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
        self.drafter = drafter.to(self.device, torch.float32).train() if self.dist.is_drafter else None
        self.mask_token_id = drafter.mask_token_id
        self.attention = cfg.train.attention
        if self.attention == "auto":
            self.attention = "flex" if self.device.type == "cuda" else "sdpa"
        compilation = Compilation.decide(cfg, self.device, self.attention)
        self.compile_loss = compilation.loss_chunks
        compilation.apply(drafter=self.drafter, target=self.target if self.dist.is_target else None)
        if self.dist.is_drafter:
            o = cfg.optim
            self.optimizer = torch.optim.AdamW(
                self.drafter.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                weight_decay=o.weight_decay, fused=self.device.type == "cuda",
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, cosine_with_warmup(self.total_steps, o.warmup_ratio, o.min_lr_ratio))
        self.noise = FeatureNoise(cfg.objective.noise, cfg.objective.noise_std, cfg.train.seed, self.device)
        self.timer = StageTimer(self.device)
        self.acc = Accumulator(self.block_size, self.device)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else torch.autocast("cpu", enabled=False)
        self.faults = Faults(cfg.faults, self.dist.rank)
        self.producer = Producer(self.target, self.stream, device=self.device, noise=self.noise, split_fc=self.split,
                                 pad_to=cfg.data.token_budget, micro_per_step=self.assign.micro_per_step,
                                 faults=self.faults, timer=self.timer, log=self.log_any) if self.dist.is_target else None
        if self.dist.disaggregated:
            self.sender = Sender(self.dist, cfg.topology.queue_depth) if self.dist.is_target else None
            self.receiver = Receiver(self.dist) if self.dist.is_drafter else None
            self.waits_logged = None
        self.step = 0
        # False (bench): no checkpoint is resumed or written and the after-save agreements are
        # skipped; set on every rank alike, so the ranks still agree step by step.
        self.checkpointing = True
        self.saved_step = None
        self.consecutive_skips = 0
        self.total_skipped = 0
        self.consecutive_failures = 0

    # ------------------------------------------------------------------- one step

    def forward_micro_batch(self, s: Shipment) -> BlockLossOutput | None:
        """Drafter side: (concat + noise with split fc layers) -> blocks -> drafter -> loss;
        None when the target failed on the micro-batch (it is skipped)."""
        c = self.cfg
        if s.failed:
            self.consecutive_failures += 1
            self.acc.add_failed_batch()
            return None
        self.consecutive_failures = 0
        self.timer.mark("mask")
        features_TF = context_features(s, self.noise)
        anchors = sample_anchors(s.loss_mask_T, s.doc_lengths, c.objective.num_anchors,
                                 step_generator(c.train.seed, s.index, ANCHOR_STREAM, device=self.device),
                                 pad_to_multiple=c.train.anchor_multiple, pow2_buckets=True)
        layout = build_layout(anchors, s.loss_mask_T, s.doc_lengths, self.block_size)
        masks = build_attention_masks(layout, self.drafter.layer_types, self.drafter.config.sliding_window, self.attention)
        self.timer.mark("drafter_forward")
        noise_emb = self.target.embed(layout.block_input_ids(s.input_ids_T, self.mask_token_id))
        with self.autocast:
            hidden = self.drafter(features_TF[None], noise_emb[None], layout.position_ids(), attention_mask=masks)[0]
        out = block_loss(hidden.to(self.target.lm_head_weight.dtype), self.target.lm_head_weight,
                         layout.labels(s.labels_T), layout.valid_NB.flatten(), self.block_size,
                         gamma=c.objective.gamma, chunk_rows=c.objective.lm_head_chunk_rows,
                         compile=self.compile_loss)
        out.loss_sum = self.faults.poison_loss(self.step + 1, out.loss_sum)
        self.acc.add_loss(out)
        self.acc.add_batch(s.num_tokens, s.padded_tokens, s.rows, s.sum_seq_len, s.max_seq_len)
        return out

    def micro_batches(self):
        """This drafter rank's micro-batches of the current step, made here (colocated) or
        received from their target ranks (disaggregated), one at a time: the next is asked for
        only after the previous one's backward."""
        for index in self.assign.consumed(self.step, self.dist.drafter_index):
            if not self.dist.disaggregated:
                yield self.producer(index)
            else:
                self.timer.mark("receive")
                yield self.receiver.recv(self.dist.target_ranks[self.assign.producer(index)], index)

    def train_step(self, micro_batches) -> StepResult:
        """One optimizer step over this rank's micro-batches; skipped if anything is non-finite."""
        loss_sum, weight_sum, used, failed = 0.0, 0.0, 0, 0
        for shipment in micro_batches:
            out = self.forward_micro_batch(shipment)
            if out is None:
                failed += 1
                continue
            self.timer.mark("backward")
            out.loss_sum.backward()
            loss_sum, weight_sum, used = loss_sum + out.loss_sum.detach(), weight_sum + out.weight_sum, used + 1
        self.timer.mark("optimizer")
        used_by_all = None  # several drafter ranks: the micro-batches trained over all of them (device)
        if len(self.dist.drafter_ranks) > 1:
            loss_sum, weight_sum, used_by_all = self.all_reduce_gradients(loss_sum, weight_sum, used)
        finite = False
        if used_by_all is None and used == 0:  # nothing to learn from: weights and optimizer untouched
            loss_sum = grad_norm = torch.zeros((), device=self.device)
            all_failed = True
        else:
            params = [p for p in self.drafter.parameters() if p.grad is not None]
            # Exact mean over all micro-batches: gradients of the summed loss, divided once.
            torch._foreach_div_([p.grad for p in params], torch.clamp(weight_sum, min=1e-12))
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip)
            ok = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
            if used_by_all is None:
                finite, all_failed = bool(ok), False  # host sync: the skip decision
            else:  # the global count is read with the skip decision, in the same host sync
                trained = used_by_all > 0
                finite, any_trained = torch.stack([ok & trained, trained]).tolist()
                all_failed = not any_trained
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.timer.mark(None)
        return StepResult(loss_sum, grad_norm, finite, failed, all_failed=all_failed)

    def all_reduce_gradients(self, loss_sum, weight_sum, used: int):
        """Sum gradients, loss and weight sums and the trained micro-batch counts over the
        drafter ranks (one flat all-reduce; all three sums stay on the device), so that
        dividing by the global weight gives the single-process gradient of the same
        micro-batches. Done once per step after accumulation rather than by DDP's backward hooks:
        DDP averages by the number of ranks (the exact mean needs the weight sum instead) and
        needs every rank to run the same backwards, which a skipped micro-batch breaks."""
        params = list(self.drafter.parameters())
        for p in params:
            if p.grad is None:  # every micro-batch of this rank failed: it adds zeros
                p.grad = torch.zeros_like(p)
        totals = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device)
                              for v in (loss_sum, weight_sum, float(used))])
        self.dist.all_reduce_drafters([p.grad for p in params] + [totals],
                                      f"waiting for the gradient all-reduce of step {self.step + 1}")
        return totals[0], totals[1], totals[2]

    # ------------------------------------------------------------------- the loops

    def run(self) -> Path | None:
        """Train to the end (or a stop), then export; returns the exported drafter folder
        (None on a target rank)."""
        if not self.dist.is_drafter:
            return self.run_target()
        if self.dist.is_leader:
            self.out.mkdir(parents=True, exist_ok=True)
            dump_yaml(self.cfg, self.out / "config.yaml")
        if not self.resume():
            self.warm_up()
        sink = MetricsSink(self.out, self.cfg.log, to_dict(self.cfg), self.total_steps, self.step) \
            if self.dist.is_leader else NullSink()
        stop = ckpt.StopFlag().install()
        deadline = time.perf_counter() + (self.cfg.train.max_time_s or float("inf"))
        signalled = out_of_time = False
        try:
            while self.step < self.total_steps:
                result = self.train_step(self.micro_batches())
                self.step += 1
                self.acc.add_step(result.grad_norm, skipped=not result.applied)
                sink.progress()
                nonfinite_stop = self.track_skips(result, sink)
                self.faults.after_step(self.step)
                signalled, nonfinite_stop, failure_stop, out_of_time = self.agree_stop(
                    stop, nonfinite_stop, self.too_many_failures(), time.perf_counter() >= deadline)
                stopping = nonfinite_stop or failure_stop
                if self.step % self.cfg.log.every == 0 or self.step == self.total_steps or stopping or out_of_time:
                    record = self.log_record()
                    if self.cfg.eval.every and self.step % self.cfg.eval.every == 0 and self.dist.is_leader:
                        record.update(self.evaluate())
                    sink.log(record)
                if stopping:
                    self.stop_on_faults(failure_stop)
                if self.checkpointing and self.step % self.cfg.checkpoint.every == 0:
                    self.save()
                    if not signalled:  # a signal during the save stops the run here, saved
                        signalled = bool(self.dist.agree([stop.requested is not None],
                                                         f"waiting for the other ranks after the save of step {self.step}")[0])
                if signalled:
                    break
                if out_of_time and self.step < self.total_steps:
                    sink.event(f"train.max_time_s={self.cfg.train.max_time_s:g} reached: the run ends at step "
                               f"{self.step} of {self.total_steps}")
                    break
            if signalled:
                cause = stop.requested or "a signal to another rank"
                sink.event(f"{cause} received: saving a checkpoint at step {self.step} and exiting")
            if self.saved_step != self.step:
                self.save()
            self.drain()
        finally:
            stop.restore()
            sink.close()
        if signalled:
            return self.out / "checkpoints"
        if not self.dist.is_leader:
            return None
        exported = export_drafter(self.drafter, self.out / "drafter", getattr(torch, self.cfg.checkpoint.export_dtype))
        self.log(f"drafter exported to {exported}")
        return exported

    def agree_stop(self, stop: ckpt.StopFlag, nonfinite: bool, failures: bool,
                   out_of_time: bool) -> tuple[bool, bool, bool, bool]:
        """Whether every rank stops after this step: a signal to any rank, a fault stop of any
        drafter rank, or train.max_time_s passed on any drafter rank (one small all-reduce over
        the control group; alone: the local flags)."""
        flags = self.dist.agree([stop.requested is not None, nonfinite, failures, out_of_time],
                                f"waiting for the other ranks at the end of step {self.step}")
        return bool(flags[0]), bool(flags[1]), bool(flags[2]), bool(flags[3])

    def drain(self) -> None:
        """After a stop at step k, receive (and drop) what the targets had already produced for
        the steps after k (they run up to `lag` steps ahead), so no send is left hanging."""
        if not self.dist.disaggregated:
            return
        last = min(self.step + self.dist.lag(self.assign), self.total_steps)
        for step in range(self.step, last):
            for index in self.assign.consumed(step, self.dist.drafter_index):
                self.receiver.recv(self.dist.target_ranks[self.assign.producer(index)], index)

    def run_target(self, on_step=None) -> None:
        """A target rank of a disaggregated run: capture and send the batches of steps
        step+1, step+2, ..., at most `lag` steps ahead of the drafters, joining each step's stop
        agreement (and checkpoint) when it falls due. `on_step(step)` (bench) is called after
        the batches of each 1-based step have been handed to the sender."""
        self.resume()
        self.warm_up()
        stop = ckpt.StopFlag().install()
        lag, me = self.dist.lag(self.assign), self.dist.target_index
        joined, outcome = self.step, None  # agreements of drafter steps 1..joined are done
        try:
            for step in range(self.step + 1, self.total_steps + 1):
                while outcome is None and joined < step - lag - 1:
                    joined += 1
                    outcome = self.target_agree(joined, stop)
                if outcome is not None:
                    break
                self.step = step - 1
                for index in self.assign.produced(step - 1, me):
                    consumer = self.dist.drafter_ranks[self.assign.consumer(index)]
                    shipment = self.producer(index)
                    self.timer.mark("send")
                    self.sender.send(consumer, shipment)
                self.timer.mark(None)
                if on_step is not None:
                    on_step(step)
                self.faults.after_step(step)
            while outcome is None and joined < self.total_steps:
                joined += 1
                outcome = self.target_agree(joined, stop)
            self.sender.flush()
        finally:
            stop.restore()
        if outcome == "fault":
            raise TrainingStopped(f"stopped with the drafter ranks at step {joined} (their message says why)")
        return None

    def target_agree(self, step: int, stop: ckpt.StopFlag) -> str | None:
        """A target rank's part in the agreement (and checkpoint) after drafter step `step`."""
        flags = self.dist.agree([stop.requested is not None, 0, 0, 0],
                                f"waiting for the drafter ranks to finish step {step}")
        stopping = any(flags)
        if step % self.cfg.checkpoint.every == 0 or stopping or step == self.total_steps:
            self.save(step)
        if self.checkpointing and step % self.cfg.checkpoint.every == 0 and not stopping:  # the drafters' after-save agreement
            flags[0] = self.dist.agree([stop.requested is not None], f"waiting for the drafter ranks after the "
                                       f"save of step {step}")[0]
        if flags[1] or flags[2]:
            return "fault"
        return "signal" if flags[0] else "time" if flags[3] else None

    def evaluate(self) -> dict:
        """tau of the current drafter on the held-out prompts (docs/EVALUATION.md); the
        evaluation's time is kept out of the next interval's throughput."""
        from dflash_train.evaluate import TrainingEvaluator

        if getattr(self, "evaluator", None) is None:
            self.evaluator = TrainingEvaluator(self.cfg.eval, self.cfg.target, self.device)
        metrics = self.evaluator(self.drafter, self.autocast)
        self.acc.reset()  # just flushed: only its clock moves
        return metrics

    def track_skips(self, result: StepResult, sink) -> bool:
        """Count non-finite steps; True when the run must stop. A step whose micro-batches all
        failed in the target forward is counted by `too_many_failures` instead."""
        if result.applied:
            self.consecutive_skips = 0
            return False
        if result.all_failed:
            return False
        self.consecutive_skips += 1
        self.total_skipped += 1
        sink.event(f"step {self.step}: non-finite loss or gradient; step skipped, weights untouched")
        return self.consecutive_skips >= self.cfg.train.max_consecutive_skips

    def too_many_failures(self) -> bool:
        return self.consecutive_failures >= self.cfg.train.max_consecutive_batch_failures

    def stop_on_faults(self, failures: bool) -> None:
        path = self.save()
        self.drain()
        if failures:
            limit = self.cfg.train.max_consecutive_batch_failures
            count = self.consecutive_failures if self.too_many_failures() else f"{limit} or more"  # another rank's
            raise TrainingStopped(
                f"the target forward failed on {count} consecutive "
                f"micro-batches (limit train.max_consecutive_batch_failures="
                f"{self.cfg.train.max_consecutive_batch_failures}; each failure is logged above with its batch's "
                f"shape); the last good state is saved in {path}. If they ran out of memory, lower "
                f"data.token_budget or data.max_batch_size."
            )
        raise TrainingStopped(
            f"{self.consecutive_skips} consecutive non-finite steps (limit "
            f"train.max_consecutive_skips={self.cfg.train.max_consecutive_skips}); the last good state "
            f"is saved in {path}. Lower optim.lr or check the data and the target."
        )

    def log_record(self) -> dict:
        """The log step's record; with several drafter ranks, their sums are added up first
        (a collective: every drafter rank calls this at the same steps)."""
        if len(self.dist.drafter_ranks) > 1:
            self.acc.all_reduce(lambda t: self.dist.all_reduce_drafters(
                [t], f"waiting for the metrics all-reduce of step {self.step}"))
        record = {"step": self.step, "epoch": self.stream.epoch_of(self.step * self.assign.micro_per_step - 1),
                  "lr": self.scheduler.get_last_lr()[0]}
        record.update(self.acc.flush())
        record["stage_s"] = self.timer.flush()
        record["skipped_total"] = self.total_skipped
        if self.dist.disaggregated:
            record["wait_s"] = self.transport_waits()
        record["peak_memory_gib"] = peak_memory_gib(self.device)
        return record

    def transport_waits(self) -> dict:
        """Seconds of the interval each drafter rank waited for batches (a starving drafter)
        and each target rank waited for a free send slot (a blocked target), as lists by
        drafter / target index. A target's figure arrives in its headers, so it is as of the
        last batch it sent to any drafter."""
        D, T = len(self.dist.drafter_ranks), len(self.dist.target_ranks)
        cumulative = torch.zeros(D + T, dtype=torch.float64, device=self.device)
        cumulative[self.dist.drafter_index] = self.receiver.wait_s
        for target, us in self.receiver.sender_wait_us.items():
            cumulative[D + target] = us / 1e6
        self.dist.all_reduce_drafters([cumulative], f"waiting for the wait-time all-reduce of step {self.step}", op="max")
        values = cumulative.tolist()  # host sync: log step only
        previous = self.waits_logged or [0.0] * (D + T)
        self.waits_logged = values
        delta = [round(v - p, 4) for v, p in zip(values, previous)]
        return {"drafter_recv": delta[:D], "target_send": delta[D:]}

    # ------------------------------------------------------------------- state

    def warm_up(self) -> None:
        """Run the target once on every bucket's largest shape (CUDA: allocator, kernels and any
        out-of-memory surface before the first step; CPU has nothing to warm)."""
        if self.device.type != "cuda" or not self.dist.is_target:
            return
        started = time.perf_counter()
        self.producer.warm_up(self.plan.shapes)
        torch.cuda.synchronize(self.device)
        self.log(f"warmed up {len(self.plan.shapes)} target shapes in {time.perf_counter() - started:.1f} s")

    def cursor_state(self, step: int) -> dict:
        """The data cursor after `step` steps: the next global micro-batch index (the same on
        every rank; each target rank makes the indices the assignment gives it)."""
        return {"next_index": step * self.assign.micro_per_step, "micro_per_step": self.assign.micro_per_step,
                **self.stream.identity()}

    def rank_state(self, step: int) -> dict:
        """What this rank alone holds: its cursor, Python RNG, and as a drafter its interval
        sums and failure count."""
        state = {"rank": self.dist.rank, "role": self.dist.role, "cursor": self.cursor_state(step),
                 "python_rng": list(random.getstate()[1])}
        if self.dist.is_drafter:
            state.update(accumulator=self.acc.state_dict(), consecutive_failures=self.consecutive_failures)
        return state

    def state(self) -> dict:
        state = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "consecutive_skips": self.consecutive_skips,
            "total_skipped": self.total_skipped,
            "topology": self.dist.identity(),
        }
        if self.dist.world_size == 1:
            state.update(self.rank_state(self.step))
        return state

    def rng_state(self) -> dict:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    def save(self, step: int | None = None) -> Path:
        """Checkpoint of `step` (default: the current step). Several ranks: the leader opens a
        shared temporary folder, every rank writes its own rank-R files into it, then the leader
        adds weights, optimizer, scheduler and config and makes it complete (meta.json, rename)."""
        step = self.step if step is None else step
        path = ckpt.checkpoint_root(self.out) / f"step-{step}"
        if not self.checkpointing:
            return path
        tmp = None
        if self.dist.world_size > 1:
            if self.dist.is_leader:
                ckpt.begin_shared(self.out, step)
            self.dist.barrier(f"waiting for the other ranks to start the checkpoint of step {step}")
            tmp = ckpt.shared_tmp(self.out, step)
            ckpt.write_rank_state(tmp, self.dist.rank, self.rng_state(), self.rank_state(step))
            self.dist.barrier(f"waiting for every rank's state of the checkpoint of step {step}")
        if self.dist.is_leader:
            path = ckpt.save_checkpoint(
                self.out, step, self.drafter.state_dict(), self.optimizer.state_dict(),
                self.rng_state() if tmp is None else None, self.state(),
                texts={"config.yaml": (self.out / "config.yaml").read_text(),
                       ckpt.DRAFTER_CONFIG: self.drafter.config.to_json_string(use_diff=False)},
                keep=self.cfg.checkpoint.keep, halfway=self.faults.save_hook(step), tmp=tmp,
            )
            self.faults.after_save(step, path)
        self.saved_step = step
        return path

    def resume(self) -> bool:
        """Restore the newest verified checkpoint, if any; every rank must find the same one."""
        if not self.checkpointing:
            return False
        found = ckpt.find_resumable(self.out, log=self.log) if self.out.is_dir() else None
        step = int(found.name[5:]) if found is not None else -1
        if self.dist.world_size > 1:
            neg_min, most = self.dist.agree([-step, step], "waiting for the other ranks to pick a checkpoint")
            if -neg_min != most:
                raise ckpt.CheckpointError(f"{self.dist.name()}: the ranks found different checkpoints to resume "
                                           f"from (steps {-neg_min} and {most}): is output_dir on a shared file system?")
        if found is None:
            return False
        trainer = json.loads((found / "trainer_state.json").read_text())
        saved_topology = trainer.get("topology", {"mode": "colocated", "world_size": 1, "num_targets": 1,
                                                  "num_drafters": 1})
        if saved_topology != self.dist.identity():
            raise ckpt.CheckpointError(
                f"{found}: written by a run of {saved_topology}, but this run is {self.dist.identity()}: resume "
                f"with the same topology settings and torchrun --nproc_per_node/--nnodes, or use a new output_dir")
        if self.dist.world_size == 1:
            rng, own = None, trainer
        else:
            rng, own = ckpt.load_rank_state(found, self.dist.rank)
        if self.dist.is_drafter:
            saved = ckpt.load_checkpoint(found, self.device)
            self.drafter.load_state_dict(saved["drafter"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(trainer["scheduler"])
            self.consecutive_skips, self.total_skipped = trainer["consecutive_skips"], trainer["total_skipped"]
            self.consecutive_failures = own.get("consecutive_failures", 0)
            self.acc.load_state_dict(own["accumulator"])
            rng = saved["rng"] if rng is None else rng
        self.step = trainer["step"]
        cursor = dict(own["cursor"])
        if cursor.get("micro_per_step") != self.assign.micro_per_step:
            raise ckpt.CheckpointError(f"{found}: saved with {cursor.get('micro_per_step')} micro-batches per step, "
                                       f"now {self.assign.micro_per_step}: keep train.grad_accum and the drafter ranks")
        try:
            next_index = self.stream.check_state(cursor)
        except ValueError as err:
            raise ckpt.CheckpointError(f"{found}: {err}") from err
        assert next_index == self.step * self.assign.micro_per_step  # our own invariant
        state = random.getstate()
        random.setstate((state[0], tuple(own["python_rng"]), state[2]))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.saved_step = self.step
        epoch, position = divmod(next_index, self.plan.num_batches)
        self.log(f"resumed at step {self.step} (epoch {epoch}, batch {position})")
        return True


def train(cfg: Config, log=print) -> Path | None:
    trainer = Trainer(cfg, log)
    result = trainer.run()
    trainer.dist.close()
    return result
