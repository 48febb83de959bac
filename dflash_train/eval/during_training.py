"""What a training run measures at its evaluation steps (`eval.every`): walked tau on the held-out
split, served tau on `eval.prompts`. The training loop is handed this as its evaluation
(`train.loop.build(..., evaluation=DuringTraining())`) and imports nothing of this layer."""

from __future__ import annotations

import torch

from dflash_train.core.target import load_target
from dflash_train.eval.evaluate import TrainingEvaluator
from dflash_train.eval.walk import ForwardSettings, Walker


class DuringTraining:
    """The leader's evaluation of the drafter being trained; the walk and the served check are
    built at the first evaluation and kept for the run."""

    def __init__(self) -> None:
        self.walker: Walker | None = None
        self.served: TrainingEvaluator | None = None

    def __call__(self, run, drafter) -> tuple[dict, dict]:
        """(walked fields, served fields) of `drafter`, the run's drafter with its current weights
        whole (a sharded one gathered: train.loop.log_record); either is empty when the run has
        no validation split or no eval.prompts."""
        walked, served = {}, {}
        if run.validation is not None:
            self.walker = self.walker or validation_walker(run)
            walked = self.walker(drafter).record()
        if run.cfg.eval.prompts is not None:
            self.served = self.served or TrainingEvaluator(run.cfg.eval, run.cfg.target, run.dist.device)
            served = self.served(drafter, run.step.autocast)
        return walked, served


def validation_walker(run) -> Walker:
    """The walk of the held-out samples on the leader, in the training step's attention, autocast
    and target heads, with the run's own target where the rank holds a whole one, else (a drafter
    rank of a disaggregated run; a target sharded over its group by topology.target_tp, which runs
    only with all of the group) a copy of it loaded here."""
    cfg, step, device = run.cfg, run.step, run.dist.device
    target = run.producer.target if run.producer is not None and run.dist.tp_mesh is None else None
    if target is None:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            target = load_target(cfg.target.path, device, cfg.target.dtype, step.drafter.target_layer_ids, "data")[0]
    forward = ForwardSettings(step.attention, step.autocast, gamma=cfg.objective.gamma,
                              chunk_rows=cfg.objective.lm_head_chunk_rows, anchor_multiple=cfg.train.anchor_multiple)
    # On a GPU packed rows keep the training shape (compiled code); on CPU the dense mask would
    # pay for the padding.
    return Walker(run.validation, target, step.heads, device=device, forward=forward, data=cfg.data,
                  pad_id=run.stream.pad_id, pad_to=cfg.data.token_budget if device.type == "cuda" else 0)
