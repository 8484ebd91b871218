"""What a process forked to run a task does: read the task, become a learner's process if the task runs
the learner's code, join the gloo job if it is a rank, run the grader's worker, and send back its result
or its error as plain data (:mod:`ddpkit.exercises.channel`).

The order matters. The senders (the result's, and the guard's for its findings) are made first, while
nothing of the learner's is loaded; the process group is joined before the watched implementations are
watched (joining calls none of them, but nothing is left to chance); then the forbidden implementations
report their calls and the guard is installed (:mod:`ddpkit.exercises.witness`,
:mod:`ddpkit.exercises.confine`); only then may the worker load the learner's code, on first use of a
:class:`~ddpkit.exercises.learner.LearnerRef`.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import sys
import time

from ddpkit.exercises import channel, learner


def child_main(task_fd: int, out_fd: int) -> int:
    """A child of the spawner: read its task, become a learner's process, run the task, report. Returns
    the exit code."""
    chunks = []
    while True:
        chunk = os.read(task_fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(task_fd)
    task = pickle.loads(b"".join(chunks))  # written by the grader a moment ago: trusted, unlike what goes back
    return run_task(task, out_fd)


def run_task(task: dict, out_fd: int) -> int:
    """Run ``task`` (see :func:`ddpkit.exercises.learner.task`) in this fresh child and send its outcome."""
    from ddpkit import runtime

    send, report = channel.senders(out_fd, task["nonce"])  # before anything of the learner's can load
    runtime.die_with_parent()
    log = task.get("log")
    if log:
        _redirect_output(log)
    torch_threads()
    try:
        ctx = None
        if task.get("world_size"):
            ctx = _join(task)
        if task.get("learner"):
            _become_learner(task, report)
        worker, args, kwargs = task["worker"], list(task["args"]), dict(task.get("kwargs") or {})
        args += list(task.get("rank_args") or ())
        if task.get("progress"):
            kwargs["progress"] = lambda payload: send("progress", payload)
        result = worker(ctx, *args, **kwargs) if ctx is not None else worker(*args, **kwargs)
        if ctx is not None:
            import torch.distributed as dist

            dist.barrier()  # nobody leaves while a peer may still be talking to it
        send("result", result)
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure, SystemExit included, is reported
        send("error", _error_record(exc))
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


_KNOCK_ON = re.compile(r"timed out|connection closed|connection reset|broken pipe|\bpeers?\b", re.I)  # whole
# words: "TypeError" holds "peer" too


def _error_record(exc: BaseException) -> dict:
    from ddpkit.failures import raised_in_collective

    text = str(exc).strip()
    try:
        knock_on = raised_in_collective(exc)
    except Exception:  # noqa: BLE001
        knock_on = False
    knock_on = knock_on or bool(_KNOCK_ON.search(text))
    return {"type": type(exc).__name__[:60], "message": (text.splitlines() or [""])[0][:300],
            "knock_on": bool(knock_on), "time": time.time()}


def _join(task: dict):
    import datetime

    import torch.distributed as dist

    from ddpkit.runtime import RankContext

    rank, world = task["rank"], task["world_size"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    store = dist.FileStore(task["store"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=task["timeout"]))
    import torch

    return RankContext(rank, rank, world, world, "gloo", torch.device("cpu"))


def _become_learner(task: dict, report) -> None:
    """Watch the forbidden implementations, install the guard, then allow the learner's code to load."""
    from ddpkit.exercises import confine, witness

    files, ids = witness.watch(task["forbidden"])
    thread_files, thread_ids = witness.watch_threads()
    files, ids = files | thread_files, ids | thread_ids
    if task.get("watch_files"):
        witness.watch_files()
    confine.install_guard(task["workdir"], report, protected_code=files,
                          watched_ids=ids, watch_files=bool(task.get("watch_files")))
    learner._STATE.update(learner=True, submission=task["submission"], refs=dict(task["refs"]), namespace=None)


def torch_threads() -> None:
    import torch

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (it would hang)


def _redirect_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0, closefd=False), line_buffering=True,
                                  write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0, closefd=False), line_buffering=True,
                                  write_through=True)
