"""The launcher's parent side: relay the ranks' output, notice how each one ended, and never wait forever.

The monitor polls every few milliseconds. Each pass it

* **relays** new output from every rank's log file as ``[rank N] ...``. A line ends at ``\\n``; a
  progress bar ends its updates with ``\\r`` instead, and each update is relayed as it comes, ending in
  ``\\r`` too, so a notebook or a terminal redraws it in place. Text that has waited a moment without
  any line end is shown as well (ending in ``\\r``, so the finished line replaces it later);
* **records** each rank that ended: a clean return (exit 0 and a result file), a Python exception
  (the rank's error record), or an exit without one (an exit code, a signal, a watchdog);
* runs the **watchdog**: once a rank has failed, the others get a short window to report their own
  (knock-on) failures; if every failure is knock-on, the ranks still alive are the ones the others
  were waiting for, so they are named *stalled*, their Python stacks are dumped (SIGUSR1 makes
  faulthandler write them into their logs), so are their Flight Recorder rings when the ranks record
  (SIGUSR2, see :func:`ddpkit.debug.flight.dump_on_signal`), and they are stopped. A rank still running
  long after another finished cleanly is stalled too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from typing import Any

from ddpkit.debug.flight import DUMP_PREFIX
from ddpkit.failures import RankFailure, exit_failure, own_frames

POLL_S = 0.005  # parent poll period: adds at most this much latency to a launch
KNOCK_ON_WINDOW_S = 1.0  # after the first failure, how long survivors get to report theirs
STACK_WAIT_S = 0.3  # faulthandler writes a stack at once (from C, on the signal)
DUMP_WAIT_S = 1.0  # at most this long for a stalled rank's Flight Recorder dump (Python, between bytecodes)
PARTIAL_SHOW_S = 0.25  # show text without a line end once it has waited this long
TAIL_BYTES = 16_384  # how much of a dead rank's log to read for its last words
_LINE_END = re.compile(rb"\r\n|\n|\r")


class Monitor:
    """Watches one launch's ranks (see the module docstring)."""

    def __init__(self, world_size: int, run_dir: str, output: str, timeout: float, display: Any = None,
                 dump_signal: int | None = None) -> None:
        self.world_size, self.run_dir, self.output, self.timeout = world_size, run_dir, output, timeout
        self.display = display  # a ddpkit.progress.Display, polled between passes
        self.dump_signal = dump_signal  # makes a rank dump its Flight Recorder ring; None: ranks do not record
        self.logs: dict[int, Any] = {}
        self.pending: dict[int, tuple[bytes, float, int]] = {}  # rank -> (unended text, last change, bytes shown)

    def path(self, rank: int, suffix: str) -> str:
        return os.path.join(self.run_dir, f"rank{rank}.{suffix}")

    def watch(self, procs: list[Any]) -> list[RankFailure]:
        """Poll until every rank has ended or been given up on; return the failures."""
        finished: dict[int, float] = {}  # rank -> when it returned cleanly
        failures: dict[int, RankFailure] = {}
        first_failure_at = None
        while True:
            self.relay()
            if self.display is not None:
                self.display.poll()
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank in finished or rank in failures or proc.exitcode is None:
                    continue
                failure = self.ended(rank, proc.exitcode)
                if failure is None:
                    finished[rank] = now
                else:
                    failures[rank] = failure
                    first_failure_at = first_failure_at or now
            alive = [r for r in range(len(procs)) if r not in finished and r not in failures]
            if not alive:
                break
            verdict = None  # (kind, why) once we stop waiting for the ranks still alive
            if first_failure_at is not None and now - first_failure_at > KNOCK_ON_WINDOW_S:
                if all(f.is_knock_on for f in failures.values()):
                    verdict = ("stalled", "the other ranks timed out or lost their peers waiting for it")
                else:
                    verdict = ("stopped", "stopped by the launcher after another rank failed")
            elif finished and now - min(finished.values()) > self.timeout + KNOCK_ON_WINDOW_S:
                verdict = ("stalled", f"still running {self.timeout:g}s after rank "
                                      f"{min(finished, key=finished.get)} finished")
            if verdict:
                for rank in alive:
                    failures[rank] = self.give_up_on(rank, procs[rank], *verdict)
                break
            time.sleep(POLL_S)
        self.relay()
        return list(failures.values())

    def ended(self, rank: int, exitcode: int) -> RankFailure | None:
        """None if the rank returned cleanly, else what went wrong."""
        if os.path.exists(self.path(rank, "error.json")):
            with open(self.path(rank, "error.json")) as handle:
                rec = json.load(handle)
            return RankFailure(rank, "raised", rec["type"], rec["message"], rec["traceback"], rec["time"],
                               knock_on=rec.get("in_collective", False), user_error=rec.get("user_error", False))
        if exitcode == 0 and os.path.exists(self.path(rank, "result")):
            return None
        return exit_failure(rank, exitcode, time.time(), self.log_tail(rank))

    def give_up_on(self, rank: int, proc: Any, kind: str, why: str) -> RankFailure:
        """Stop waiting for a rank that is still running; for a stalled one, capture where it is stuck."""
        stack = ""
        if kind == "stalled" and proc.pid is not None:
            mark = self.log_size(rank)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)  # faulthandler writes its stack to the log
            time.sleep(STACK_WAIT_S)
            stack = own_frames(self.log_tail(rank, mark))
            if self.dump_signal is not None:
                self.request_dump(rank, proc)
        return RankFailure(rank, kind, kind, why, stack, time.time())

    def request_dump(self, rank: int, proc: Any) -> bool:
        """Ask a stalled rank for its Flight Recorder ring and wait (at most ``DUMP_WAIT_S``) until it is
        written; True when it was. A rank blocked inside a C++ call cannot answer: the report says so."""
        path = os.path.join(self.run_dir, f"{DUMP_PREFIX}{rank}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, self.dump_signal)
        end = time.monotonic() + DUMP_WAIT_S
        while not os.path.exists(path) and time.monotonic() < end and proc.exitcode is None:
            time.sleep(POLL_S)
        return os.path.exists(path)

    def log_size(self, rank: int) -> int:
        with contextlib.suppress(OSError):
            return os.path.getsize(self.path(rank, "log"))
        return 0

    def log_tail(self, rank: int, offset: int | None = None) -> str:
        """The log from ``offset`` on, or its last few KiB."""
        with contextlib.suppress(OSError), open(self.path(rank, "log"), "rb") as handle:
            handle.seek(offset if offset is not None else max(0, self.log_size(rank) - TAIL_BYTES))
            return handle.read().decode(errors="replace")
        return ""

    def shows(self, rank: int) -> bool:
        return self.output == "all" or (self.output == "rank0" and rank == 0)

    def relay(self) -> None:
        """Copy new output of each rank to our stdout, prefixed ``[rank N]`` (see the module docstring)."""
        now = time.monotonic()
        wrote = False
        for rank in range(self.world_size):
            handle = self.logs.get(rank)
            if handle is None:
                if not os.path.exists(self.path(rank, "log")):
                    continue
                handle = self.logs[rank] = open(self.path(rank, "log"), "rb")  # noqa: SIM115 - closed in close()
            text, since, shown = self.pending.get(rank, (b"", now, 0))
            chunk = handle.read()
            if chunk:
                data = text + chunk
                pieces, ends = _LINE_END.split(data), _LINE_END.findall(data)
                for piece, end in zip(pieces, ends):
                    if piece or end != b"\r":  # a bare \r before a progress update carries nothing
                        wrote |= self._emit(rank, piece, "\r" if end == b"\r" else "\n")
                text, since = pieces[-1], now
                if ends:
                    shown = 0
            if len(text) > shown and now - since > PARTIAL_SHOW_S:
                wrote |= self._emit(rank, text, "\r")  # the finished line will be drawn over it
                shown = len(text)
            self.pending[rank] = (text, since, shown)
        if wrote:
            sys.stdout.flush()
            if self.display is not None:
                self.display.note_output()

    def _emit(self, rank: int, text: bytes, end: str) -> bool:
        if not self.shows(rank):
            return False
        sys.stdout.write(f"[rank {rank}] {text.decode(errors='replace')}{end}")
        return True

    def interrupted(self, ranks: int, started: float) -> KeyboardInterrupt:
        """What an interrupted launch raises: a plain ``KeyboardInterrupt``, so the cell or script stops as
        it always does (a script still exits by SIGINT: CPython does that only for that exact type), whose
        message is one line: how many ranks were stopped, at which step rank 0 last reported (its progress
        file), or after how long when it reports none. IPython shows an exception's
        ``_render_traceback_()`` instead of its traceback, so a notebook shows just that line, not the
        monitor's frames."""
        step = None
        with contextlib.suppress(OSError), open(os.path.join(self.run_dir, "progress.jsonl")) as handle:
            for line in handle:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    step = int(json.loads(line)["step"])
        where = f"at step {step}" if step is not None else f"after {time.monotonic() - started:.1f} s"
        line = f"interrupted: {ranks} rank{'s' if ranks != 1 else ''} stopped {where}"
        stopped = KeyboardInterrupt(line)
        stopped._render_traceback_ = lambda: [line]  # type: ignore[attr-defined]
        return stopped

    def close(self, relay: bool = True) -> None:
        """Relay what is left, ending unfinished lines, and close the log files. ``relay=False`` after an
        interrupt: what the ranks wrote since is their own interruption, which the one line says."""
        if relay:
            self.relay()
            for rank, (text, _, _) in self.pending.items():
                if text:
                    self._emit(rank, text, "\n")
        sys.stdout.flush()
        if self.display is not None:
            self.display.close()
        for handle in self.logs.values():
            handle.close()
        self.logs.clear()
        self.pending.clear()
