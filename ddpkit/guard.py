"""The loss guard (``--nan-guard``): a NaN or a loss spike is not applied, and a damaged state is rolled back.

One bad step can end a run. A non-finite loss or gradient (a corrupt sample, an overflow) turns every
weight into NaN at the optimizer step, and every later step stays NaN; a huge gradient (or a damaged
update) throws the weights far from where they were, and the loss spikes and takes long to come back.
Large-scale trainers guard against both: skip the step, and if the trouble persists, go back to the
last good checkpoint and move on past the batches that caused it (PaLM restarted from ~100 steps before
a spike and skipped a few hundred batches).

What this guard does, after backward and before the optimizer step:

* it reads the step's **global** loss (already all-reduced: every rank sees the same number) and the
  global gradient norm (what clipping computes, the same on every rank); they are non-finite, or the
  loss is above ``spike_factor`` x the median of the last :data:`WINDOW` accepted losses: the step is
  **rejected**: the optimizer does not step, the batch's global sample ids are recorded, training
  goes on with the next batch. The verdict is also max-reduced over the ranks (one int), so all ranks
  skip together even if a norm differed in a bit;
* a second rejection in a row means the problem is the state, not the batch: every rank **rolls back**
  to the newest good checkpoint (weights, optimizer, scaler) and continues with the next batch; the
  data position moves on, so the steps since that checkpoint are undone (the event log names them);
* a rejected step is never checkpointed (its state may be the damaged one).

The summary reports ``rollbacks`` and ``skipped_batches`` (global sample ids). With no checkpoint to
go back to, the guard keeps skipping, and stops the run after :data:`MAX_REJECTED` rejections in a row.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

WINDOW = 20  # accepted losses the median is taken over
MIN_HISTORY = 5  # no spike verdict before this many accepted steps (the first losses move fast)
MAX_REJECTED = 5


class GuardError(RuntimeError):
    """The guard rejected too many steps in a row, with no checkpoint to roll back to."""


class LossGuard:
    """The verdict and the record. ``spike_factor``: a loss above this x the running median is a spike."""

    def __init__(self, spike_factor: float = 3.0) -> None:
        self.spike_factor = spike_factor
        self.history: deque[float] = deque(maxlen=WINDOW)
        self.rejected_in_a_row = 0
        self.rollbacks = 0
        self.skipped_batches: list[int] = []
        self.events: list[dict] = []  # (step, what happened): for a notebook's plot and the logs

    def verdict(self, loss: float, grad_norm: float) -> str:
        """``ok``, ``nonfinite`` or ``spike``."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "nonfinite"
        if len(self.history) >= MIN_HISTORY and loss > self.spike_factor * statistics.median(self.history):
            return "spike"
        return "ok"

    def accept(self, loss: float) -> None:
        self.history.append(loss)
        self.rejected_in_a_row = 0

    def reject(self, step: int, reason: str, sample_ids: list[int]) -> str:
        """Record a rejected step; returns what to do next: ``skip`` or ``rollback``."""
        self.rejected_in_a_row += 1
        self.skipped_batches.extend(sample_ids)
        action = "rollback" if self.rejected_in_a_row >= 2 else "skip"
        self.events.append({"step": step, "reason": reason, "action": action})
        return action

    def rolled_back(self, step: int, to_step: int) -> None:
        """A rollback happened at ``step``, to the checkpoint of ``to_step``: the steps in between are undone."""
        self.rollbacks += 1
        self.rejected_in_a_row = 0
        self.events.append({"step": step, "reason": "rolled back", "action": f"to step {to_step}"})


VERDICTS = ("ok", "spike", "nonfinite")  # index = the code max-reduced over the ranks: the worst wins
