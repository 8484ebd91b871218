"""The bridge between otter-grader and the sandbox: hidden tests call :func:`verdict`; ``ddpkit check`` runs
the autograder's test files with otter's own runner and reports its results.

Each exercise's master notebook (``exercises/solutions/NN_name.ipynb``) is an otter-assign master: the
solution, the stub (otter's prompt) and one hidden test per check, with its points. ``otter assign``
makes the student notebook and the autograder from it (:func:`build`). A hidden test is one line,
``verdict(env, "09_ring_all_reduce", "ring_all_reduce")``: it takes the learner's code, never the
objects a notebook defined, runs every check of the exercise once in a sandbox, and fails with the
check's sentence. Under ``ddpkit check`` (:func:`grade`) the code comes from the grader itself (kept per
thread, out of the tests' environment), so no cell of the learner ever runs in the grading process.
Under a plain ``otter run`` the notebook in the working folder is read for it: otter executes every
cell of the submission first, in the kernel that then runs the hidden tests, so a variable or a
function a cell defines is never what gets graded, only the marked code of the file. That kernel is
still the learner's: a notebook that rewrites the grader's own modules there can change what otter
records, which is why ``ddpkit check`` (that never runs a cell) is the grader to trust.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

from ddpkit.exercises import catalog

EXERCISES_DIR = Path(__file__).resolve().parents[2] / "exercises"
_results: dict[tuple[str, str], dict[str, dict]] = {}
_lock = threading.Lock()
TIME_SCALE = {"value": 1.0}
MEMORY_MB = {"value": None}  # the sandbox's resident-memory limit (None: its default); ddpkit check --memory-gb
_graded = threading.local()  # the code grade() is grading, on this thread: never read from the tests' env


def verdict(env: dict, exercise_id: str, check: str) -> None:
    """Raise ``AssertionError(sentence)`` unless the learner's code passes ``check`` (run in a sandbox)."""
    result = results_for(exercise_id, submission_code(env, exercise_id))[check]
    if not result["passed"]:
        raise AssertionError(result["message"])


def submission_code(env: dict, exercise_id: str) -> str:
    """The code to grade: what :func:`grade` was given on this thread, else the marked code of the notebook
    in the working folder (``otter run``). Never a name from ``env``, which a submission's cells define."""
    code = getattr(_graded, "code", None)
    if code is not None:
        return code
    import nbformat

    from ddpkit.exercises.sources import learner_code

    notebooks = sorted(glob.glob("*.ipynb"))  # otter run: the submission sits in the working folder
    if not notebooks:
        raise AssertionError("no notebook to grade in the working folder")
    return learner_code(nbformat.read(notebooks[0], as_version=4), catalog.exercise(exercise_id).names)


def results_for(exercise_id: str, code: str) -> dict[str, dict]:
    """Every check's result for this code, run once per (exercise, code) in one sandbox."""
    from ddpkit.exercises import sandbox

    key = (exercise_id, hashlib.sha256(code.encode()).hexdigest())
    with _lock:
        cached = _results.get(key)
    if cached is None:
        cached = {r["check"]: r for r in sandbox.run(exercise_id, code, time_scale=TIME_SCALE["value"],
                                                     memory_mb=MEMORY_MB["value"] or sandbox.MEMORY_MB)}
        with _lock:
            _results[key] = cached
    return cached


# ------------------------------------------------------------------------------- otter assign and run


def master(exercise_id: str) -> Path:
    return EXERCISES_DIR / "solutions" / f"{exercise_id}.ipynb"


def build(exercise_id: str, cache: str | os.PathLike | None = None) -> Path:
    """``otter assign`` the exercise's master into a cached folder (keyed by the master's bytes); return it.
    It holds ``student/<id>.ipynb`` and ``autograder/`` (tests, otter_config.json and the zip)."""
    source = master(exercise_id)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    root = Path(cache or os.environ.get("DDPKIT_CACHE") or Path.home() / ".cache" / "ddpkit") / "autograders"
    out = root / f"{exercise_id}-{digest}"
    if (out / "autograder" / "otter_config.json").exists():
        return out
    tmp = root / f".{exercise_id}-{digest}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _otter_assign(source, tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # built meanwhile by another job
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _otter_assign(source: Path, out: Path) -> None:
    import contextlib
    import io

    from otter.assign import main as assign

    work = out / "master"
    work.mkdir()
    shutil.copy(source, work / source.name)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assign(str(work / source.name), str(out), no_pdfs=True, no_run_tests=True)
    shutil.rmtree(work)


def test_files(built: Path) -> list:
    from otter.test_files import ExceptionTestFile

    return [ExceptionTestFile.from_file(p) for p in sorted((built / "autograder" / "tests").glob("*.py"))]


def grade(exercise_id: str, code: str, built: Path) -> dict:
    """Run the autograder's tests (otter's runner) on ``code``; otter's results and ours, as plain data."""
    from otter.run import AutograderConfig
    from otter.test_files import GradingResults

    files = test_files(built)
    _graded.code = code
    try:
        for test_file in files:
            test_file.run({})
    finally:
        _graded.code = None
    results = GradingResults(files)
    config = json.loads((built / "autograder" / "otter_config.json").read_text())
    ours = results_for(exercise_id, code)
    checks = []
    for test_file in files:
        for case, outcome in zip(test_file.test_cases, test_file.test_case_results):
            name = case.name.split(" - ")[0] if case.name else test_file.name
            mine = ours.get(_check_name(case), {})
            checks.append({"question": test_file.name, "check": _check_name(case) or name, "passed": outcome.passed,
                           "points": case.points if outcome.passed else 0, "max_points": case.points,
                           "message": mine.get("message", "")})
    return {"score": results.total, "possible": results.possible, "checks": checks,
            "otter": results.to_gradescope_dict(AutograderConfig(config))}


def _check_name(case) -> str | None:
    """The check a hidden test grades: its function is named ``test_<check>``."""
    name = getattr(getattr(case.body, "test_func", None), "__name__", "")
    return name[len("test_"):] if name.startswith("test_") else None
