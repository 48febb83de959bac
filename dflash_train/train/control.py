"""Stop control: signals, the per-step stop agreement, the fault limits and the time limit.

Owns when a run stops and why. After every step each rank brings its `Flags` to one small
all-reduce over the control group (element-wise max), and every rank derives the same `Stop`
from the result, so all ranks stop after the same step:
- a SIGTERM / SIGINT to any rank: checkpoint, exit 0, no export (a rerun resumes);
- train.max_consecutive_skips non-finite steps in a row (the skip decision is global, so every
  drafter rank counts the same) or the target forward failing on
  train.max_consecutive_batch_failures micro-batches in a row, counted in the run's global
  micro-batch order (whatever the topology): checkpoint of the last good state, then
  `TrainingStopped`;
- train.max_time_s passed on any drafter rank, counted from the start of the loop: checkpoint
  and export, at a step boundary; or, with train.fit_schedule_to_time, the step the learning
  rate's schedule was fitted to end at (`fit_to_time`): from the pace of this process's steps,
  the slowest drafter rank's, the steps that fit the time left.
The counters and the fitted end are part of the checkpoint (global, the same on every rank).
"""

from __future__ import annotations

import enum
import math
import time
from typing import NamedTuple

import torch

from dflash_train.core.errors import FAILED, UserError
from dflash_train.core.signals import StopFlag

# The schedule's fit to train.max_time_s: the pace is measured from FIT_FROM_STEPS steps into
# this process (compilation and warm-up left out), first fitted FIT_AFTER_STEPS steps in, then
# every REFIT_EVERY steps (walks and checkpoint saves then in the pace), and the fitted steps may
# take FIT_MARGIN of the time left.
FIT_FROM_STEPS, FIT_AFTER_STEPS, REFIT_EVERY = 10, 50, 500
FIT_MARGIN = 0.95


class TrainingStopped(UserError, RuntimeError):
    """The run stopped itself (too many non-finite steps or failed target forwards); a
    checkpoint of the last good state was written."""

    exit_code = FAILED


class Stop(enum.Enum):
    SIGNAL = "signal"
    NON_FINITE = "non-finite steps"
    FAILURES = "failed target forwards"
    TIME = "time limit"

    @property
    def is_fault(self) -> bool:
        return self in (Stop.NON_FINITE, Stop.FAILURES)


class Flags(NamedTuple):
    """One rank's part in the agreement after a step; the ranks take the element-wise max."""

    signal: int  # a signal reached this rank
    non_finite: int  # train.max_consecutive_skips reached (drafter ranks; all count the same)
    out_of_time: int  # train.max_time_s passed (drafter ranks)
    last_trained: int  # global index of the step's last micro-batch this rank trained on; -1: none


class Control:
    """One rank's stop control. Use as a context manager around the loop (it installs the signal
    handlers and starts the clock of train.max_time_s); without it no signal is caught and there
    is no time limit (benchmarks)."""

    def __init__(self, train_section, dist, micro_per_step: int) -> None:
        self.cfg, self.dist, self.micro_per_step = train_section, dist, micro_per_step
        self.flag = StopFlag()
        self.deadline = math.inf
        self.consecutive_skips = 0
        self.total_skipped = 0
        self.failure_streak = 0  # failed micro-batches in a row, in global index order
        self.stopping_skips = 0  # the streak that made this rank ask for a non-finite stop
        self.end: int | None = None  # the step the schedule was fitted to end at (fit_to_time)
        self.warmup: int | None = None  # the warm-up's length a fit shortened (LrSchedule.fitted_warmup)
        self.first_step: int | None = None  # this process's first step
        self.paced_from: tuple[int, float] | None = None  # (step, clock) the pace is measured from

    def __enter__(self) -> "Control":
        self.flag.install()
        self.deadline = time.perf_counter() + (self.cfg.max_time_s or math.inf)
        return self

    def __exit__(self, *exc) -> None:
        self.flag.restore()

    def count(self, result) -> bool:
        """Count a drafter step's skip; True when it was skipped as non-finite (a step whose
        micro-batches all failed in the target forward is the failure count's, not this)."""
        if result.applied:
            self.consecutive_skips = 0
            return False
        if result.all_failed:
            return False
        self.consecutive_skips += 1
        self.total_skipped += 1
        return True

    def agree(self, step: int, result=None) -> Stop | None:
        """Whether, and why, every rank stops after 1-based step `step`. `result` is this drafter
        rank's step.StepResult (None on a target rank). One small all-reduce (alone: none)."""
        drafter = result is not None
        if drafter and self.consecutive_skips >= self.cfg.max_consecutive_skips:
            self.stopping_skips = self.consecutive_skips  # a step counted after this may end the streak
        mine = Flags(signal=self.flag.requested is not None,
                     non_finite=drafter and self.consecutive_skips >= self.cfg.max_consecutive_skips,
                     out_of_time=drafter and (time.perf_counter() >= self.deadline or self.at_end(step)),
                     last_trained=result.last_trained if drafter else -1)
        flags = Flags(*self.dist.agree(list(mine), f"waiting for the other ranks at the end of step {step}"))
        M = self.micro_per_step
        if flags.last_trained >= (step - 1) * M:
            self.failure_streak = step * M - 1 - flags.last_trained
        else:
            self.failure_streak += M
        if self.failure_streak >= self.cfg.max_consecutive_batch_failures:
            return Stop.FAILURES
        if flags.non_finite:
            return Stop.NON_FINITE
        if flags.signal:
            return Stop.SIGNAL
        return Stop.TIME if flags.out_of_time else None

    def at_end(self, step: int) -> bool:
        """Step `step` is the one the schedule was fitted to end at (or past it)."""
        return self.end is not None and step >= self.end

    def fit_to_time(self, step: int, total_steps: int) -> int | None:
        """On every drafter rank after step `step` (a collective at the fitting steps): the step the
        schedule now ends at when this call changed it, else None. Where the steps left to
        `total_steps` will not fit the time left at the slowest drafter rank's pace, the end is
        the last step that fits; where they fit again, the end is the schedule's."""
        if not (self.cfg.fit_schedule_to_time and self.cfg.max_time_s and math.isfinite(self.deadline)):
            return None  # (outside the `with`, the clock of max_time_s has not started)
        if self.first_step is None:
            self.first_step = step
        since = step - self.first_step + 1
        if since == FIT_FROM_STEPS:
            self.paced_from = (step, time.perf_counter())
        if since < FIT_AFTER_STEPS or (since - FIT_AFTER_STEPS) % REFIT_EVERY or self.paced_from is None:
            return None
        now = time.perf_counter()
        pace = torch.tensor([(now - self.paced_from[1]) / (step - self.paced_from[0])], dtype=torch.float64,
                            device=self.dist.device)
        self.dist.all_reduce_drafters([pace], f"waiting for the other drafter ranks' pace at step {step}", op="max")
        fits = step + int(FIT_MARGIN * max(0.0, self.deadline - now) / max(pace.item(), 1e-9))
        end = max(step + 1, fits) if fits < total_steps else None
        if end == self.end:
            return None
        self.end = end
        return total_steps if end is None else end

    def resumed(self, steps_done: int) -> int | None:
        """After a resume: the fitted end restored from the checkpoint while it lies ahead and this
        run has a time box to fit (else the schedule's own end, None), for the step to apply."""
        if not (self.cfg.fit_schedule_to_time and self.cfg.max_time_s) or (self.end or 0) <= steps_done:
            self.end = None
        return self.end

    def signalled_after_save(self, step: int) -> bool:
        """A signal that arrived during the save of `step` on any rank (a second agreement: a
        save can take long)."""
        return bool(self.dist.agree([self.flag.requested is not None],
                                    f"waiting for the other ranks after the save of step {step}")[0])

    def cause(self) -> str:
        return self.flag.requested or "a signal to another rank"

    def explain(self, stop: Stop, saved) -> str:
        """The message of the TrainingStopped that a fault stop raises on a drafter rank."""
        c = self.cfg
        if stop is Stop.FAILURES:
            return (f"the target forward failed on {self.failure_streak} consecutive micro-batches (limit "
                    f"train.max_consecutive_batch_failures={c.max_consecutive_batch_failures}; each failure is "
                    f"logged above with its batch's shape); the last good state is saved in {saved}. If they ran "
                    f"out of memory, lower data.token_budget or data.max_batch_size.")
        return (f"{self.stopping_skips} consecutive non-finite steps (limit train.max_consecutive_skips="
                f"{c.max_consecutive_skips}); the last good state is saved in {saved}. Lower optim.lr or check "
                f"the data and the target.")

    def state_dict(self) -> dict:
        return {"consecutive_skips": self.consecutive_skips, "total_skipped": self.total_skipped,
                "failure_streak": self.failure_streak, "end": self.end, "warmup": self.warmup}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive_skips = state["consecutive_skips"]
        self.total_skipped = state["total_skipped"]
        self.failure_streak = state["failure_streak"]
        self.end = state.get("end")  # absent from checkpoints written before the schedule's fit
        self.warmup = state.get("warmup")  # ... and before the warm-up's


class DeferredSkips:
    """Counts the drafter steps' skips into `control`, reading a skip decision that the device
    made a step late: by then the next step's work is queued, so the read keeps the GPU busy
    instead of draining it. `say(text)` announces each skipped step."""

    def __init__(self, control: Control, say) -> None:
        self.control, self.say = control, say
        self.pending = None  # a step whose decision the device made and the host has not read

    def add(self, result, read_now: bool) -> None:
        """Count the previous step's pending decision, then this one's now (`read_now`: log,
        checkpoint and last steps record exact counts) or at the next step."""
        self.flush()
        if read_now or result.ready:
            self._count(result)
        else:
            self.pending = result

    def flush(self) -> None:
        """Count a pending decision now (before a stop saves the state that holds the counts)."""
        if self.pending is not None:
            self._count(self.pending)
            self.pending = None

    def _count(self, result) -> None:
        if self.control.count(result):
            self.say(f"step {result.step}: non-finite loss or gradient; step skipped, weights untouched")
