"""Preemption: a SIGTERM becomes an emergency checkpoint that every rank writes at the same step.

Schedulers and spot/preemptible machines give notice before they take a job away: SIGTERM (Kubernetes;
torchrun passing on its own SIGTERM; Slurm on preemption or at the time limit, optionally preceded by a
signal of the job's choosing with ``--signal``), then SIGKILL a grace period later. A job
that saves in that window loses nothing; one that dies loses everything since its last checkpoint.

The notice may reach **one** rank (a scheduler signals one worker), the ``ddpkit train`` process
(which passes it on to every rank), or the whole process group (``kill -- -PGID``; Slurm signals the
processes of each job step; torchrun signals each worker's process group). Kubernetes sends SIGTERM only
to each container's main process (PID 1). Either way a rank must not act
on it alone. A checkpoint is a collective (gathering state, a barrier until it is durable): a rank that
decides by itself to save enters that collective while its peers enter the next step's gradient
all-reduce, and they wait on each other until the collective timeout ends the job with nothing saved
(``per_rank_decision_demo`` shows it, bounded by a short timeout). So:

1. the signal handler only sets a flag (a second signal, during the save, sets it again: no effect); the
   trainer installs it before it builds anything, and a rank starts with the signal dispositions its
   launcher had before it began forwarding (never the forwarder: a notice is not swallowed);
2. at every step boundary the ranks all-reduce the flag (MAX: one rank's notice is everyone's), so all
   stop after the **same** step;
3. all save there, with the ordinary atomic checkpoint protocol (a SIGKILL during the save leaves the
   previous checkpoint as the newest good one: nothing torn is ever loaded); unless the loss guard
   rejected that step (its state may be the damaged one): then nothing is saved, and the newest good
   checkpoint is where the resume starts. A notice at the last step of the run changes nothing: the
   run is complete;
4. the run ends with exit code :data:`PREEMPTED_EXIT`, one line naming the step, the checkpoint and the
   command that resumes it (a ``torchrun`` command under torchrun, without the ``--fail-*`` flags), and a
   :data:`MARKER` file in the checkpoint folder saying the same, for a wrapper that only sees
   torchrun's exit code; ``--resume`` then finishes bitwise equal to an uninterrupted run.

Under torchrun the notice comes from the worker's agent, and it means one of two things the worker
cannot tell apart: the agent is going away (it got SIGTERM itself), or a node is waiting to join and
the agent stops its workers to start a new rendezvous round with it (a scale-up; ``ddpkit/elastic.py``
cites the torch source). The same SIGTERM, from the same process, with the same grace period by
default (30 s, then SIGKILL). Saving is right in both: after a scale-up the new round resumes from the
saved step and loses nothing. So the line says both, and the exit code stays 75: torchrun reads it in
neither case (an agent drops the results of the workers it stopped).

DataLoader workers ignore SIGTERM (:func:`loader_worker_init`): a signal to the whole process group
must reach the rank as a notice, not kill the workers it is about to read from; they still die with
their rank. The flag costs one 4-byte all-reduce per step; it is armed only when there is a
``--checkpoint-dir`` to save to (without one, SIGTERM ends the ranks at once: exit code
:data:`TERMINATED_EXIT`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import os
import shlex
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit.files import write_atomic
from ddpkit.hooks import Hook, StepResult
from ddpkit.runtime import die_with_parent

PREEMPTED_EXIT = 75
"""Exit code of a preempted run (``EX_TEMPFAIL`` in sysexits.h: a temporary failure, try again):
distinct from 0 (done), 1 (failed) and 2 (bad input), so a wrapper script can resume on it."""
TERMINATED_EXIT = 128 + signal.SIGTERM
"""Exit code of a run stopped by SIGTERM with no ``--checkpoint-dir`` to save to (the shell's code for a
process killed by SIGTERM)."""
SIGNALS = (signal.SIGTERM,)
"""What a rank treats as notice. (SIGUSR1 is the launcher's "dump your stack" signal inside a rank; the
``ddpkit train`` process takes SIGTERM and SIGUSR1 and passes SIGTERM on.)"""
MARKER = "PREEMPTED.json"
"""Written into the checkpoint folder by a preempted ``ddpkit train``, removed when a run resumes from it."""
FAULT_FLAGS = ("--fail-at-step", "--fail-rank", "--fail-mode", "--slow-step-s")  # each takes a value


class Preemption(Hook):
    """The flag, the agreement and the emergency save, as a hook after the checkpoint cadence.

    ``agree=False`` is the broken version, kept to be measured: each rank acts on its own flag.
    """

    def __init__(self, agree: bool = True) -> None:
        self.agree = agree
        self.requested = False
        self.stopped_step: int | None = None  # the step every rank stopped after
        self.saved_step: int | None = None  # the emergency checkpoint's step (None: nothing was saved)
        self._previous: dict[int, object] = {}

    def install(self) -> "Preemption":
        """Take over the notice signals (in the main thread only: Python delivers signals there)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Give the signals back to the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:  # a flag only: the step boundary decides what happens
        self.requested = True

    def everyone_stops(self, ctx) -> bool:
        """True on every rank if any rank got notice (one all-reduce, MAX, over the world)."""
        flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        if self.agree and ctx.is_distributed:
            flag = flag.to(ctx.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.world_group)
        return bool(flag.item())

    def after_step(self, trainer, result: StepResult) -> None:
        if result.step >= trainer.cfg.steps:  # the run is complete (its last step saved): nothing to stop
            return
        if not self.everyone_stops(trainer.ctx):
            return
        self.stopped_step = result.step
        if trainer.step_rejected:  # the loss guard rejected this step: its state may be the damaged one
            trainer.log.event("preempted", result.step, saved=False)
        else:
            if not result.checkpoint_s:  # the cadence did not already save this step
                result.checkpoint_s, result.checkpoint_bytes = trainer.save()
            trainer.log.event("preempted", result.step, saved=True, checkpoint_s=result.checkpoint_s)
            self.saved_step = result.step
        trainer.stop_requested = True


def loader_worker_init(worker_id: int) -> None:
    """A DataLoader worker's start: ignore SIGTERM (the notice is its rank's to act on, and a signal to
    the process group reaches every worker too) and die with the rank (``PR_SET_PDEATHSIG``)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()


# ----------------------------------------------------------------------------- the ddpkit train process

class Notice:
    """What the ``ddpkit train`` process saw: the signal it was given, if any."""

    received: int | None = None


_FORWARDING: dict = {}  # while passed_on_to_ranks is active: the handlers it replaced


def _restore_in_forked_child() -> None:
    """A process forked while SIGTERM is forwarded (a rank) starts with the handlers there were before:
    the forwarder would pass its notice to the rank's own children and swallow it."""
    if _FORWARDING:
        previous = _FORWARDING.pop("previous")
        _FORWARDING.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


os.register_at_fork(after_in_child=_restore_in_forked_child)


@contextlib.contextmanager
def passed_on_to_ranks():
    """In the ``ddpkit train`` process: SIGTERM or SIGUSR1 is passed on to every rank as SIGTERM (the
    ranks then agree on a step and save; this process waits for them as usual). Yields a
    :class:`Notice` that records the signal."""
    notice = Notice()

    def forward(signum, frame):
        notice.received = signum
        for child in multiprocessing.active_children():
            with contextlib.suppress(OSError):
                os.kill(child.pid, signal.SIGTERM)

    if threading.current_thread() is not threading.main_thread():
        yield notice
        return
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    _FORWARDING["previous"] = previous
    try:
        yield notice
    finally:
        _FORWARDING.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def resume_args(argv: list[str]) -> list[str]:
    """``ddpkit`` arguments that resume a run started with ``argv``: without the fault flags (an injected
    fault is a lesson, not part of the run) and the flags a resume refuses, with ``--resume``."""
    kept, skip_value = [], False
    for arg in argv:
        if skip_value:
            skip_value = False
            continue
        name = arg.split("=", 1)[0]
        if name in FAULT_FLAGS:
            skip_value = "=" not in arg
        elif arg not in ("--overwrite-checkpoints", "--resume"):
            kept.append(arg)
    return [*kept, "--resume"]


def torchrun_launcher(argv: list[str]) -> list[str]:
    """Under torchrun: its command line up to ``argv`` (ddpkit's own arguments), read from its agent, which
    is this worker's parent (``/proc``); from the environment torchrun sets when that cannot be read."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
        if argv and len(parent) > len(argv) and parent[-len(argv):] == argv:
            prefix = parent[:-len(argv)]
            if len(prefix) > 1 and os.path.basename(prefix[1]) == "torchrun":  # python .../bin/torchrun
                return ["torchrun", *prefix[2:]]
            if prefix[1:3] == ["-m", "torch.distributed.run"]:  # the same program, torchrun's console script
                return ["torchrun", *prefix[3:]]
            return prefix
    nodes, per_node = os.environ.get("GROUP_WORLD_SIZE", "1"), os.environ.get("LOCAL_WORLD_SIZE", "1")
    where = ["--standalone"] if nodes == "1" else ["--nnodes", nodes]
    return ["torchrun", *where, "--nproc-per-node", per_node, "-m", "ddpkit"]


def resume_command(argv: list[str], launcher: list[str] | None = None) -> str:
    """The command line that resumes a run started with ``ddpkit <argv>`` (or ``<launcher> <argv>``)."""
    return shlex.join([*(launcher or ["ddpkit"]), *resume_args(argv)])


def write_marker(checkpoint_dir: str, stopped_step: int, saved: bool, checkpoint: str | None, command: str) -> Path:
    """The preemption, as a file in the checkpoint folder: what a wrapper script needs when all it sees is
    an exit code that does not say "preempted" (torchrun exits 1 whatever its workers' codes were)."""
    path = Path(checkpoint_dir) / MARKER
    record = {"preempted_after_step": stopped_step, "saved": saved, "checkpoint": checkpoint,
              "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "exit_code": PREEMPTED_EXIT, "resume_command": command}
    write_atomic(path, json.dumps(record, indent=1), durable=True)
    return path


def clear_marker(checkpoint_dir: str) -> None:
    """The run resumed from this folder: it is no longer waiting to be resumed."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(Path(checkpoint_dir) / MARKER)


TORCHRUN_NOTE = ("under torchrun this may be a membership change instead (the agent stops its workers to "
                 "admit a node): then torchrun starts new workers itself, they resume from that checkpoint, "
                 "and there is nothing to do; if torchrun itself was stopped, ")
"""What the preempted line says under torchrun, where a scale-up and a shutdown send the same SIGTERM."""


def preempted_line(stopped_step: int, saved: bool, checkpoint: str | None, command: str,
                   under_torchrun: bool = False) -> str:
    """The one line a preempted run ends with."""
    resume = f"{TORCHRUN_NOTE if under_torchrun else ''}resume with: {command}"
    if saved:
        return f"ddpkit: preempted: every rank stopped after step {stopped_step} and saved it to {checkpoint}; {resume}"
    return (f"ddpkit: preempted: every rank stopped after step {stopped_step}, which the loss guard rejected, so "
            f"nothing was saved; the newest good checkpoint is {checkpoint or 'none (the resume starts at step 0)'}; "
            f"{resume}")


def per_rank_decision_demo(ctx, trainer_class, cfg, notice_rank: int = 1, notice_step: int = 2,
                           agree: bool = False) -> dict:
    """Train ``cfg`` with ``trainer_class`` (``ddpkit.train.Trainer``) with notice reaching only
    ``notice_rank`` after ``notice_step`` steps (a function for ``ddpkit.launch``, with a short
    ``timeout``). ``agree=False``: each rank decides alone, the noticed rank enters the save's collectives
    while the others enter the next step's, and the launch fails within the collective timeout.
    ``agree=True``: every rank stops and saves at the same step."""

    class NoticeToOneRank(Hook):
        def after_step(self, trainer, result):
            if ctx.rank == notice_rank and result.step == notice_step:
                trainer.preemption.requested = True

    trainer = trainer_class(ctx, cfg, hooks=[NoticeToOneRank()])
    trainer.preemption.agree = agree
    summary = trainer.fit()
    return {"rank": ctx.rank, "stopped_at": summary["steps"], "emergency_checkpoint_step": summary["emergency_checkpoint_step"]}
