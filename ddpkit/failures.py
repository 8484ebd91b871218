"""Which rank broke the job? Turning N rank failures into one root cause.

When one rank of a collective job dies, the others fail too, a little later and for a reason that is
not theirs: a peer's socket closes ("Connection closed by peer"), or a collective times out waiting for
a rank that will never arrive. A report that shows the first traceback it happens to read often shows
one of these knock-on failures and sends the reader after the wrong rank.

Failures are sorted by **what the rank was doing**, not by the words of the message:

* an exception raised **inside a collective** (from ``torch.distributed``, or from DDP's all-reduce
  inside ``backward``) is **knock-on**: the rank was waiting for, or talking to, its peers. An
  exception raised in the rank's own code is a candidate root cause, whatever it says: a user's
  ``TimeoutError("reading shard 3 timed out")`` is the cause, not a symptom;
* a rank that **exited** or was **killed** on its own is a candidate root cause, except a rank that
  NCCL's watchdog aborted (SIGABRT) after a collective timed out: its log says so, and it is knock-on;
* when every failure is knock-on, the ranks still running are **stalled**: they are what the others
  were waiting for (the launcher dumps their stacks before stopping them). A rank whose own stall
  watchdog fired (the trainer's step limit) is stalled too;
* ranks the launcher had to stop are listed as **stopped**.

Among candidates the earliest wins.
"""

from __future__ import annotations

import os
import signal
import traceback as tb
from dataclasses import dataclass

ROOT_KINDS = ("raised", "exited", "killed")
_COMM_CODE = (f"torch{os.sep}distributed{os.sep}", f"torch{os.sep}nn{os.sep}parallel{os.sep}")
_AUTOGRAD_ENGINE = f"torch{os.sep}autograd{os.sep}"
_COMM_WORDS = ("gloo", "nccl", "connection", "peer", "timed out", "collective", "process group", "socket")
# What NCCL's watchdog writes before it aborts a rank whose collective timed out.
_WATCHDOG_MARKS = ("watchdog caught collective operation timeout", "collective operation timeout",
                   "some nccl operations have failed or timed out")
STALL_MARK = "Timeout ("  # faulthandler.dump_traceback_later's header, written when a stall limit fires


@dataclass
class RankFailure:
    """What went wrong on one rank."""

    rank: int
    kind: str  # raised | exited | killed | stalled | stopped
    exc_type: str  # e.g. "ValueError", or "exit code 3", "SIGKILL", "stalled"
    message: str
    traceback: str = ""
    time: float = 0.0  # time.time() when it happened (or was noticed)
    knock_on: bool = False  # a consequence of another rank's failure (see the module docstring)
    user_error: bool = False  # the message names a fix the user can make (ddpkit.errors.UserError)

    @property
    def is_knock_on(self) -> bool:
        return self.knock_on

    def headline(self) -> str:
        what = self.kind if self.exc_type == self.kind else f"{self.kind}: {self.exc_type}"
        return f"rank {self.rank} {what}: {self.message}"


def raised_in_collective(exc: BaseException) -> bool:
    """True when ``exc`` came out of communication: torch.distributed's code, or DDP's all-reduce that
    runs inside the autograd engine during ``backward``. Decided by where it was raised and its type."""
    if not isinstance(exc, RuntimeError):  # DistError is a RuntimeError; ValueError & co. are argument bugs
        return False
    frames = tb.extract_tb(exc.__traceback__)
    where = frames[-1].filename if frames else ""
    if any(part in where for part in _COMM_CODE):
        return True
    if _AUTOGRAD_ENGINE in where:  # backward raised from C++: DDP's reducer, or an op's own error
        return any(word in str(exc).lower() for word in _COMM_WORDS)
    return False


def exit_failure(rank: int, exitcode: int, when: float, log_tail: str = "") -> RankFailure:
    """A rank that ended without a Python error record: os._exit(n), a signal, a C++ abort, a watchdog."""
    if exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else str(-exitcode)
        if name == "SIGABRT" and any(m in log_tail.lower() for m in _WATCHDOG_MARKS):
            line = next((ln.strip() for ln in log_tail.splitlines()
                         if any(m in ln.lower() for m in _WATCHDOG_MARKS)), "")
            return RankFailure(rank, "killed", name, f"aborted by NCCL's watchdog after a collective timed out ({line})",
                               log_tail, when, knock_on=True)
        return RankFailure(rank, "killed", name, f"rank process was killed by {name}", time=when)
    if STALL_MARK in log_tail and "most recent call first" in log_tail:
        stack = log_tail[log_tail.index(STALL_MARK):]
        return RankFailure(rank, "stalled", "stalled", "no training step finished within its stall limit "
                           "(the rank's own watchdog stopped it; its stack is below)", stack, when)
    return RankFailure(rank, "exited", f"exit code {exitcode}",
                       f"rank process exited with code {exitcode} before returning", time=when)


def pick_root_cause(failures: list[RankFailure]) -> RankFailure:
    """The failure that explains the others (see the module docstring for the order)."""
    if not failures:
        raise ValueError("pick_root_cause needs at least one failure")
    primary = [f for f in failures if f.kind in ROOT_KINDS and not f.is_knock_on]
    if primary:
        return min(primary, key=lambda f: (f.time, f.rank))
    stalled = [f for f in failures if f.kind == "stalled"]
    if stalled:
        return min(stalled, key=lambda f: (f.time, f.rank))
    return min(failures, key=lambda f: (f.time, f.rank))


class LaunchError(RuntimeError):
    """One or more ranks failed. ``root_cause`` names the rank to look at first."""

    def __init__(self, root_cause: RankFailure, others: list[RankFailure] | None = None,
                 log_dir: str = "") -> None:
        self.root_cause = root_cause
        self.others = list(others or [])
        self.log_dir = log_dir
        super().__init__(self.render())

    @classmethod
    def from_failures(cls, failures: list[RankFailure], log_dir: str = "") -> "LaunchError":
        root = pick_root_cause(failures)
        others = sorted((f for f in failures if f is not root), key=lambda f: f.rank)
        return cls(root, others, log_dir)

    @property
    def rank(self) -> int:
        """The root-cause rank."""
        return self.root_cause.rank

    @property
    def is_user_error(self) -> bool:
        """True when the root cause is an input the user can fix (its message says how)."""
        return self.root_cause.user_error

    def render(self) -> str:
        lines = [self.root_cause.headline()]
        if self.root_cause.traceback:
            lines += ["", self.root_cause.traceback.rstrip()]
        knock_on = [f for f in self.others if f.is_knock_on or f.kind == "stalled"]
        also = [f for f in self.others if f not in knock_on and f.kind != "stopped"]
        stopped = [f for f in self.others if f.kind == "stopped"]
        if also:
            lines += ["", "also failed (same or independent errors):"]
            lines += [f"  {f.headline()}" for f in also]
        if knock_on:
            lines += ["", "knock-on failures (consequences of the failure above, not causes):"]
            lines += [f"  {f.headline()}" for f in knock_on]
        if stopped:
            lines += ["", "stopped by the launcher: " + ", ".join(f"rank {f.rank}" for f in stopped)]
        if self.log_dir:
            lines += ["", f"full per-rank logs: {self.log_dir}"]
        return "\n".join(lines)
