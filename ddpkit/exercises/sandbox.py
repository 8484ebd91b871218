"""Run a learner's code against an exercise's checks in a fresh, bounded process, and read back a verdict.

The parent (a notebook's check cell, ``ddpkit check``, a test) never executes the learner's code. It
writes the code to ``submission.py`` in a new folder and starts ``python -m ddpkit.exercises.sandbox
FOLDER`` in its own session. The child, before importing the submission:

1. fences itself in (:mod:`ddpkit.exercises.confine`: writes only in its folder, no escape hatches, a
   heap limit);
2. installs the witnesses (:mod:`ddpkit.exercises.witness`) that see the kit's or PyTorch's own answer
   run on the learner's behalf;
3. measures this machine's baseline (:mod:`ddpkit.exercises.timing`) and writes it down, so the parent
   can size the wall-clock limit.

Then, for each case it was given (one for a learner's notebook; several when a test grades many variants
at once, :func:`run_many`), it forks a process that imports the submission (its output goes to a log
nobody grades), runs the exercise's checks on real ranks, and writes the case's ``result.json``: JSON
only, never a pickle, so nothing the learner's process writes can run code in the parent. The parent kills the whole session when the wall-clock limit passes
or when its resident memory exceeds the limit, and then says whether it was still computing (too slow)
or waiting (hung).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from ddpkit.exercises import IN_SANDBOX_ENV, Result, timing

MEMORY_MB = 6144  # the whole sandbox (every rank together), resident
HEAP_MB = 4096  # each process's heap (RLIMIT_DATA)
IMPORT_ALLOWANCE_S = 60.0  # starting Python and importing torch, before the baseline is known
POLL_S = 0.5  # each poll reads /proc for the memory of the whole group: not too often


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
    paid once, then each case runs in its own child forked from it, so no state one case leaves behind
    reaches the next. The limits are the sum of the cases' (one hung case costs the whole batch its time:
    batch code whose worst outcome is bounded by the checks themselves). ``preload`` names trusted modules
    (a test module holding many cases' objects) imported once before the cases fork, and so before any
    witness watches: never a learner's. One list of rows per case."""
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
        json.dump({"cases": requested, "preload": list(preload), "sys_path": [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)],
                   "time_scale": time_scale}, handle)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update({IN_SANDBOX_ENV: "1", "TMPDIR": folder, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0", "DDPKIT_PROGRESS": "off"})
    with open(os.path.join(folder, "output.log"), "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ddpkit.exercises.sandbox", folder], cwd=folder, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        verdict = _watch(proc, folder, budget * time_scale, memory_mb)
    try:
        if verdict is None:
            return [_read_results(os.path.join(folder, f"case-{i}"), r["checks"]) for i, r in enumerate(requested)]
        return [[{"check": name, "passed": False, "message": verdict} for name in r["checks"]] for r in requested]
    finally:
        import shutil

        if os.environ.get("DDPKIT_SANDBOX_KEEP") != "1":  # kept for debugging the grader itself
            shutil.rmtree(folder, ignore_errors=True)


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
    except ProcessLookupError:
        pass
    proc.wait()


def _read_baseline(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "baseline.json")) as handle:
            return float(json.load(handle)["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_results(folder: str, wanted: list[str]) -> list[dict]:
    try:
        with open(os.path.join(folder, "result.json")) as handle:
            found = json.load(handle)
        by_name = {r["check"]: r for r in found if isinstance(r, dict) and isinstance(r.get("check"), str)}
    except (OSError, ValueError, TypeError):
        by_name = {}
    out = []
    for name in wanted:
        r = by_name.get(name)
        if r is None or not isinstance(r.get("passed"), bool) or not isinstance(r.get("message"), str):
            r = {"check": name, "passed": False, "message": "the code ended the grader's process before its check "
                                                            "finished (an exit, a crash, or a kill)"}
        out.append({"check": name, "passed": r["passed"], "message": r["message"][:300]})
    return out


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


def _child(folder: str) -> None:
    with open(os.path.join(folder, "request.json")) as handle:
        request = json.load(handle)
    sys.path[:0] = [*request["sys_path"]]
    from ddpkit.exercises import confine

    isolation = confine.landlock_writes_only_under([folder, "/dev/shm", "/dev/null"])
    confine.limit_memory(HEAP_MB)
    tempfile.tempdir = folder

    import torch  # noqa: F401 - imported before the learner's code: its import-time work is not theirs

    from ddpkit.exercises import catalog, witness

    for case in request["cases"]:  # the check modules, imported once before the cases fork
        for name in case["checks"]:
            catalog.check_of(case["exercise"], name)
    from ddpkit.launch import _import_what_ranks_need

    _import_what_ranks_need()
    import importlib

    for module in request.get("preload", []):
        importlib.import_module(module)
    seconds = timing.probe()
    with open(os.path.join(folder, "baseline.json"), "w") as handle:
        json.dump({"seconds": seconds, "isolation": isolation}, handle)
    witness.install_file_witness()
    for i, case in enumerate(request["cases"]):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the case runs here; the sandbox's own process stays as the learner found it
            try:
                _case(os.path.join(folder, f"case-{i}"), case)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _case(folder: str, case: dict) -> None:
    """One case, in its own forked process: watch what runs, import the learner's code, run its checks,
    write ``result.json`` in the case's folder."""
    from ddpkit.exercises import catalog, confine, witness

    sys.path.insert(0, folder)  # importable by spawned ranks too, as ``submission``
    ex = catalog.exercise(case["exercise"])
    learner_file = os.path.join(folder, "submission.py")
    log = os.path.join(folder, "findings.log")
    watcher = witness.ForbiddenCalls(ex.forbidden, {learner_file}, log)
    guard = confine.AuditGuard(os.path.dirname(folder), {learner_file}, log)
    checks = {name: catalog.check_of(ex.id, name) for name in case["checks"]}
    watcher.install()
    guard.install()
    results = []
    try:
        namespace = _import_submission(learner_file, case["objects"])
        loaded = None
        for name in case["objects"]:  # code given by reference (a module's object) is the learner's too
            from ddpkit.exercises.sources import _code_file

            extra = _code_file(namespace[name])
            if extra:
                watcher.learner_files.add(extra)
                guard.learner_files.add(extra)
    except BaseException as exc:  # noqa: BLE001 - the learner's import failed: every check says why
        namespace, loaded = {}, f"the code raised {type(exc).__name__} when run: {_first_line(exc)}"
    for name, check in checks.items():
        open(log, "w").close()
        watcher.hits.clear()
        results.append({"check": name, **_one_check(ex, name, check, namespace, loaded, watcher, log)})
    tmp = os.path.join(folder, "result.json.tmp")
    with open(tmp, "w") as handle:
        json.dump(results, handle)
    os.replace(tmp, os.path.join(folder, "result.json"))
    sys.stdout.flush()
    sys.stderr.flush()


def _import_submission(path: str, objects: dict[str, str]) -> dict[str, Any]:
    import importlib.util

    from ddpkit.exercises import witness

    spec = importlib.util.spec_from_file_location(witness.SUBMISSION_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[witness.SUBMISSION_MODULE] = module  # importable by spawned ranks too
    spec.loader.exec_module(module)
    namespace = dict(vars(module))
    for name, ref in objects.items():
        found = witness.resolve(ref)
        if found is None:
            raise ImportError(f"cannot find {ref}")
        namespace[name] = found
    return namespace


def _one_check(ex, name: str, check, namespace: dict, loaded: str | None, watcher, log: str) -> dict:
    from ddpkit.exercises.witness import findings

    names = ex.checks[name][1]
    if loaded is not None:
        return {"passed": False, "message": loaded}
    missing = [n for n in names if n not in namespace]
    if missing:
        return {"passed": False, "message": f"{missing[0]} is not defined between the markers: keep the name the "
                                            f"contract gives"}
    for n in names:
        label = watcher.label_of(namespace[n])
        if label is not None:
            return {"passed": False, "message": f"{n} {label}"}
    try:
        result = check(*(namespace[n] for n in names))
    except BaseException as exc:  # noqa: BLE001 - a check must answer, whatever the code did
        result = Result(False, f"the check stopped: {type(exc).__name__}: {_first_line(exc)}")
    seen = findings(log)
    refused = [text for kind, text in seen if kind == "refused"]
    forbidden = [text for kind, text in seen if kind == "forbidden"]
    if refused:
        return {"passed": False, "message": f"the code tried {refused[0]}, which the grader does not allow: "
                                            f"write the exercise, not around its check"}
    if forbidden:
        return {"passed": False, "message": f"it {forbidden[0]}"}
    if not watcher.still_installed():
        return {"passed": False, "message": "the code switched off the grader's call tracing: write the exercise, "
                                            "not around its check"}
    return {"passed": bool(result.passed), "message": str(result.message)}


def _first_line(exc: BaseException, limit: int = 150) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


if __name__ == "__main__":
    _child(sys.argv[1])
