"""Hooks at the step boundary: where decisions that every rank must take together belong.

The trainer calls each hook on **every rank at the same step**, before and after it. After a step,
every rank holds the same global loss (averaged over the whole global batch) and the same step count,
so a hook that decides something from them (save now, stop, skip this batch, roll back) decides the
same thing everywhere without another message. That is what makes collective actions safe: a
checkpoint that every rank writes, or an emergency save, deadlocks if one rank decides differently.

Built in: :class:`CheckpointEvery` (the step cadence) here, fault injection in ``faults.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """Save every ``every`` steps and at the last step (all ranks call: the writer writes, all wait)."""

    def __init__(self, every: int, last_step: int) -> None:
        self.every, self.last_step = every, last_step

    def after_step(self, trainer, result: StepResult) -> None:
        if (self.every and result.step % self.every == 0) or result.step == self.last_step:
            result.checkpoint_s, result.checkpoint_bytes = trainer.save()
            trainer.log.event("checkpoint_saved", result.step, seconds=result.checkpoint_s,
                              bytes=result.checkpoint_bytes)
