"""Preemption: a SIGTERM becomes an emergency checkpoint that every rank writes at the same step.

Schedulers and spot/preemptible machines give notice before they take a job away: SIGTERM (Kubernetes,
torchrun passing on its own SIGTERM, Slurm with ``--signal``), then SIGKILL a grace period later. A job
that saves in that window loses nothing; one that dies loses everything since its last checkpoint.

The notice may reach **one** rank (a scheduler signals one worker) or the ``ddpkit train`` process,
which passes it on to every rank. Either way a rank must not act on it alone. A checkpoint is a
collective (gathering state, a barrier until it is durable): a rank that decides by itself to save
enters that collective while its peers enter the next step's gradient all-reduce, and they wait on
each other until the collective timeout ends the job with nothing saved (``per_rank_decision_demo``
shows it, bounded by a short timeout). So:

1. the signal handler only sets a flag (a second signal, during the save, sets it again: no effect);
2. at every step boundary the ranks all-reduce the flag (MAX: one rank's notice is everyone's), so all
   stop after the **same** step;
3. all save there, with the ordinary atomic checkpoint protocol (a SIGKILL during the save leaves the
   previous checkpoint as the newest good one: nothing torn is ever loaded);
4. the run ends with exit code :data:`PREEMPTED_EXIT` and one line naming the step, the folder and the
   command that resumes it; ``--resume`` then finishes bitwise equal to an uninterrupted run.

The flag costs one 4-byte all-reduce per step; it is armed only when there is a ``--checkpoint-dir`` to
save to (without one, SIGTERM ends the ranks at once, as before).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading

import torch
import torch.distributed as dist

from ddpkit.hooks import Hook, StepResult

PREEMPTED_EXIT = 75
"""Exit code of a preempted run (``EX_TEMPFAIL`` in sysexits.h: a temporary failure, try again):
distinct from 0 (done), 1 (failed) and 2 (bad input), so a wrapper script can resume on it."""
SIGNALS = (signal.SIGTERM,)
"""What a rank treats as notice. (SIGUSR1 is the launcher's "dump your stack" signal inside a rank; the
``ddpkit train`` process takes SIGTERM and SIGUSR1 and passes SIGTERM on.)"""


class Preemption(Hook):
    """The flag, the agreement and the emergency save, as a hook after the checkpoint cadence.

    ``agree=False`` is the broken version, kept to be measured: each rank acts on its own flag.
    """

    def __init__(self, agree: bool = True) -> None:
        self.agree = agree
        self.requested = False
        self.saved_step: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "Preemption":
        """Take over the notice signals (in the main thread only: Python delivers signals there)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:  # a flag only: the step boundary decides what happens
        self.requested = True

    def everyone_stops(self, trainer) -> bool:
        """True on every rank if any rank got notice (one all-reduce, MAX, over the world)."""
        flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        if self.agree and trainer.ctx.is_distributed:
            flag = flag.to(trainer.ctx.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=trainer.ctx.world_group)
        return bool(flag.item())

    def after_step(self, trainer, result: StepResult) -> None:
        if not self.everyone_stops(trainer):
            return
        if not result.checkpoint_s:  # the cadence did not already save this step
            result.checkpoint_s, result.checkpoint_bytes = trainer.save()
        trainer.log.event("preempted", result.step, checkpoint_s=result.checkpoint_s)
        self.saved_step = result.step
        trainer.stop_requested = True


@contextlib.contextmanager
def passed_on_to_ranks():
    """In the ``ddpkit train`` process: SIGTERM or SIGUSR1 is passed on to every rank as SIGTERM (the
    ranks then agree on a step and save; this process waits for them as usual)."""
    def forward(signum, frame):
        for child in multiprocessing.active_children():
            with contextlib.suppress(OSError):
                os.kill(child.pid, signal.SIGTERM)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def resume_command(argv: list[str]) -> str:
    """The command line that resumes a run started with ``ddpkit <argv>``."""
    import shlex

    kept = [a for a in argv if a not in ("--overwrite-checkpoints", "--resume")]
    return shlex.join(["ddpkit", *kept, "--resume"])


def per_rank_decision_demo(ctx, cfg, notice_rank: int = 1, notice_step: int = 2, agree: bool = False) -> dict:
    """Train ``cfg`` with notice reaching only ``notice_rank`` after ``notice_step`` steps (a function for
    ``ddpkit.launch``, with a short ``timeout``). ``agree=False``: each rank decides alone, the noticed
    rank enters the save's collectives while the others enter the next step's, and the launch fails
    within the collective timeout. ``agree=True``: every rank stops and saves at the same step."""
    from ddpkit.train import Trainer

    class Notice(Hook):
        def after_step(self, trainer, result):
            if ctx.rank == notice_rank and result.step == notice_step:
                trainer.preemption.requested = True

    trainer = Trainer(ctx, cfg, hooks=[Notice()])
    trainer.preemption.agree = agree
    summary = trainer.fit()
    return {"rank": ctx.rank, "stopped_at": summary["steps"], "emergency_checkpoint_step": summary["emergency_checkpoint_step"]}
