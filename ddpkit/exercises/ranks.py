"""Start a check's processes, ranks or a single call, and collect what each sent back, within limits.

Each child gets a task (:func:`ddpkit.exercises.learner.task`): the grader's worker and its arguments,
and, for ranks, its rank and a gloo process group over a ``FileStore``. A task that involves the
learner's code (a :class:`~ddpkit.exercises.learner.LearnerRef` among its arguments) is run by a child
of the case's spawner (:mod:`ddpkit.exercises.spawner`), which receives only its own task; any other
(the grader measuring something itself) is forked from here. Either way the child answers with one
``result`` or ``error`` message on its own pipe (:mod:`ddpkit.exercises.channel`), never a pickle.

Limits: when one child has answered, the others get ``timeout`` more seconds (a peer that waits in a
collective gives up after ``timeout`` too); when one raised or ended without a word, the others stop
half a second later (``GRACE_S`` when what it raised is a timeout of its own waiting, which its peers in the
same wait report too); nobody gets more than ``limit`` in all; with ``idle_after``, children that all use
no CPU for that long are taken as stuck (a deadlock shows that way at once). A child given up on is
killed, and whether it was still using the CPU then tells "too slow" from "hung". As soon as the guard
of a learner's process reports a forbidden implementation or a refused escape, everything stops: that
is the verdict already.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import signal
import tempfile
import time
from dataclasses import dataclass, field

from ddpkit.exercises import channel, learner, timing
from ddpkit.exercises import child as child_process

NOTHING = object()
GRACE_S = 2.0  # after a peer answered and the collective timeout passed: time to report the timeout itself
ERROR_GRACE_S = 0.5  # after one child raised: time for the others to report their own errors, then they stop
SAMPLE_S = 0.25


@dataclass
class Child:
    pid: int
    inbox: channel.Inbox
    rank: int | None = None
    status: int | None = None  # wait status, once it ended
    result: object = NOTHING
    error: dict | None = None
    stalled: bool = False
    busy: bool = False
    answered_at: float | None = None
    died_at: float | None = None
    cpu: list = field(default_factory=list)  # (wall, cpu seconds) samples
    spawner: object = None  # the spawner that forked it, or None when forked here
    learner: bool = False  # it runs the learner's code: what its guard saw goes to the session

    def how_it_ended(self) -> str:
        if self.status is None:
            return "still running"
        if os.WIFSIGNALED(self.status):
            return f"killed by {signal.Signals(os.WTERMSIG(self.status)).name}"
        return f"exit code {os.WEXITSTATUS(self.status)}"


def has_learner_code(value) -> bool:
    if isinstance(value, learner.LearnerRef):
        return True
    if isinstance(value, (list, tuple)):
        return any(has_learner_code(v) for v in value)
    if isinstance(value, dict):
        return any(has_learner_code(v) for v in value.values())
    return False


def rank_tasks(worker, args, kwargs, world_size: int, timeout: float, rank_args=None) -> list[dict]:
    """One task per rank of a gloo job of ``world_size`` (``rank_args[r]`` appended to rank r's arguments)."""
    store = os.path.join(tempfile.mkdtemp(prefix="ddpkit-store-"), "store")
    uses_learner = has_learner_code([args, kwargs, rank_args])
    tasks = []
    for rank in range(world_size):
        t = learner.task(worker, args, kwargs, rank=rank, world_size=world_size, store=store, timeout=timeout,
                         rank_args=tuple(rank_args[rank]) if rank_args else (), log=_log(rank))
        if not uses_learner:
            t.pop("learner", None)
        tasks.append(t)
    return tasks


def _log(rank: int) -> str | None:
    session = learner.SESSION
    if session is None:
        return None
    return os.path.join(session.logdir or session.workdir, f"rank{rank}-{os.getpid()}-{time.monotonic_ns()}.log")


def start(tasks: list[dict], timeout: float, limit: float | None = None, idle_after: float | None = None) -> list[Child]:
    """Run ``tasks`` at once (see the module docstring); each child's outcome, in order."""
    children = spawn(tasks)
    try:
        collect(children, timeout, max(4 * timeout, 20.0) if limit is None else limit, idle_after)
    finally:
        close(children)
    return children


def spawn(tasks: list[dict]) -> list[Child]:
    """Start a child per task (through the case's spawner when a task runs the learner's code)."""
    session = learner.SESSION
    via = session.spawner if session is not None and any(t.get("learner") for t in tasks) else None
    children = _spawn(tasks, via)
    for t, child in zip(tasks, children):
        child.rank, child.spawner, child.learner = t.get("rank"), via, bool(t.get("learner"))
        fcntl.fcntl(child.inbox.fd, fcntl.F_SETFL, fcntl.fcntl(child.inbox.fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    return children


def close(children: list[Child]) -> None:
    """Kill what still runs, wait for the ends, read what is left, hand the guard's findings to the session."""
    for child in children:
        if child.status is None:
            _kill(child.pid)
    _reap(children)
    session = learner.SESSION
    for child in children:
        _drain(child)
        os.close(child.inbox.fd)
        if session is not None and child.learner:
            session.take(child.inbox)


def _spawn(tasks: list[dict], spawner) -> list[Child]:
    children = []
    if spawner is not None:
        for (pid, task_fd, out_fd), t in zip(spawner.spawn(len(tasks)), tasks):
            data = pickle.dumps(t)
            view = memoryview(data)
            while view:
                view = view[os.write(task_fd, view):]
            os.close(task_fd)
            children.append(Child(pid, channel.Inbox(out_fd, t["nonce"])))
        return children
    import sys

    for t in tasks:
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read)
                for child in children:  # the pipes of the children forked before this one
                    os.close(child.inbox.fd)
                code = child_process.run_task(t, write)
            finally:
                os._exit(code)
        os.close(write)
        children.append(Child(pid, channel.Inbox(read, t["nonce"])))
    return children


def pump(children: list[Child], wait: float) -> None:
    """Read whatever the children sent within ``wait`` seconds, and their exits."""
    spawner = children[0].spawner if children else None
    fds = [c.inbox.fd for c in children if not c.inbox.closed]
    if spawner is not None:
        fds.append(spawner.exits)
    for fd in learner.wait_readable(fds, wait):
        if spawner is not None and fd == spawner.exits:
            spawner.pump_exits()
            continue
        next(c for c in children if c.inbox.fd == fd).inbox.pump()
    for child in children:
        _update(child)


def collect(children: list[Child], timeout: float, limit: float, idle_after: float | None = None) -> None:
    """Wait for the children's answers within the limits (see the module docstring)."""
    started = time.monotonic()
    first_answer = None
    last_sample = 0.0
    while any(c.status is None for c in children):
        pump(children, 0.05)
        now = time.monotonic()
        for child in children:
            if child.answered_at is None and (child.result is not NOTHING or child.error):
                child.answered_at = now
                first_answer = first_answer or now
            elif child.answered_at is None and child.status is not None and child.died_at is None:
                child.died_at = now  # ended without a word: its peers will wait for it in vain
        waiting = [c for c in children if c.status is None and c.answered_at is None]
        if not waiting:
            if all(c.status is not None for c in children):
                break
            if now - min(c.answered_at for c in children if c.answered_at) > GRACE_S + 1:
                break  # they answered, and linger (a learner's thread): kill them below
            continue
        if now - last_sample >= SAMPLE_S:
            last_sample = now
            for child in waiting:
                child.cpu.append((now, _cpu_seconds(child.pid)))
        failed = [c.answered_at for c in children if c.error and not c.error.get("knock_on")] + \
            [c.died_at for c in children if c.died_at]
        gave_up = [c.answered_at for c in children if c.error and c.error.get("knock_on")]  # a peer's timeout: the
        # others, in the same wait, report theirs within moments; a rank that does not is the one they waited for
        over = (first_answer is not None and now - first_answer > timeout + GRACE_S) or now - started > limit \
            or (failed and now - min(failed) > ERROR_GRACE_S) or (gave_up and now - min(gave_up) > GRACE_S)
        stuck = idle_after is not None and now - started > idle_after and all(_idle(c, idle_after) for c in waiting)
        if any(_caught(c) for c in children):  # the verdict is already that sentence: no need to wait
            for child in waiting:
                child.stalled = True
                _kill(child.pid)
            break
        if over or stuck:
            raised = any(c.error and not c.error.get("knock_on") for c in children)  # the cause is known
            busy = {c.pid: False for c in waiting} if raised else _busy([c.pid for c in waiting])
            for child in waiting:
                child.stalled, child.busy = True, busy[child.pid]
                _kill(child.pid)
            break


def _caught(child: Child) -> bool:
    """Did the child's guard see a forbidden implementation run, or refuse an escape?"""
    return child.learner and any(kind == "finding" and payload[0] in ("forbidden", "refused")
                                 for kind, payload in child.inbox.messages)


def _messages(child: Child) -> None:
    for kind, payload in child.inbox.messages:
        if kind == "result" and child.result is NOTHING:
            child.result = payload
        elif kind == "error" and child.error is None and isinstance(payload, dict):
            child.error = payload


def _update(child: Child) -> None:
    _messages(child)
    if child.status is None:
        if child.spawner is not None:
            child.status = child.spawner.statuses.get(child.pid)
        else:
            try:
                pid, status = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = child.pid, 0
            if pid:
                child.status = status


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _idle(child: Child, window: float) -> bool:
    if not child.cpu or child.cpu[-1][0] - child.cpu[0][0] < window:
        return False
    end_wall, end_cpu = child.cpu[-1]
    start_wall, start_cpu = next((w, c) for w, c in child.cpu if end_wall - w <= window)
    return end_wall - start_wall >= window * 0.8 and (end_cpu - start_cpu) / max(end_wall - start_wall, 1e-9) < timing.BUSY_FRACTION


def _busy(pids: list[int], window_s: float = 0.5) -> dict[int, bool]:
    """Did each process use the CPU during the next ``window_s`` seconds?"""
    first = {pid: _cpu_seconds(pid) for pid in pids}
    time.sleep(window_s)
    return {pid: (_cpu_seconds(pid) - first[pid]) / window_s > timing.BUSY_FRACTION for pid in pids}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(children: list[Child]) -> None:
    deadline = time.monotonic() + 5
    spawner = children[0].spawner if children else None
    while any(c.status is None for c in children) and time.monotonic() < deadline:
        if spawner is not None and learner.wait_readable([spawner.exits], 0.05):
            spawner.pump_exits()
        for child in children:
            _update(child)
        if spawner is None:
            time.sleep(0.01)


def _drain(child: Child) -> None:
    """Read what the child left in its pipe (it ended; a child of its own may still hold the pipe open)."""
    for _ in range(1000):
        if child.inbox.closed or not learner.wait_readable([child.inbox.fd], 0):
            break
        child.inbox.pump()
    _messages(child)
