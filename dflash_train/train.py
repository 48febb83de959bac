"""The training run: build everything from the config, `train_step`, and the loop cadence.

Owns the order of one optimizer step (DESIGN.md): batch -> target -> pack -> anchors/mask ->
drafter -> loss -> backward -> clip -> step, with gradient accumulation whose loss
normalisation is exact (gradients of summed losses, divided once by the total weight), and a
non-finite guard that leaves weights and optimizer state untouched, and a guard that skips a
micro-batch on which the target forward raised (out of memory on an unusual shape). Logging,
checkpoints and export live in the outer loop behind plain `step % every == 0` checks.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train import checkpoint as ckpt
from dflash_train.config import BUNDLED_DATA, Config, ConfigError, dump_yaml, to_dict
from dflash_train.drafter import DFlashDrafter, build_drafter_config, resolve_mask_token_id
from dflash_train.faults import Faults
from dflash_train.loss import BlockLossOutput, block_loss
from dflash_train.masks import build_attention_masks, build_layout, sample_anchors, step_generator
from dflash_train.metrics import Accumulator, MetricsSink, StageTimer
from dflash_train.target import SidePacker, load_target, resolve_device, resolve_target_path


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
    """Micro-batches skipped because the target forward raised."""


class Trainer:
    def __init__(self, cfg: Config, log=print, *, target_config=None, build_target=None, dataset=None) -> None:
        """Builds the run from `cfg`. Benchmarks (bench.py) replace the target folder and the
        chat data with `target_config` (a transformers config of the target's shape),
        `build_target(layer_ids, need_logits) -> Target` and `dataset` (rows of input_ids,
        loss_mask, length); there is no tokenizer then, so drafter.mask_token_id must be set."""
        from transformers import AutoConfig, AutoTokenizer

        from dflash_train.batching import BatchCursor, BatchPlan

        assert (target_config is None) == (build_target is None) == (dataset is None), "inject all three or none"
        self.cfg, self.log = cfg, log
        self.out = Path(cfg.output_dir)
        self.device = resolve_device(cfg.train.device)
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
        self.dataset = load_data(cfg, target_dir, log) if dataset is None else dataset
        plan = BatchPlan(self.dataset["length"], token_budget=cfg.data.token_budget,
                         max_batch_size=cfg.data.max_batch_size, boundaries=cfg.data.bucket_boundaries,
                         num_buckets=cfg.data.num_buckets, seed=cfg.train.seed)
        pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        self.cursor = BatchCursor(self.dataset, plan, pad_id=pad_id)
        self.plan = plan
        if build_target is None:
            self.target, _ = load_target(cfg.target.path, self.device, cfg.target.dtype, drafter.target_layer_ids,
                                         need_logits=cfg.objective.labels == "target", compile=cfg.target.compile)
        else:
            self.target = build_target(drafter.target_layer_ids, cfg.objective.labels == "target")
        self.drafter = drafter.to(self.device, torch.float32).train()
        self.attention = cfg.train.attention
        if self.attention == "auto":
            self.attention = "flex" if self.device.type == "cuda" else "sdpa"
        if cfg.train.compile:
            for layer in self.drafter.layers:
                layer.compile()
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
            weight_decay=o.weight_decay, fused=self.device.type == "cuda",
        )
        steps_per_epoch = max(1, self.cursor.batches_per_epoch // cfg.train.grad_accum)
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(self.total_steps, o.warmup_ratio, o.min_lr_ratio))
        self.packer = SidePacker(self.device)
        self.timer = StageTimer(self.device)
        self.acc = Accumulator(self.block_size, self.device)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else torch.autocast("cpu", enabled=False)
        self.faults = Faults(cfg.faults)
        self.step = 0
        self.saved_step = None
        self.consecutive_skips = 0
        self.total_skipped = 0
        self.consecutive_failures = 0

    # ------------------------------------------------------------------- one step

    def capture_target(self, batch) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The target's features for one micro-batch, or None when the target forward raised
        (out of memory on an unusual shape, ...): logged with the batch's shape and counted; the
        cursor has already moved past the batch, so a resumed run skips it too."""
        try:
            self.faults.target_forward(self.step + 1)
            captured = self.target.capture(batch.input_ids.to(self.device, non_blocking=True))
        except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
            failure = f"{type(err).__name__}: {err}"
        else:
            self.consecutive_failures = 0
            return captured
        # Outside the except block: the traceback (and the tensors its frames hold) is gone.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.consecutive_failures += 1
        self.acc.add_failed_batch()
        self.log(f"step {self.step + 1}: target forward failed on batch of shape "
                 f"{tuple(batch.input_ids.shape)}: {failure}; batch skipped")
        return None

    def forward_micro_batch(self, batch, micro: int) -> BlockLossOutput | None:
        """Target -> pack -> blocks -> drafter -> loss for one micro-batch; None when the target
        failed on it (the micro-batch is skipped)."""
        c, gen = self.cfg, step_generator(self.cfg.train.seed, self.step * self.cfg.train.grad_accum + micro, device=self.device)
        self.timer.mark("target")
        captured = self.capture_target(batch)
        if captured is None:
            return None
        feats, greedy = captured
        self.timer.mark("pack")
        packed = self.packer(batch.input_ids, batch.loss_mask, batch.lengths.tolist(), feats, greedy,
                             pad_to=c.data.token_budget, noise=c.objective.noise,
                             noise_std=c.objective.noise_std, generator=gen)
        self.timer.mark("mask")
        anchors = sample_anchors(packed.loss_mask_T, packed.doc_lengths, c.objective.num_anchors, gen,
                                 pad_to_multiple=c.train.anchor_multiple, pow2_buckets=True)
        layout = build_layout(anchors, packed.loss_mask_T, packed.doc_lengths, self.block_size)
        masks = build_attention_masks(layout, self.drafter.layer_types, self.drafter.config.sliding_window, self.attention)
        self.timer.mark("drafter_forward")
        noise_emb = self.target.embed(layout.block_input_ids(packed.input_ids_T, self.drafter.mask_token_id))
        with self.autocast:
            hidden = self.drafter(packed.features_TF[None], noise_emb[None], layout.position_ids(), attention_mask=masks)[0]
        out = block_loss(hidden.to(self.target.lm_head_weight.dtype), self.target.lm_head_weight,
                         layout.labels(packed.labels_T), layout.valid_NB.flatten(), self.block_size,
                         gamma=c.objective.gamma, chunk_rows=c.objective.lm_head_chunk_rows)
        out.loss_sum = self.faults.poison_loss(self.step + 1, out.loss_sum)
        self.acc.add_loss(out)
        self.acc.add_batch(packed.num_tokens, batch.input_ids.numel(), batch.batch_size,
                           int(batch.lengths.sum()), batch.max_seq_len)
        return out

    def train_step(self, batches) -> StepResult:
        """One optimizer step over `grad_accum` micro-batches; skipped if anything is non-finite."""
        loss_sum, weight_sum, failed = 0.0, 0.0, 0
        for micro, batch in enumerate(batches):
            out = self.forward_micro_batch(batch, micro)
            if out is None:
                failed += 1
                continue
            self.timer.mark("backward")
            out.loss_sum.backward()
            loss_sum, weight_sum = loss_sum + out.loss_sum.detach(), weight_sum + out.weight_sum
        self.timer.mark("optimizer")
        finite = False
        if failed == len(batches):  # nothing to learn from: weights and optimizer untouched
            loss_sum = grad_norm = torch.zeros((), device=self.device)
        else:
            params = [p for p in self.drafter.parameters() if p.grad is not None]
            # Exact mean over all micro-batches: gradients of the summed loss, divided once.
            torch._foreach_div_([p.grad for p in params], torch.clamp(weight_sum, min=1e-12))
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip)
            finite = bool(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))  # host sync: the skip decision
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.timer.mark(None)
        return StepResult(loss_sum, grad_norm, finite, failed)

    # ------------------------------------------------------------------- the loop

    def run(self) -> Path:
        """Train to the end (or a signal), then export; returns the exported drafter folder."""
        self.out.mkdir(parents=True, exist_ok=True)
        config_yaml = self.out / "config.yaml"
        dump_yaml(self.cfg, config_yaml)
        resumed = ckpt.find_resumable(self.out, log=self.log)
        if resumed is not None:
            self.restore(ckpt.load_checkpoint(resumed, self.device))
            self.saved_step = self.step
        else:
            self.warm_up()
        sink = MetricsSink(self.out, self.cfg.log, to_dict(self.cfg), self.total_steps, self.step)
        stop = ckpt.StopFlag().install()
        deadline = time.perf_counter() + (self.cfg.train.max_time_s or float("inf"))
        try:
            while self.step < self.total_steps and stop.requested is None:
                batches = [next(self.cursor) for _ in range(self.cfg.train.grad_accum)]
                result = self.train_step(batches)
                self.step += 1
                self.acc.add_step(result.grad_norm, skipped=not result.applied)
                sink.progress()
                stopping = self.track_skips(result, sink) or self.too_many_failures()
                out_of_time = time.perf_counter() >= deadline
                if self.step % self.cfg.log.every == 0 or self.step == self.total_steps or stopping or out_of_time:
                    record = self.log_record()
                    if self.cfg.eval.every and self.step % self.cfg.eval.every == 0:
                        record.update(self.evaluate())
                    sink.log(record)
                if stopping:
                    self.stop_on_faults()
                if self.step % self.cfg.checkpoint.every == 0:
                    self.save()
                self.faults.after_step(self.step)
                if out_of_time and self.step < self.total_steps:
                    sink.event(f"train.max_time_s={self.cfg.train.max_time_s:g} reached: the run ends at step "
                               f"{self.step} of {self.total_steps}")
                    break
            if stop.requested is not None:
                sink.event(f"{stop.requested} received: saving a checkpoint at step {self.step} and exiting")
            if self.saved_step != self.step:
                self.save()
        finally:
            stop.restore()
            sink.close()
        if stop.requested is not None:
            return self.out / "checkpoints"
        exported = ckpt.export_drafter(self.drafter, self.out / "drafter", getattr(torch, self.cfg.checkpoint.export_dtype))
        self.log(f"drafter exported to {exported}")
        return exported

    def evaluate(self) -> dict:
        """tau of the current drafter on the held-out prompts (docs/EVALUATION.md); the
        evaluation's time is kept out of the next interval's throughput."""
        from dflash_train.evaluate import TrainingEvaluator

        if getattr(self, "evaluator", None) is None:
            self.evaluator = TrainingEvaluator(self.cfg.eval, self.cfg.target, self.device)
        metrics = self.evaluator(self.drafter, self.autocast)
        self.acc.reset()  # just flushed: only its clock moves
        return metrics

    def track_skips(self, result: StepResult, sink: MetricsSink) -> bool:
        """Count non-finite steps; True when the run must stop. A step whose micro-batches all
        failed in the target forward is counted by `too_many_failures` instead."""
        if result.applied:
            self.consecutive_skips = 0
            return False
        if result.failed_batches == self.cfg.train.grad_accum:
            return False
        self.consecutive_skips += 1
        self.total_skipped += 1
        sink.event(f"step {self.step}: non-finite loss or gradient; step skipped, weights untouched")
        return self.consecutive_skips >= self.cfg.train.max_consecutive_skips

    def too_many_failures(self) -> bool:
        return self.consecutive_failures >= self.cfg.train.max_consecutive_batch_failures

    def stop_on_faults(self) -> None:
        path = self.save()
        if self.too_many_failures():
            raise TrainingStopped(
                f"the target forward failed on {self.consecutive_failures} consecutive micro-batches "
                f"(limit train.max_consecutive_batch_failures={self.cfg.train.max_consecutive_batch_failures}; "
                f"each failure is logged above with its batch's shape); the last good state is saved in "
                f"{path}. If they ran out of memory, lower data.token_budget or data.max_batch_size."
            )
        raise TrainingStopped(
            f"{self.consecutive_skips} consecutive non-finite steps (limit "
            f"train.max_consecutive_skips={self.cfg.train.max_consecutive_skips}); the last good state "
            f"is saved in {path}. Lower optim.lr or check the data and the target."
        )

    def log_record(self) -> dict:
        record = {"step": self.step, "epoch": self.cursor.epoch, "lr": self.scheduler.get_last_lr()[0]}
        record.update(self.acc.flush())
        record["stage_s"] = self.timer.flush()
        record["skipped_total"] = self.total_skipped
        if self.device.type == "cuda":
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        else:
            import resource

            record["peak_memory_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return record

    # ------------------------------------------------------------------- state

    def warm_up(self) -> None:
        """Run the target once on every bucket's largest shape (CUDA: allocator, kernels and any
        out-of-memory surface before the first step; CPU has nothing to warm)."""
        if self.device.type != "cuda":
            return
        started = time.perf_counter()
        for rows, length in self.plan.shapes:
            self.target.capture(torch.zeros(rows, length, dtype=torch.long, device=self.device))
        torch.cuda.synchronize(self.device)
        self.log(f"warmed up {len(self.plan.shapes)} target shapes in {time.perf_counter() - started:.1f} s")

    def state(self) -> dict:
        return {
            "step": self.step,
            "cursor": self.cursor.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "consecutive_skips": self.consecutive_skips,
            "total_skipped": self.total_skipped,
            "consecutive_failures": self.consecutive_failures,
            "accumulator": self.acc.state_dict(),
            "python_rng": list(random.getstate()[1]),
        }

    def save(self) -> Path:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        path = ckpt.save_checkpoint(
            self.out, self.step, self.drafter.state_dict(), self.optimizer.state_dict(), rng, self.state(),
            texts={"config.yaml": (self.out / "config.yaml").read_text(),
                   ckpt.DRAFTER_CONFIG: self.drafter.config.to_json_string(use_diff=False)},
            keep=self.cfg.checkpoint.keep, halfway=self.faults.save_hook(self.step),
        )
        self.saved_step = self.step
        self.faults.after_save(self.step, path)
        return path

    def restore(self, saved: dict) -> None:
        self.drafter.load_state_dict(saved["drafter"])
        self.optimizer.load_state_dict(saved["optimizer"])
        t = saved["trainer"]
        self.step = t["step"]
        self.cursor.load_state_dict(t["cursor"])
        self.scheduler.load_state_dict(t["scheduler"])
        self.consecutive_skips, self.total_skipped = t["consecutive_skips"], t["total_skipped"]
        self.consecutive_failures = t.get("consecutive_failures", 0)
        self.acc.load_state_dict(t["accumulator"])
        state = random.getstate()
        random.setstate((state[0], tuple(t["python_rng"]), state[2]))
        torch.set_rng_state(saved["rng"]["torch"])
        if "cuda" in saved["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(saved["rng"]["cuda"], self.device)
        self.log(f"resumed at step {self.step} (epoch {self.cursor.epoch}, batch {self.cursor.position})")


def train(cfg: Config, log=print) -> Path:
    return Trainer(cfg, log).run()
