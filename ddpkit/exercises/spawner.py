"""Where the processes that run the learner's code come from: a spawner forked before any check runs.

A process that runs the learner's code is a fork, and a fork is a copy of its parent's memory. If the
grader forked it from the process that runs the checks, it would carry that process's variables: the
expected values a check computed, every other rank's inputs, the seeds drawn for this run. So the case's
process forks this spawner first, before its checks run, while it holds nothing a learner could use;
later every learner process is forked from the spawner, and receives its own task (its rank's inputs
only) through a pipe of its own from the grader. The grader gets each child's pipes through a Unix
socket (``SCM_RIGHTS``), and each child's exit status through the spawner's exit pipe.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading

EXIT_LINE = 64  # bytes of one "pid status" record on the exit pipe, padded: reads never split one


class Spawner:
    """The grader's handle on the spawner process (see the module docstring)."""

    def __init__(self, close_in_children: list[int]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        exits_read, exits_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the spawner
            try:
                ours.close()
                os.close(exits_read)
                for fd in close_in_children:
                    _close(fd)
                _serve(theirs, exits_write)
            finally:
                os._exit(0)
        theirs.close()
        os.close(exits_write)
        self.pid, self.sock, self.exits = pid, ours, exits_read
        self.statuses: dict[int, int] = {}
        self._partial = b""

    def spawn(self, count: int) -> list[tuple[int, int, int]]:
        """``count`` new children, each waiting for its task: (pid, fd to write the task to, fd to read from)."""
        self.sock.sendall(json.dumps({"count": count}).encode() + b"\n")
        children = []
        for _ in range(count):
            message, fds, _, _ = socket.recv_fds(self.sock, 1024, 2)
            if len(fds) != 2:
                raise RuntimeError("the spawner did not hand over a child's pipes")
            children.append((int(message.decode()), fds[0], fds[1]))
        return children

    def pump_exits(self) -> None:
        """Read every exit status the spawner has reported so far (the fd is readable)."""
        chunk = os.read(self.exits, 1 << 16)
        self._partial += chunk
        while len(self._partial) >= EXIT_LINE:
            record, self._partial = self._partial[:EXIT_LINE], self._partial[EXIT_LINE:]
            pid, status = (int(x) for x in record.split())
            self.statuses[pid] = status

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.sock.close()
        _close(self.exits)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _serve(sock: socket.socket, exits: int) -> None:
    """The spawner's loop: fork children on request, hand their pipes over, report their exits."""
    from ddpkit import runtime

    runtime.die_with_parent()
    lock = threading.Lock()

    def reap() -> None:
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                threading.Event().wait(0.05)
                continue
            with lock:
                os.write(exits, f"{pid} {status}".ljust(EXIT_LINE).encode())

    threading.Thread(target=reap, daemon=True).start()
    buffer = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            for _ in range(int(json.loads(line)["count"])):
                _one_child(sock, exits)


def _one_child(sock: socket.socket, exits: int) -> None:
    task_read, task_write = os.pipe()
    out_read, out_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sock.close()
            for fd in (task_write, out_read, exits):
                _close(fd)
            from ddpkit.exercises import child

            code = child.child_main(task_read, out_write)
        finally:
            os._exit(code)
    os.close(task_read)
    os.close(out_write)
    socket.send_fds(sock, [str(pid).encode()], [task_write, out_read])
    os.close(task_write)
    os.close(out_read)
