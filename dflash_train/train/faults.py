"""Injected failures for tests and debugging (the `faults` config section).

Owns what each fault does and when it fires; the trainer and the checkpoint writer call these
hooks at fixed points. Every fault is off by default and costs a set lookup when off. Steps are
1-based optimizer steps, as logged (on a target rank of a disaggregated run: the step whose
batches it has just produced). `faults.on_ranks` limits them to some global ranks.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from dflash_train.core.config import FaultsSection


class Faults:
    def __init__(self, cfg: FaultsSection, rank: int = 0) -> None:
        if cfg.on_ranks is not None and rank not in cfg.on_ranks:
            cfg = FaultsSection()  # this rank is spared: every fault off
        self.cfg = cfg
        self.nan_at = frozenset(cfg.nan_at_steps)
        self.target_error_at = frozenset(cfg.target_error_at_steps)
        self.after_step_at = frozenset(cfg.delay_at_steps) | frozenset(cfg.sigterm_at_steps)
        self.in_save_at = frozenset(cfg.interrupt_save_at_steps) | frozenset(cfg.sigterm_in_save_at_steps)
        self.corrupt_at = frozenset(cfg.corrupt_checkpoint_at_steps)

    def poison_loss(self, step: int, loss_sum: torch.Tensor) -> torch.Tensor:
        """The step's loss, NaN when injected (backward then yields NaN gradients too)."""
        return loss_sum * float("nan") if step in self.nan_at else loss_sum

    def target_forward(self, step: int) -> None:
        """Called just before the target forward of each micro-batch."""
        if step in self.target_error_at:
            if self.cfg.target_error == "oom":
                raise torch.OutOfMemoryError("injected out of memory in the target forward")
            raise RuntimeError("injected target failure")

    def after_step(self, step: int) -> None:
        """Called after each optimizer step: a slow rank, or a SIGTERM from outside."""
        if step not in self.after_step_at:
            return
        if step in self.cfg.delay_at_steps:
            time.sleep(self.cfg.delay_seconds)
        if step in self.cfg.sigterm_at_steps:
            os.kill(os.getpid(), signal.SIGTERM)

    def save_hook(self, step: int):
        """What the checkpoint writer calls halfway through writing step `step` (None: nothing)."""
        if step not in self.in_save_at:
            return None

        def halfway(tmp: Path) -> None:
            if step in self.cfg.sigterm_in_save_at_steps:
                os.kill(os.getpid(), signal.SIGTERM)
            if step in self.cfg.interrupt_save_at_steps:
                os._exit(137)  # like kill -9: no cleanup, the temporary folder stays behind

        return halfway

    def after_save(self, step: int, path: Path) -> None:
        if step in self.corrupt_at:  # the drafter's weights, or a sharded checkpoint's first shard file
            weights = path / "drafter.safetensors"
            if not weights.is_file():
                weights = min((path / "sharded").glob("*.distcp"))
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
