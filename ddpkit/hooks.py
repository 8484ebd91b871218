"""Hooks at the step boundary: where decisions that every rank must take together belong.

The trainer calls each hook on **every rank at the same step**, before and after it. After a step,
every rank holds the same global loss (averaged over the whole global batch) and the same step count,
so a hook that decides something from them (save now, stop, skip this batch, roll back) decides the
same thing everywhere without another message. That is what makes collective actions safe: a
checkpoint that every rank writes, or an emergency save, deadlocks if one rank decides differently.

A decision from anything else (a clock, a file, a signal) is not shared: each rank's clock reads a
little differently, so "ten minutes have passed" can be true on rank 0 and false on rank 1 at the same
step. Such a decision is taken on one rank and broadcast (one tiny collective per step).

Built in: :class:`CheckpointEvery` (a step cadence and a time cadence) here, fault injection in
``faults.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class StepResult:
    """What one optimizer step produced, as every hook after it sees it."""

    step: int  # optimizer steps completed, this one included
    loss: float  # mean over the global batch: equal on every rank
    local_loss: float  # mean over this rank's samples
    lr: float
    sample_ids: list[int]  # this rank's samples
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (data_s, forward_s, ...)
    comm_calls: int = 0
    comm_bytes: int = 0
    checkpoint_s: float = 0.0  # set by a hook that saved at this step
    checkpoint_bytes: int = 0
    step_time_s: float = 0.0  # the whole step, hooks included (set when they are done)


class Hook:
    """Override what you need. ``trainer`` is the :class:`~ddpkit.train.Trainer` of this rank."""

    def before_step(self, trainer) -> None:
        """Before the step's data is loaded (``trainer.step`` steps are done; ``trainer.timer`` times phases)."""

    def after_step(self, trainer, result: StepResult) -> None:
        """After the optimizer step; ``result.loss`` is the global loss."""

    def on_end(self, trainer) -> None:
        """After the last step, before the summary."""


class CheckpointEvery(Hook):
    """Save every ``every`` steps, when ``every_s`` seconds have passed since the last save, and at the
    last step (all ranks call: the writer writes, all wait).

    The time cadence bounds the work a failure can lose in seconds, whatever the step time does. Rank 0's
    clock decides and the decision is broadcast (see the module docstring): per-rank clocks would let one
    rank enter a collective save that another skips, and both would wait forever.
    """

    def __init__(self, every: int, last_step: int, every_s: float = 0.0) -> None:
        self.every, self.last_step, self.every_s = every, last_step, every_s
        self.last_save: float | None = None  # the clock starts with the first step, not at start-up

    def before_step(self, trainer) -> None:
        if self.last_save is None:
            self.last_save = time.monotonic()

    def time_is_due(self, trainer) -> bool:
        due = torch.tensor([time.monotonic() - self.last_save >= self.every_s], dtype=torch.uint8)
        if trainer.ctx.is_distributed:
            due = due.to(trainer.ctx.device)
            dist.broadcast(due, src=0, group=trainer.ctx.world_group)  # rank 0's clock decides for all
        return bool(due.item())

    def after_step(self, trainer, result: StepResult) -> None:
        timed = bool(self.every_s) and self.time_is_due(trainer)
        if getattr(trainer, "step_rejected", False):  # the loss guard rejected it: its state may be damaged
            return
        if (self.every and result.step % self.every == 0) or timed or result.step == self.last_step:
            result.checkpoint_s, result.checkpoint_bytes = trainer.save()
            trainer.log.event("checkpoint_saved", result.step, seconds=result.checkpoint_s,
                              bytes=result.checkpoint_bytes)
            self.last_save = time.monotonic()
