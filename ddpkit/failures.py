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
import re
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
RANK_ENTRY = f"ddpkit{os.sep}rank.py"  # the first frame of a rank's own code: rank_main
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line \d+ in (?P<func>\S+)')
_SOURCE_PATH = re.compile(r"\[(?:[^\]]*/)?([^/\]]+\.(?:cc|cpp|h)):\d+\]\s*")
_NOISE_PREFIXES = ("Got the following error when running the callback:", "RuntimeError:", "DistBackendError:")


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
        """One line. A knock-on failure's message is cut to its first meaningful line: its full text is
        about the peer that went away, which the root cause already explains (the logs keep it all)."""
        what = self.kind if self.exc_type == self.kind else f"{self.kind}: {self.exc_type}"
        return f"rank {self.rank} {what}: {brief(self.message) if self.knock_on else self.message}"


def brief(message: str) -> str:
    """The first meaningful line of a communication error: gloo's and NCCL's messages wrap the cause
    in callback prefixes and C++ source paths, and add advice that is about the peer, not this rank.

    ``"Got the following error when running the callback: RuntimeError: [/path/gloo/.../pair.cc:537]
    Read error [127.0.0.1]:37794: Connection reset by peer. This is typically caused by ..."`` becomes
    ``"Read error [127.0.0.1]:37794: Connection reset by peer (pair.cc)"``.
    """
    line = next((ln.strip() for ln in message.splitlines() if ln.strip()), "")
    stripped = True
    while stripped:
        stripped = False
        for prefix in _NOISE_PREFIXES:
            if line.startswith(prefix):
                line, stripped = line[len(prefix):].strip(), True
    for advice in (". This is typically caused by", ". This may indicate"):
        line = line.partition(advice)[0]  # advice about the peer, not this rank
    source = _SOURCE_PATH.search(line)
    if source:
        line = (line[:source.start()] + line[source.end():]).strip() + f" ({source.group(1)})"
    return line


def knock_on_line(exc: BaseException) -> str:
    """What a rank prints when a collective failed under it: one line, not a traceback of the peer's death."""
    return f"knock-on failure inside a collective (a peer failed or timed out): {type(exc).__name__}: {brief(str(exc))}"


def own_frames(stack: str) -> str:
    """A faulthandler stack cut to the rank's own frames.

    A rank forked from a notebook inherits the kernel's whole call stack (the event loop, the cell that
    called ``launch``, multiprocessing's start-up), and faulthandler prints it under the rank's frames.
    Everything below ``rank_main`` is the launching process, not the rank: replaced by one line.
    Stacks are never cut anywhere else (what is kept is complete).
    """
    lines, out, dropped, skipping = stack.splitlines(), [], 0, False
    for line in lines:
        frame = _FRAME.match(line)
        if frame is None:
            if skipping and dropped:
                out.append(f"  ... {dropped} frame(s) of the launching process omitted")
            skipping, dropped = False, 0
            out.append(line)
            continue
        if skipping:
            dropped += 1
            continue
        out.append(line)
        if frame.group("file").endswith(RANK_ENTRY) and frame.group("func") == "rank_main":
            skipping = True
    if skipping and dropped:
        out.append(f"  ... {dropped} frame(s) of the launching process omitted")
    return "\n".join(out)


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
        return RankFailure(rank, "killed", name, "the process was killed by a signal, with no Python error "
                           "(the OOM killer, a preempted node, kill -9)" if name == "SIGKILL"
                           else "the process was killed by a signal, with no Python error", time=when)
    if STALL_MARK in log_tail and "most recent call first" in log_tail:
        stack = own_frames(log_tail[log_tail.index(STALL_MARK):])
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
                 log_dir: str = "", flight_summary: str = "") -> None:
        self.root_cause = root_cause
        self.others = list(others or [])
        self.log_dir = log_dir
        self.flight_summary = flight_summary  # what the ranks' Flight Recorder rings say (a stall), or ""
        super().__init__(self.render())

    @classmethod
    def from_failures(cls, failures: list[RankFailure], log_dir: str = "", flight_summary: str = "") -> LaunchError:
        root = pick_root_cause(failures)
        others = sorted((f for f in failures if f is not root), key=lambda f: f.rank)
        return cls(root, others, log_dir, flight_summary)

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
        if self.flight_summary:
            lines += ["", self.flight_summary]
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
