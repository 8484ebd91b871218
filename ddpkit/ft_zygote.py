"""Start torchft replica processes by forking one that has already imported torch and torchft.

A replica group of :mod:`ddpkit.ft_replicas` is a process of its own, as it would be on its own machine.
Started as ``python -m ddpkit.ft_replicas``, each one pays for ``import torch`` and ``import torchft``
(about 2-3 s of CPU each; four drills at once start nine of them on two cores). A *zygote* pays once:
``python -m ddpkit.ft_zygote`` imports them, then forks a child per replica it is asked for, which runs
:func:`ddpkit.ft_replicas.main` with its own arguments and exits. The same trick as Android's zygote and
as ``multiprocessing``'s ``forkserver`` start method. It is safe here because the zygote starts no thread
and no torchft runtime before it forks: each child builds its own store, process group and manager.

Protocol (JSON lines): the controller writes ``{"id", "argv", "out"}`` on the zygote's stdin; the zygote
answers ``{"id", "pid"}`` once it has forked, and ``{"exit": pid, "code": code}`` when that child ends
(``code`` negative for a signal, as :class:`subprocess.Popen` reports it). Closing its stdin ends it.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
import traceback


def serve() -> None:
    """The zygote's loop: fork a replica per request, report each child's exit. Runs until stdin closes."""
    from ddpkit import ft_replicas

    ft_replicas.available()  # imports torch and torchft, once, before any fork
    import torch  # noqa: F401

    children: set[int] = set()
    say = lambda obj: (sys.stdout.write(json.dumps(obj) + "\n"), sys.stdout.flush())  # noqa: E731
    say({"ready": True})
    buffered, open_stdin = b"", True
    while open_stdin or children:
        if open_stdin and select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 65536)
            open_stdin = bool(chunk)
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
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
    """The controller's side: start the zygote, ask it for replicas (thread-safe), close it."""

    def __init__(self, timeout_s: float = 120.0, show=None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "ddpkit.ft_zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.exits: dict[int, int] = {}
        self._pids: dict[int, int] = {}
        self._lock, self._next = threading.Lock(), 0
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        started = time.monotonic()
        while not self._ready.wait(3.0):  # a notebook cell says what it waits for, every few seconds
            if time.monotonic() - started > timeout_s or self.proc.poll() is not None:
                self.close()
                raise TimeoutError(f"the replica zygote did not import torch and torchft within {timeout_s:.0f} s")
            if show is not None:
                show(f"... importing torch and torchft once for every replica ({time.monotonic() - started:.0f} s)")

    def _read(self) -> None:
        for line in self.proc.stdout:
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
            self.proc.stdin.write(json.dumps({"id": ident, "argv": argv, "out": out}) + "\n")
            self.proc.stdin.flush()
        end = time.monotonic() + timeout_s
        while ident not in self._pids:
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the replica zygote did not fork (exit code {self.proc.poll()})")
            time.sleep(0.005)
        return Child(self, self._pids.pop(ident))

    def close(self, timeout_s: float = 30.0) -> None:
        """Close its stdin: it exits once its children have (the caller stops any that should not go on)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    serve()
