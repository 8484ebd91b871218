"""Start torchft replica processes by forking one that has already imported torch and torchft.

A replica group of :mod:`ddpkit.ft_replicas` is a process of its own, as it would be on its own machine.
Started as ``python -m ddpkit.ft_replicas``, each one pays for ``import torch`` and ``import torchft``
(about 2-3 s of CPU each; four drills at once start nine of them on two cores), and its first optimizer
imports ``torch._dynamo`` (3 s more). A *zygote* pays once: it imports them, then forks a child per
replica it is asked for, which runs :func:`ddpkit.ft_replicas.main` with its own arguments and exits.
The same trick as Android's zygote and as ``multiprocessing``'s ``forkserver`` start method. It is safe
here because the zygote starts no thread and no torchft runtime before it forks: each child builds its
own store, process group and manager.

:class:`Zygote` forks the zygote from the calling process (a notebook kernel, a test), which imports
torch, torchft and ``torch._dynamo`` first, so the zygote is up at once instead of after a cold start
of its own (seconds of CPU, tens of seconds on a busy 2-core machine); the caller's threads do not exist
in the zygote, and its standard streams are replaced first, as :func:`ddpkit.elastic_drill.fork_agent`
does for a torchrun agent. ``python -m ddpkit.ft_zygote`` runs the same loop on its stdin and stdout.

Protocol (JSON lines): the controller writes ``{"id", "argv", "out"}`` to the zygote; the zygote
answers ``{"id", "pid"}`` once it has forked, and ``{"exit": pid, "code": code}`` when that child ends
(``code`` negative for a signal, as :class:`subprocess.Popen` reports it). Closing its input ends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
import warnings

from ddpkit.runtime import die_with_parent


def _import_what_replicas_need() -> None:
    """torch and torchft, and ``torch._dynamo``, which a replica's first optimizer imports (about 3 s of CPU):
    once, in the process that forks, not once per child."""
    from ddpkit import ft_replicas

    ft_replicas.available()
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401


def serve(requests: int = 0, out=None, close_in_children: tuple[int, ...] = ()) -> None:
    """The zygote's loop: fork a replica per request read from the file descriptor ``requests``, answer on
    ``out`` (default: stdout), report each child's exit. Runs until its input closes. A child closes the
    descriptors in ``close_in_children`` (the zygote's own pipes: a child holding them open would keep
    the controller from ever seeing them close)."""
    from ddpkit import ft_replicas

    _import_what_replicas_need()
    out = out or sys.stdout
    children: set[int] = set()
    say = lambda obj: (out.write(json.dumps(obj) + "\n"), out.flush())  # noqa: E731
    say({"ready": True})
    buffered, open_stdin = b"", True
    while open_stdin or children:
        if open_stdin and select.select([requests], [], [], 0.02)[0]:
            chunk = os.read(requests, 65536)
            open_stdin = bool(chunk)
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    for fd in close_in_children:
                        os.close(fd)
                    _child(request["argv"], request["out"], ft_replicas.main)
                children.add(pid)
                say({"id": request["id"], "pid": pid})
        elif not open_stdin:
            time.sleep(0.02)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(argv: list[str], out: str, main) -> None:
    """In the forked child: stdout and stderr to ``out``, stdin from /dev/null, run, and exit (never return)."""
    code = 1
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a child must never return into the zygote's loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Child:
    """A replica the zygote forked: ``pid``, ``poll()`` and ``returncode`` as :class:`subprocess.Popen` has them,
    and ``finished_at``: the ``time.monotonic()`` of the first ``poll()`` that saw it exited."""

    def __init__(self, zygote: "Zygote", pid: int) -> None:
        self.zygote, self.pid, self.returncode, self.finished_at = zygote, pid, None, None

    def poll(self) -> int | None:
        self.returncode = self.zygote.exits.get(self.pid)
        if self.returncode is not None and self.finished_at is None:
            self.finished_at = time.monotonic()
        return self.returncode

    def wait(self, timeout: float = 30.0) -> int:
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > end:
                raise TimeoutError(f"replica process {self.pid} did not exit within {timeout:.0f} s")
            time.sleep(0.02)
        return self.returncode


class Zygote:
    """The controller's side: fork the zygote from this process, ask it for replicas (thread-safe), close it."""

    def __init__(self, timeout_s: float = 120.0, show=None) -> None:
        from ddpkit.rank import FORK_WARNING

        _import_what_replicas_need()  # here, before the fork: the zygote inherits them
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()  # a forked child must not inherit (and print again) unflushed output
        with warnings.catch_warnings():  # Python 3.12 warns about forking a threaded process: see ddpkit.launch
            warnings.filterwarnings("ignore", message=FORK_WARNING, category=DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _zygote_main(requests_r, answers_w, (requests_w, answers_r))
        os.close(requests_r)
        os.close(answers_w)
        self.pid, self.returncode, self._reaping = pid, None, threading.Lock()
        self._requests = os.fdopen(requests_w, "w", buffering=1)
        self._answers = os.fdopen(answers_r, "r")
        self.exits: dict[int, int] = {}
        self._pids: dict[int, int] = {}
        self._lock, self._next = threading.Lock(), 0
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        started = time.monotonic()
        while not self._ready.wait(3.0):  # a notebook cell says what it waits for, every few seconds
            if time.monotonic() - started > timeout_s or self.poll() is not None:
                self.close()
                raise TimeoutError(f"the replica zygote did not start within {timeout_s:.0f} s")
            if show is not None:
                show(f"... starting the replica zygote ({time.monotonic() - started:.0f} s)")

    def poll(self) -> int | None:
        """The zygote's exit code once it has ended (negative for a signal), else None."""
        with self._reaping:  # the drills' threads poll it too: one waitpid at a time
            if self.returncode is None:
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def _read(self) -> None:
        for line in self._answers:
            message = json.loads(line)
            if "ready" in message:
                self._ready.set()
            elif "exit" in message:
                self.exits[message["exit"]] = message["code"]
            else:
                self._pids[message["id"]] = message["pid"]

    def start(self, argv: list[str], out: str, timeout_s: float = 30.0) -> Child:
        """Fork a replica running ``python -m ddpkit.ft_replicas ARGV``, its output in ``out``."""
        with self._lock:
            self._next += 1
            ident = self._next
            self._requests.write(json.dumps({"id": ident, "argv": argv, "out": out}) + "\n")
            self._requests.flush()
        end = time.monotonic() + timeout_s
        while ident not in self._pids:
            if self.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the replica zygote did not fork (exit code {self.poll()})")
            time.sleep(0.005)
        return Child(self, self._pids.pop(ident))

    def close(self, timeout_s: float = 30.0) -> None:
        """Close its input: it exits once its children have (the caller stops any that should not go on)."""
        with contextlib.suppress(OSError):
            self._requests.close()
        end = time.monotonic() + timeout_s
        while self.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with self._reaping:
                os.waitpid(self.pid, 0)
                self.returncode = -signal.SIGKILL


def _zygote_main(requests: int, answers: int, parents_ends: tuple[int, ...]) -> None:
    """In the forked zygote: the caller's ends of the pipes closed, standard streams of its own, the loop,
    and ``os._exit`` (never a return into the caller's code, nor its exit handlers)."""
    code = 1
    try:
        for fd in parents_ends:
            os.close(fd)
        die_with_parent()  # no zygote left behind if the caller is killed
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh Python's handlers, not the caller's
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # what a replica of its own would be given
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdin = open(os.devnull)  # noqa: SIM115 - the process ends with os._exit
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - fd 1, not a kernel's stream object
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        serve(requests, os.fdopen(answers, "w", buffering=1), close_in_children=(requests, answers))
        code = 0
    except BaseException:  # noqa: BLE001 - a forked child must never return into the caller
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve()
