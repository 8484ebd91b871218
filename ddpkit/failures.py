"""Which rank broke the job? Turning N rank failures into one root cause.

When one rank of a collective job dies, the others fail too, a little later and for a reason that is
not theirs: a peer's socket closes ("Connection closed by peer"), or a collective times out waiting for
a rank that will never arrive. A report that shows the first traceback it happens to read often shows
one of these knock-on failures and sends the reader after the wrong rank. This module sorts failures
into the cause and its consequences:

* a rank that **raised** an ordinary exception, or **exited** / was **killed** on its own, is a
  candidate root cause; the earliest candidate wins;
* a rank whose error reads like a lost peer or an expired collective timeout is **knock-on**;
* when every failure is knock-on, the ranks still running are **stalled**: they are what the others
  were waiting for (the launcher dumps their stacks before stopping them);
* ranks the launcher had to stop are listed as **stopped**.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

# Messages (gloo, NCCL, c10d store) that mean "my peer is gone" or "my peer never came".
KNOCK_ON_MARKERS = (
    "connection closed by peer", "connection reset by peer", "broken pipe",
    "timed out", "timeout", "socket closed", "communicator was aborted",
    "failed to recv", "failed to send", "distnetworkerror", "connection refused",
)

ROOT_KINDS = ("raised", "exited", "killed")


@dataclass
class RankFailure:
    """What went wrong on one rank."""

    rank: int
    kind: str  # raised | exited | killed | stalled | stopped
    exc_type: str  # e.g. "ValueError", or "exit code 3", "SIGKILL", "stalled"
    message: str
    traceback: str = ""
    time: float = 0.0  # time.time() when it happened (or was noticed)

    @property
    def is_knock_on(self) -> bool:
        """True when the error reads like a consequence of another rank's failure."""
        if self.kind != "raised":
            return False
        text = f"{self.exc_type} {self.message}".lower()
        return any(marker in text for marker in KNOCK_ON_MARKERS)

    def headline(self) -> str:
        what = self.kind if self.exc_type == self.kind else f"{self.kind}: {self.exc_type}"
        return f"rank {self.rank} {what}: {self.message}"


def exit_failure(rank: int, exitcode: int, when: float) -> RankFailure:
    """A rank that ended without a Python error record: os._exit(n), a signal, a C++ abort."""
    if exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else str(-exitcode)
        return RankFailure(rank, "killed", name, f"rank process was killed by {name}", time=when)
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
        return min(stalled, key=lambda f: f.rank)
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
