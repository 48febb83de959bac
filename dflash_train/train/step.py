"""The drafter step: shipments -> anchors and masks -> drafter -> loss -> backward -> reduce -> step.

Owns the drafter's side of an optimizer step on one drafter rank: the drafter, AdamW, the LR
schedule, autocast, the loss accumulation over the rank's micro-batches, the gradient reduction
over the drafter ranks, clipping, and the skip decision. Gradient accumulation normalises
exactly: gradients of summed losses are divided once by the total loss weight of all
micro-batches of all drafter ranks, so D ranks x A micro-batches give the gradient of one
process over the same D x A micro-batches. A non-finite loss or gradient norm skips the step
and leaves weights and optimizer state untouched; a micro-batch on which the target forward
failed (a failed shipment) is skipped and counted.

With a sharded drafter (train.fsdp, sharding.Sharding) the gradients are FSDP's: kept unsharded
over a rank's micro-batches and reduce-scattered (summed) in the backward of its last; a failed
micro-batch runs the zero micro-batch instead, so that every rank runs the same collectives; the
loss and weight sums are still all-reduced here, and the gradient norm is the global one.

Shape legend: T packed tokens, N blocks, B block size, H hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_train.core.devices import whole
from dflash_train.core.loss import BlockLossOutput, LossSettings, block_loss
from dflash_train.core.masks import ANCHOR_STREAM, build_attention_masks, build_layout, sample_anchors, step_generator
from dflash_train.train.dist import Dist
from dflash_train.train.faults import Faults
from dflash_train.train.metrics import Accumulator, StageTimer
from dflash_train.train.produce import FeatureNoise, Shipment, context_features
from dflash_train.train.sharding import Sharding


@dataclass
class StepResult:
    flag: bool | torch.Tensor
    """The optimizer step was taken (finite loss and gradient norm): a host bool, or the device's
    flag when the device made the decision (`DrafterStep.skip_on_device`); `applied` reads it."""
    all_failed: bool = False
    """Every micro-batch of the step (on every drafter rank) failed: nothing to learn from."""
    last_trained: int = -1
    """Global index of the last micro-batch this rank trained on in the step (-1: none)."""
    step: int = 0
    """The 1-based optimizer step (0: unknown)."""

    @property
    def ready(self) -> bool:
        """Whether the host knows `applied` without waiting for the device."""
        return not torch.is_tensor(self.flag)

    @property
    def applied(self) -> bool:
        """The decision as a host bool; a device flag is read (a host sync) once."""
        if torch.is_tensor(self.flag):
            self.flag = bool(self.flag)
        return self.flag


class LrSchedule:
    """The learning rate's factor at a step: a linear warm-up over warmup_ratio of the schedule's
    `total_steps`, then a cosine to min_lr_ratio at `end` (the schedule's last step, or an
    earlier one where train.max_time_s ends the run first: Control.fit_to_time), flat after it.
    A schedule fitted to end earlier while it still warms up warms up over warmup_ratio of the
    fitted schedule instead (fitted_warmup)."""

    def __init__(self, total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> None:
        self.warmup_ratio = warmup_ratio
        self.warmup = math.ceil(warmup_ratio * total_steps)
        self.min_lr_ratio = min_lr_ratio
        self.end = total_steps

    def fitted_warmup(self, end: int, step: int) -> int:
        """The warm-up's length once the schedule ends at `end`, fitted after step `step` (the
        step to come is `step`'s rate): warmup_ratio of `end` where the warm-up is still under way
        and that is shorter, never longer than it was, and never ending before the step to come
        (whose rate is then the peak: the cosine is not entered part way down); else the warm-up
        as it is."""
        if step >= self.warmup:
            return self.warmup
        return max(step + 1, min(self.warmup, math.ceil(self.warmup_ratio * end)))

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.end - self.warmup))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class StepSetup:
    """What a drafter step is built from besides the config, the drafter and the target's heads."""

    dist: Dist
    attention: str
    """The drafter's attention backend: flex or sdpa."""
    loss: LossSettings
    noise: FeatureNoise
    micro_per_step: int
    total_steps: int
    """Of the learning-rate schedule."""
    faults: Faults
    acc: Accumulator
    """Receives the step's sums."""
    timer: StageTimer
    """Receives the stage times."""
    sharding: Sharding | None = None
    """train.fsdp: the drafter is sharded (already, by this); None: a whole replica."""


class DrafterStep:
    """`step(shipments) -> StepResult` over this drafter rank's micro-batches of one step.

    `heads` holds the target's frozen `embed(ids)` and `lm_head_weight` (target.Target or
    target.TargetHeads); `acc` and `timer` (metrics.py) receive the step's sums and stage times.
    """

    def __init__(self, cfg, drafter, heads, setup: StepSetup) -> None:
        self.cfg, self.drafter, self.heads = cfg, drafter, heads
        self.dist, self.device, self.attention = setup.dist, setup.dist.device, setup.attention
        self.loss_settings = setup.loss
        self.noise, self.micro_per_step = setup.noise, setup.micro_per_step
        self.faults, self.acc, self.timer = setup.faults, setup.acc, setup.timer
        self.sharding = setup.sharding
        device, total_steps, o = self.device, setup.total_steps, cfg.optim
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay, fused=device.type == "cuda")
        # One drafter rank with the fused AdamW: the skip decision stays on the device (the fused
        # kernel skips the update, and leaves its step count, when `found_inf` is set, as with a
        # gradient scaler), so that the step ends without the host waiting for the GPU; the host
        # reads the flag later (StepResult.applied). Otherwise the host decides.
        self.skip_on_device = self.optimizer.defaults.get("fused") is True and len(self.dist.drafter_ranks) == 1
        self.schedule = LrSchedule(total_steps, o.warmup_ratio, o.min_lr_ratio)
        # A closure, not the object: LambdaLR would save and restore the object's fields, and a
        # resumed run's schedule is its own config's (its end comes back with Control's state).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: self.schedule(step))
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                         else torch.autocast("cpu", enabled=False))

    def end_schedule_at(self, step: int, warmup: int | None = None) -> None:
        """The cosine made to end at `step` (Control.fit_to_time), with a warm-up of `warmup`
        steps where given (LrSchedule.fitted_warmup), the rate of the step to come set from them."""
        self.schedule.end = step
        if warmup is not None:
            self.schedule.warmup = warmup
        self._rates_from_schedule()

    def _rates_from_schedule(self) -> None:
        """Each group's rate (and the scheduler's last one) at the schedule's point of the step to
        come, from its base rate: after the schedule or the base rate changed between steps."""
        scheduler = self.scheduler
        for group, base, rule in zip(self.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * rule(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def apply_settings(self, optim) -> None:
        """After a resume with changed settings: AdamW's hyperparameters and the learning rate
        as `optim` (this run's optim section) says, the rate at the schedule's point of the
        resumed step (the loaded state carries what the checkpoint was saved with)."""
        for group in self.optimizer.param_groups:
            group.update(betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=optim.weight_decay,
                         initial_lr=optim.lr)
        self.scheduler.base_lrs = [optim.lr] * len(self.optimizer.param_groups)
        self._rates_from_schedule()

    def __call__(self, shipments) -> StepResult:
        """One optimizer step; `shipments` yields the next micro-batch only after the previous
        one's backward (a drafter rank's receive buffers are reused)."""
        loss_sum, weight_sum, used, last, step = 0.0, 0.0, 0, -1, 0
        for shipment in shipments:
            step = shipment.index // self.micro_per_step + 1
            if self.sharding is not None:  # reduce-scatter in the backward of the rank's last micro-batch
                self.sharding.micro_batch(self.drafter, (shipment.index + 1) % self.cfg.train.grad_accum == 0)
            out = self.forward(shipment)
            if out is None:  # the target failed on it: skipped (Accumulator counts it)
                if self.sharding is not None:
                    self.sharding.zero_micro_batch(self.drafter, self.autocast)
                continue
            self.timer.mark("backward")
            out.loss_sum.backward()
            loss_sum, weight_sum, used = loss_sum + out.loss_sum.detach(), weight_sum + out.weight_sum, used + 1
            last = shipment.index
        self.timer.mark("optimizer")
        used_by_all = None  # several drafter ranks: the micro-batches trained over all of them (device)
        if len(self.dist.drafter_ranks) > 1:
            loss_sum, weight_sum, used_by_all = self.reduce_gradients(loss_sum, weight_sum, used, step)
        applied, all_failed = False, used_by_all is None and used == 0
        if all_failed:  # nothing to learn from: weights and optimizer untouched
            grad_norm = torch.zeros((), device=self.device)
        else:
            params = [p for p in self.drafter.parameters() if p.grad is not None]
            # Exact mean over all micro-batches: gradients of the summed loss, divided once.
            torch._foreach_div_([p.grad for p in params], torch.clamp(weight_sum, min=1e-12))
            grad_norm = whole(torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip))  # global
            ok = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
            if used_by_all is not None:  # the global count is read with the skip decision, in one host sync
                trained = used_by_all > 0
                applied, any_trained = torch.stack([ok & trained, trained]).tolist()
                all_failed = not any_trained
            elif self.skip_on_device:
                self.optimizer.found_inf = (~ok).to(torch.float32)
                self.optimizer.step()  # a no-op on the device when found_inf is set
                applied = ok
            else:
                applied = bool(ok)  # host sync: the skip decision
        if applied is True:  # a host True; a device flag (already stepped above) is never read here
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.timer.mark(None)
        self.acc.add_step(grad_norm, skipped=~applied if torch.is_tensor(applied) else not applied)
        return StepResult(applied, all_failed=all_failed, last_trained=last, step=step)

    def forward(self, s: Shipment) -> BlockLossOutput | None:
        """One micro-batch: (split fc: concat + noise) -> anchors -> blocks and masks -> drafter
        -> loss; None when the target failed on it (it is skipped and counted)."""
        c = self.cfg
        if s.failed:
            self.acc.add_failed_batch()
            return None
        self.timer.mark("mask")
        features_TF = context_features(s, self.noise)
        anchors, num_real = sample_anchors(
            s.loss_mask_T, s.doc_lengths, c.objective.num_anchors,
            step_generator(c.train.seed, s.index, ANCHOR_STREAM, device=self.device),
            pad_to_multiple=c.train.anchor_multiple, buckets_per_doubling=c.train.anchor_buckets_per_doubling,
            return_count=True, count=s.anchor_count, align=s.doc_align)
        d = self.drafter
        layout = build_layout(anchors, s.loss_mask_T, s.doc_lengths, d.block_size, s.doc_align)
        masks = build_attention_masks(layout, d.layer_types, d.config.sliding_window, self.attention)
        self.timer.mark("drafter_forward")
        block_emb = self.heads.embed(layout.block_input_ids(s.input_ids_T, d.mask_token_id))
        with self.autocast:
            hidden = d(features_TF[None], block_emb[None], layout.position_ids(), attention_mask=masks)[0]
        lm_head, o = self.heads.lm_head_weight, c.objective
        # The loss reads the real blocks' rows only: the padding blocks after them carry no
        # target, and their rows would add nothing but lm_head work (up to half of a row's).
        # At least one lm_head chunk's worth of scored rows (B - 1 per block: block_loss skips
        # the anchor's), or all rows, so that the compiled full chunk keeps one shape (a last,
        # shorter chunk runs block_loss's graph for tails, whose row count is dynamic).
        B = d.block_size
        min_blocks = -(-max(1, o.lm_head_chunk_rows) // (B - 1))
        M = min(hidden.shape[0], max(max(1, num_real), min_blocks) * B)
        target_hidden = None
        if o.labels == "distill":
            assert s.target_hidden_TH is not None, "labels=distill: the shipment carries the target's final state"
            target_hidden = layout.rows(s.target_hidden_TH)[:M]
        out = block_loss(hidden[:M].to(lm_head.dtype), lm_head, layout.labels(s.labels_T)[:M],
                         layout.valid_NB.flatten()[:M], d.block_size, self.loss_settings,
                         target_hidden_MH=target_hidden)
        out.loss_sum = self.faults.poison_loss(s.index // self.micro_per_step + 1, out.loss_sum)
        self.acc.add_loss(out)
        self.acc.add_batch(s.num_tokens, s.padded_tokens, s.rows, s.sum_seq_len, s.max_seq_len)
        return out

    def reduce_gradients(self, loss_sum, weight_sum, used: int, step: int):
        """Sum gradients, loss and weight sums and the trained micro-batch counts over the
        drafter ranks (one flat all-reduce; all three sums stay on the device), so that dividing
        by the global weight gives the single-process gradient of the same micro-batches. Done
        once per step after accumulation rather than by DDP's backward hooks: DDP averages by
        the number of ranks (the exact mean needs the weight sum instead) and needs every rank to
        run the same backwards, which a skipped micro-batch breaks. A sharded drafter's
        gradients are summed already (FSDP's reduce-scatter): the sums and counts alone here."""
        grads = []
        if self.sharding is None:
            params = list(self.drafter.parameters())
            for p in params:
                if p.grad is None:  # every micro-batch of this rank failed: it adds zeros
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
        totals = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device)
                              for v in (loss_sum, weight_sum, float(used))])
        self.dist.all_reduce_drafters(grads + [totals], f"waiting for the gradient all-reduce of step {step}")
        return totals[0], totals[1], totals[2]

    def whole_drafter(self, on_device: bool = True):
        """The drafter with all its weights, for evaluation and export: the drafter itself, or
        when sharded a plain copy gathered on the leader, on its device or, without `on_device`,
        its CPU (None on the other drafter ranks; a collective every drafter rank calls)."""
        if self.sharding is None:
            return self.drafter
        return self.sharding.whole_drafter(self.drafter, self.dist.is_leader, on_device)
