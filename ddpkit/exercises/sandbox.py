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
   pipe to the grading process, and writes every case's rows there at the end.
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
from typing import Any

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
    reaches the next. The limits are the sum of the cases' (one hung case costs the whole batch its time:
    batch code whose worst outcome is bounded by the checks themselves). ``preload`` names trusted modules
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
        if verdict is None:
            return _read_results(b"".join(received), requested)
        return [[{"check": name, "passed": False, "message": verdict} for name in r["checks"]] for r in requested]
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
            return f"used more than {memory_mb // 1024} GB of memory: look for a tensor or a list that grows without end"
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


def _read_results(data: bytes, requested: list[dict]) -> list[list[dict]]:
    try:
        found = json.loads(data.decode())["cases"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        found = []
    return [rows(found[i] if i < len(found) else [], r["checks"]) for i, r in enumerate(requested)]


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


# ----------------------------------------------------------------------------------- inside the sandbox


def _sandbox(folder: str) -> None:
    result_fd = int(os.environ.pop(RESULT_FD_ENV))
    with open(os.path.join(folder, "request.json")) as handle:
        request = json.load(handle)
    sys.path[:0] = [*request["sys_path"]]
    from ddpkit.exercises import confine

    isolation = confine.landlock_writes_only_under([folder, "/dev/shm", "/dev/null"])
    confine.limit_memory(HEAP_MB)
    tempfile.tempdir = folder

    import torch  # noqa: F401 - imported before the learner's code: its import-time work is not theirs

    from ddpkit.exercises import catalog, channel, ranks, spawner, witness  # noqa: F401 - all before the forks

    for case in request["cases"]:  # the check modules, imported once before the cases fork
        ex = catalog.exercise(case["exercise"])
        for name in case["checks"]:
            catalog.check_of(ex.id, name)
        for ref in ex.forbidden:
            witness.resolve(ref)
    from ddpkit.launch import _import_what_ranks_need

    _import_what_ranks_need()
    from ddpkit.exercises import holdings

    holdings.warm_up()  # what every rank's first optimizer step would import (seconds): inherited instead
    import importlib

    for module in request.get("preload", []):
        importlib.import_module(module)
    seconds = timing.probe()
    with open(os.path.join(folder, "baseline.json"), "w") as handle:
        json.dump({"seconds": seconds, "isolation": isolation}, handle)
    import gc

    gc.collect()
    gc.freeze()  # what is alive now stays: the forked processes' collections skip it (and do not copy its pages)
    results = []
    for i, case in enumerate(request["cases"]):
        started = time.monotonic()
        results.append(_run_case(os.path.join(folder, f"case-{i}"), case, result_fd))
        print(f"case {i} ({case['exercise']}): {time.monotonic() - started:.1f} s", flush=True)  # for the log
    data = json.dumps({"cases": results}).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(result_fd, view):]
    os.close(result_fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_case(folder: str, case: dict, result_fd: int) -> list:
    """Fork the case's process and read its rows (JSON, on a pipe of its own)."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(result_fd)  # the sandbox's own pipe to the grading process: never in a case's process
            os.close(read)
            found = _case(folder, case, write)
            data = json.dumps(found).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(write, view):]
        except BaseException:  # noqa: BLE001 - a grader bug: its traceback goes to the sandbox's log
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    try:
        return json.loads(b"".join(chunks).decode())
    except (ValueError, UnicodeDecodeError):
        return []


def _case(folder: str, case: dict, upstream: int) -> list[dict]:
    """One case, in its own process: its checks, run against the learner's code in learner processes."""
    from ddpkit.exercises import catalog, learner, spawner

    ex = catalog.exercise(case["exercise"])
    session = learner.Session(submission=os.path.join(folder, "submission.py"), refs=dict(case["objects"]),
                              forbidden=dict(ex.forbidden), workdir=os.path.dirname(folder), logdir=folder)
    session.spawner = spawner.Spawner(close_in_children=[upstream])
    learner.SESSION = session
    try:
        checks = {name: catalog.check_of(ex.id, name) for name in case["checks"]}
        defined, loaded, at_load = _probe(session, ex)
        tampered_at_load = session.tampered
        out = []
        for name, check in checks.items():
            session.findings, session.files, session.tampered = list(at_load), [], tampered_at_load
            out.append({"check": name, **_one_check(ex, name, check, defined, loaded, session)})
        return out
    finally:
        learner.SESSION = None
        session.spawner.close()


def _defined(names: list[str]) -> list[str]:
    from ddpkit.exercises import learner

    found = learner.namespace()
    return [n for n in names if n in found]


def _probe(session, ex) -> tuple[list[str], str | None, list]:
    """Load the learner's code once, in a learner's process: which contract names it defines, or why it
    could not be loaded; and what the guard saw while it loaded."""
    from ddpkit.exercises import learner

    try:
        defined = learner.call(_defined, list(ex.names))
        loaded = None
    except (learner.Raised, NotImplementedError) as exc:
        defined = []
        kind = getattr(exc, "type_name", type(exc).__name__)
        loaded = f"the code raised {kind} when run: {learner.short(str(exc), 150)}" \
            if kind not in ("hung", "too slow", "died") else f"the code, when loaded, {learner.short(str(exc), 150)}"
    return defined, loaded, list(session.findings)


def _one_check(ex, name: str, check, defined: list[str], loaded: str | None, session) -> dict:
    from ddpkit.exercises import learner, not_implemented

    names = ex.checks[name][1]
    result = None
    if loaded is not None:
        result = Result(False, loaded)
    elif any(n not in defined for n in names):
        missing = next(n for n in names if n not in defined)
        result = Result(False, f"{missing} is not defined between the markers: keep the name the contract gives")
    elif not session.tampered and not any(kind in ("refused", "forbidden") for kind, _ in session.findings):
        try:
            result = check(*(learner.LearnerRef(n) for n in names))
        except NotImplementedError:
            result = not_implemented(names[0])
        except learner.Raised as exc:
            result = Result(False, exc.sentence(names[0]))
        except BaseException as exc:  # noqa: BLE001 - a check must answer, whatever the code did
            result = Result(False, f"the check stopped: {type(exc).__name__}: {learner.short(str(exc), 120)}")
    refused = [text for kind, text in session.findings if kind == "refused"]
    forbidden = [text for kind, text in session.findings if kind == "forbidden"]
    if refused:
        return {"passed": False, "message": f"the code tried {refused[0]}, which the grader does not allow: "
                                            f"write the exercise, not around its check"}
    if forbidden:
        return {"passed": False, "message": f"{names[0] if len(names) == 1 else 'the code'} {forbidden[0]}"}
    if session.tampered:
        return {"passed": False, "message": "the code wrote into the grader's pipe: write the exercise, not around "
                                            "its check"}
    return {"passed": bool(result.passed), "message": str(result.message)}


if __name__ == "__main__":
    _sandbox(sys.argv[1])
