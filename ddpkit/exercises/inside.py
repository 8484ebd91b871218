"""Inside the sandbox: the sandbox's own process, and each case's process (see :mod:`ddpkit.exercises.sandbox`).

:func:`main` fences the sandbox in, imports what every case needs (torch, the checks, what an optimizer
loads lazily), measures the machine's baseline, freezes what is alive (forks then skip it in their
collections), and forks one process per case. A case's process (:func:`_case`) starts the spawner of the
learner's processes before anything else, loads the learner's code once in one of them to see which names
it defines (:func:`_probe`), then runs each check with a :class:`~ddpkit.exercises.learner.LearnerRef`
per contract name and turns the result, and what the guards of the learner's processes saw, into the
check's row (:func:`_one_check`). The rows go back to the sandbox as JSON on a pipe of the case's own.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from ddpkit.exercises import Result, timing
from ddpkit.exercises.sandbox import HEAP_MB, RESULT_FD_ENV


def main(folder: str) -> None:
    result_fd = int(os.environ.pop(RESULT_FD_ENV))
    with open(os.path.join(folder, "request.json")) as handle:
        request = json.load(handle)
    sys.path[:0] = [*request["sys_path"]]
    from ddpkit.exercises import confine

    confine.not_dumpable()
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
    if any(catalog.exercise(case["exercise"]).trains for case in request["cases"]):
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
    for i, case in enumerate(request["cases"]):  # each case's rows as soon as it is done: a later kill keeps them
        started = time.monotonic()
        found = _run_case(os.path.join(folder, f"case-{i}"), case, result_fd)
        print(f"case {i} ({case['exercise']}): {time.monotonic() - started:.1f} s", flush=True)  # for the log
        view = memoryview(json.dumps({"case": i, "rows": found}).encode() + b"\n")
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
