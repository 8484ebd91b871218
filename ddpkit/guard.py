"""The loss guard (``--nan-guard``): a NaN or a loss spike is not applied, and a damaged state is rolled back.

One bad step can end a run. A non-finite loss or gradient (a corrupt sample, an overflow) turns every
weight into NaN at the optimizer step, and every later step stays NaN; a huge gradient (or a damaged
update) throws the weights far from where they were, and the loss spikes and takes long to come back.
Large-scale trainers guard against both: skip the step, and if the trouble persists, go back to the
last good checkpoint and move on past the batches that caused it (PaLM restarted from ~100 steps before
a spike and skipped a few hundred batches).

What this guard does, after backward and before the optimizer step:

* it reads the step's **global** loss (all-reduced: every rank sees the same number) and the global
  gradient norm (what clipping computes, the same on every rank); they are non-finite, or the loss is
  above ``spike_factor`` x the median of the last :data:`WINDOW` accepted losses: the step is
  **rejected**: the optimizer does not step, the batch's global sample ids are recorded, training goes
  on with the next batch. The verdict is also max-reduced over the ranks (one int), so all ranks skip
  together even if a norm differed in a bit (:meth:`LossGuard.judge`);
* a second rejection in a row means the problem is the state, not the batch: every rank **rolls back**
  to the newest good checkpoint (weights, optimizer, scaler) and continues with the next batch; the
  data position moves on, so the steps since that checkpoint are undone (the event log names them);
* a rejected step is never checkpointed (its state may be the damaged one), not even by a preemption
  notice (``preemption.py``).

The loop is bounded: :data:`MAX_ROLLBACKS` rollbacks with no accepted step between them (the fault
comes back whatever the state) end the run with one line naming the step; with no checkpoint to go back
to, :data:`MAX_REJECTED` rejections in a row do. Both are :class:`GuardError`, a user error: a restart
would only repeat it.

What the guard knows travels with every checkpoint (:meth:`LossGuard.state_dict`): the recent accepted
losses (a resumed run detects a spike at once, not after :data:`MIN_HISTORY` more steps), the rejections
and rollbacks so far. The summary reports ``rollbacks`` and ``skipped_batches`` (global sample ids).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch
import torch.distributed as dist

from ddpkit.errors import UserError
from ddpkit.step import gather_sample_ids

WINDOW = 20  # accepted losses the median is taken over
MIN_HISTORY = 5  # no spike verdict before this many accepted steps (the first losses move fast)
MAX_REJECTED = 5  # rejections in a row with no checkpoint to roll back to, before giving up
MAX_ROLLBACKS = 3  # rollbacks with no accepted step between them, before giving up
VERDICTS = ("ok", "spike", "nonfinite")  # index = the code max-reduced over the ranks: the worst wins


class GuardError(UserError):
    """The guard cannot get past a fault: it gives up with one line (a restart would do the same)."""


class LossGuard:
    """The verdict and the record. ``spike_factor``: a loss above this x the running median is a spike."""

    def __init__(self, spike_factor: float = 3.0) -> None:
        self.spike_factor = spike_factor
        self.history: deque[float] = deque(maxlen=WINDOW)
        self.rejected_in_a_row = 0
        self.rollbacks_in_a_row = 0  # rollbacks since the last accepted step
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

    def judge(self, ctx, loss: float, grad_norm: float) -> str:
        """This rank's verdict, max-reduced over every rank (collective): the worst verdict is everyone's."""
        code = torch.tensor([VERDICTS.index(self.verdict(loss, grad_norm))], dtype=torch.int32)
        if ctx.is_distributed:
            code = code.to(ctx.device)
            dist.all_reduce(code, op=dist.ReduceOp.MAX, group=ctx.world_group)
        return VERDICTS[int(code.item())]

    def accept(self, loss: float) -> None:
        self.history.append(loss)
        self.rejected_in_a_row = 0
        self.rollbacks_in_a_row = 0

    def reject(self, step: int, reason: str, sample_ids: list[int]) -> str:
        """Record a rejected step; returns what to do next: ``skip`` or ``rollback``."""
        self.rejected_in_a_row += 1
        self.skipped_batches.extend(sample_ids)
        action = "rollback" if self.rejected_in_a_row >= 2 else "skip"
        self.events.append({"step": step, "reason": reason, "action": action})
        return action

    def check_can_go_on(self, step: int, have_checkpoint: bool) -> None:
        """Give up, with the step and the fix, when skipping and rolling back no longer help."""
        if not have_checkpoint and self.rejected_in_a_row >= MAX_REJECTED:
            raise GuardError(f"the loss guard rejected {MAX_REJECTED} steps in a row up to step {step} and there is "
                             f"no checkpoint to roll back to: add --checkpoint-dir with --checkpoint-every, or lower --lr")
        if have_checkpoint and self.rollbacks_in_a_row >= MAX_ROLLBACKS:
            raise GuardError(f"the loss guard rolled back {MAX_ROLLBACKS} times without one accepted step in between, "
                             f"and step {step} was rejected again: the fault persists whatever the state; check the "
                             f"data around step {step} or lower --lr")

    def rolled_back(self, step: int, to_step: int) -> None:
        """A rollback happened at ``step``, to the checkpoint of ``to_step``: the steps in between are undone."""
        self.rollbacks += 1
        self.rollbacks_in_a_row += 1
        self.rejected_in_a_row = 0
        self.events.append({"step": step, "reason": "rolled back", "action": f"to step {to_step}"})

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the guard: plain lists and numbers (loads with ``weights_only``)."""
        return {"history": list(self.history), "rejected_in_a_row": self.rejected_in_a_row,
                "rollbacks_in_a_row": self.rollbacks_in_a_row, "rollbacks": self.rollbacks,
                "skipped_batches": list(self.skipped_batches), "events": [dict(e) for e in self.events]}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"], maxlen=WINDOW)
        self.rejected_in_a_row, self.rollbacks_in_a_row = state["rejected_in_a_row"], state["rollbacks_in_a_row"]
        self.rollbacks, self.skipped_batches = state["rollbacks"], list(state["skipped_batches"])
        self.events = [dict(e) for e in state["events"]]


def settle(trainer, verdict: str, loss: float, ids: list[int]) -> None:
    """After a judged step, on every rank: record an accepted step, or act on a rejected one (skip it, or
    roll back on the second in a row), and give up when neither helps. ``ids`` are this rank's samples;
    ``trainer`` is the rank's trainer: its ``guard``, ``step``, ``cfg``, ``ctx``, ``log``, and
    ``roll_back()`` (which returns the step restored, or None when there is no checkpoint yet)."""
    guard = trainer.guard
    if verdict == "ok":
        guard.accept(loss)
        return
    global_ids = [i for i in gather_sample_ids(trainer.ctx, [ids])[0] if i >= 0]  # collective: every rank rejects
    action = guard.reject(trainer.step, verdict, global_ids)
    trainer.log.event("step_rejected", trainer.step, reason=verdict, action=action)
    if trainer.ctx.is_main:
        print(f"ddpkit: step {trainer.step} rejected ({verdict} loss or gradient): {action}", flush=True)
    if action != "rollback":
        return
    have_checkpoint = bool(trainer.cfg.checkpoint_dir)
    guard.check_can_go_on(trainer.step, have_checkpoint)
    to_step = trainer.roll_back() if have_checkpoint else None
    if to_step is None:
        guard.check_can_go_on(trainer.step, False)
        return
    guard.rolled_back(trainer.step, to_step)
    trainer.log.event("rolled_back", trainer.step, to_step=to_step)
    if trainer.ctx.is_main:
        print(f"ddpkit: rolled back to the checkpoint of step {to_step}", flush=True)
