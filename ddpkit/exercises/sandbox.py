"""Run a learner's code against an exercise's checks in a fresh, bounded sandbox, and read back a verdict.

Four kinds of process, and the learner's code runs in only one of them:

1. **The grading process** (a notebook's check cell, ``ddpkit check``, a test) writes the code to
   ``submission.py`` in a new folder and starts ``python -m ddpkit.exercises.sandbox FOLDER`` in a
   session of its own, with one pipe to read the verdicts from. It kills the whole session when the
   wall-clock limit passes or its resident memory exceeds the limit, and says whether it was still
   computing (too slow) or waiting (hung).
2. **The sandbox** fences itself in (:mod:`ddpkit.exercises.confine`: writes only in its folder, a heap
   limit), imports torch and the checks, measures this machine's baseline (:mod:`ddpkit.exercises.timing`,
   from which the grading process sizes the limit), then forks one process per case. It alone holds the
   pipe to the grading process, and writes each case's rows there as soon as the case is done (a limit
   reached later costs only the cases not done yet).
3. **A case's process** runs the exercise's checks. It never imports the learner's code: a check gets a
   :class:`~ddpkit.exercises.learner.LearnerRef` per contract name, and the learner's code runs in
   processes of the fourth kind, which send back plain data only (:mod:`ddpkit.exercises.learner`). The
   check decides here, from that data, with values it computes itself; the rows go to the sandbox over a
   pipe no learner process holds.
4. **The learner's processes** (ranks, single calls) are forked from the case's spawner
   (:mod:`ddpkit.exercises.spawner`) before any check ran, get only their own inputs, and are watched
   (:mod:`ddpkit.exercises.witness`) and fenced (:func:`~ddpkit.exercises.confine.install_guard`).

So nothing the learner's code does in its own processes (print ``PASSED``, rewrite the grader's
functions there, write a result file, exit early) reaches the verdict, except through the data its
functions return, which the check verifies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ddpkit.exercises import IN_SANDBOX_ENV, Result, timing

MEMORY_MB = 6144  # the whole sandbox (every rank together), resident
HEAP_MB = 4096  # each process's heap (RLIMIT_DATA)
IMPORT_ALLOWANCE_S = 60.0  # starting Python and importing torch, before the baseline is known
POLL_S = 0.5  # each poll reads /proc for the memory of the whole group: not too often
MESSAGE_LIMIT = 200  # characters of a check's sentence
RESULT_FD_ENV = "DDPKIT_SANDBOX_RESULT_FD"
ENDED = "the code ended the grader's process before its check finished (an exit, a crash, or a kill)"


def run(exercise_id: str, code: str | None = None, *, checks: list[str] | None = None,
        objects: dict[str, str] | None = None, time_scale: float = 1.0, memory_mb: int = MEMORY_MB) -> list[dict]:
    """Grade ``code`` (the learner's cells, as one module) for ``exercise_id``; one dict per check:
    ``check``, ``passed``, ``message``. ``objects`` names, for each contract name, where to find it
    (``"module:qualname"`` for an importable object) when it is not defined in ``code``."""
    case = {"exercise": exercise_id, "code": code, "checks": checks, "objects": objects}
    return run_many([case], time_scale=time_scale, memory_mb=memory_mb)[0]


def run_many(cases: list[dict], *, time_scale: float = 1.0, memory_mb: int = MEMORY_MB,
             preload: list[str] | tuple = ()) -> list[list[dict]]:
    """Grade several cases (each a dict with ``exercise``, ``code`` and optionally ``checks`` and
    ``objects``, as :func:`run` takes them) in ONE sandbox: Python, torch and the machine's baseline are
    paid once, then each case runs in its own process forked from it, so no state one case leaves behind
    reaches the next. The limits are the sum of the cases' (one hung case costs the cases after it their
    time: batch code whose worst outcome is bounded by the checks themselves). ``preload`` names trusted modules
    (a test module holding many cases' objects) imported once before the cases fork: never a learner's.
    One list of rows per case."""
    from ddpkit.exercises import catalog

    folder = tempfile.mkdtemp(prefix="ddpkit-sandbox-")
    requested, budget = [], 0.0
    for i, case in enumerate(cases):
        ex = catalog.exercise(case["exercise"])
        wanted = list(case.get("checks") or ex.checks)
        budget += ex.budget_units
        os.makedirs(os.path.join(folder, f"case-{i}"))
        with open(os.path.join(folder, f"case-{i}", "submission.py"), "w") as handle:
            handle.write(case.get("code") or "")
        requested.append({"exercise": ex.id, "checks": wanted, "objects": case.get("objects") or {}})
    with open(os.path.join(folder, "request.json"), "w") as handle:
        json.dump({"cases": requested, "preload": list(preload), "time_scale": time_scale,
                   "sys_path": [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)]}, handle)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    read_fd, write_fd = os.pipe()
    env.update({IN_SANDBOX_ENV: "1", "TMPDIR": folder, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0", "DDPKIT_PROGRESS": "off",
                RESULT_FD_ENV: str(write_fd)})
    received: list[bytes] = []
    reader = threading.Thread(target=_read_to_end, args=(read_fd, received), daemon=True)
    try:
        with open(os.path.join(folder, "output.log"), "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "ddpkit.exercises.sandbox", folder], cwd=folder, env=env,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, pass_fds=(write_fd,))
        os.close(write_fd)
        reader.start()
        verdict = _watch(proc, folder, budget * time_scale, memory_mb)
        _kill(proc)  # whatever the learner's code left running in the session goes with it
        reader.join(10)
        return _read_results(b"".join(received), requested, verdict)
    finally:
        import shutil

        if os.environ.get("DDPKIT_SANDBOX_KEEP") != "1":  # kept for debugging the grader itself
            shutil.rmtree(folder, ignore_errors=True)


def _read_to_end(fd: int, into: list[bytes]) -> None:
    try:
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return
            into.append(chunk)
    finally:
        os.close(fd)


def _watch(proc: subprocess.Popen, folder: str, budget_units: float, memory_mb: int) -> str | None:
    """Wait for the sandbox within its limits; None when it ended by itself, else the sentence why not."""
    started = time.monotonic()
    limit = IMPORT_ALLOWANCE_S + budget_units * timing.FLOOR_S / 5  # until the baseline arrives
    measured = False
    while proc.poll() is None:
        baseline = None if measured else _read_baseline(folder)
        if baseline is not None:  # from now on: the check's own budget, in this machine's baselines
            measured = True
            limit = time.monotonic() - started + min(timing.CEILING_S * 4, max(timing.FLOOR_S * 12, budget_units * baseline))
        if timing.group_rss_bytes(proc.pid) > memory_mb * 2**20:
            _kill(proc)
            return f"used more than {memory_mb / 1024:.3g} GB of memory: look for a tensor or a list that grows without end"
        if time.monotonic() - started > limit:
            busy = timing.group_busy(proc.pid)
            _kill(proc)
            if busy:
                return (f"too slow on this machine: still computing after {limit:.0f} s (a limit set from this "
                        f"machine's speed now); retry when it is less busy, or look for a loop that never ends")
            return f"hung: after {limit:.0f} s every process was waiting, using no CPU; look for a wait that nothing ends"
        time.sleep(POLL_S)
    return None


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_baseline(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "baseline.json")) as handle:
            return float(json.load(handle)["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_results(data: bytes, requested: list[dict], verdict: str | None) -> list[list[dict]]:
    """Each case's rows as the sandbox sent them, one JSON line per case done; a case it never reported gets
    ``verdict`` (the limit it ran into) on every check, or says that the process ended."""
    found: dict[int, list] = {}
    for line in data.split(b"\n"):
        try:
            message = json.loads(line.decode())
            found[int(message["case"])] = message["rows"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            continue
    out = []
    for i, r in enumerate(requested):
        if i not in found and verdict is not None:
            out.append([{"check": name, "passed": False, "message": verdict} for name in r["checks"]])
        else:
            out.append(rows(found.get(i, []), r["checks"]))
    return out


def rows(found, wanted: list[str]) -> list[dict]:
    """One row per wanted check from what a case sent (a missing or malformed row says the process ended)."""
    by_name = {r["check"]: r for r in found if isinstance(r, dict) and isinstance(r.get("check"), str)} \
        if isinstance(found, list) else {}
    out = []
    for name in wanted:
        r = by_name.get(name)
        if r is None or not isinstance(r.get("passed"), bool) or not isinstance(r.get("message"), str):
            r = {"check": name, "passed": False, "message": ENDED}
        out.append({"check": name, "passed": r["passed"], "message": _cut(r["message"])})
    return out


def _cut(text: str) -> str:
    return text if len(text) <= MESSAGE_LIMIT else text[:MESSAGE_LIMIT - 3].rstrip() + "..."


def check_objects(exercise_id: str, check: str, objects: tuple) -> Result:
    """A notebook's check cell: the learner's objects back to code, one check, in a sandbox."""
    from ddpkit.exercises import catalog
    from ddpkit.exercises.sources import code_of

    ex = catalog.exercise(exercise_id)
    names = ex.checks[check][1]
    try:
        code, refs = code_of(objects, names)
    except ValueError as exc:
        return Result(False, str(exc))
    row = run(exercise_id, code, checks=[check], objects=refs)[0]
    return Result(row["passed"], row["message"])


if __name__ == "__main__":
    from ddpkit.exercises import inside

    inside.main(sys.argv[1])
