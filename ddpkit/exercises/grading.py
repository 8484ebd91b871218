"""``ddpkit check PATH...``: grade a room's notebooks into a learner x exercise table.

For each notebook, only the learner's code is taken (the cells between ``### begin`` and ``### end``, or
the cells defining the contract's names); nothing the notebook printed, and no cell outside them,
counts. The code is graded by the exercise's otter autograder (built from its master with ``otter
assign``), whose hidden tests run every check in a fresh sandbox process on real ranks, bounded in
time (from this machine's measured speed) and memory (:mod:`ddpkit.exercises.sandbox`). ``--jobs N``
grades N notebooks at once.

It prints the table (points per exercise, a total per learner), writes it as ``grades.csv`` and
``grades.md`` in ``--out``, and one ``results.json`` per learner (otter's results for each exercise,
with each check's sentence). Correct code earns its points; where a notebook's code may not be the
learner's own, the cell is marked and a note says why (:func:`ddpkit.exercises.submissions.provenance`):
``*`` to review (the code matches the published solution, points kept), ``!`` for the published solution
notebook itself, unchanged (no points). The exit code is 0 when every notebook got every point.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ddpkit.exercises import autograde, catalog
from ddpkit.exercises.submissions import MARKS, SOLUTION_NOTEBOOK, Submission, collect, provenance


def grade_one(sub: Submission, cache: str | None = None) -> dict:
    """One notebook's grade: score, possible, each check's outcome and sentence, and, when its code may not be
    the learner's own, a ``flag`` and a ``note`` (see :func:`ddpkit.exercises.submissions.provenance`)."""
    import nbformat

    from ddpkit.exercises.sources import learner_code

    if sub.exercise is None:
        return {"score": 0, "possible": 0, "note": "not an exercise notebook (no exercise id in its name or metadata)",
                "checks": []}
    ex = catalog.exercise(sub.exercise)
    try:
        nb = nbformat.read(sub.path, as_version=4)
    except Exception as exc:  # noqa: BLE001
        return {"score": 0, "possible": None, "note": f"unreadable notebook ({type(exc).__name__})", "checks": []}
    code = learner_code(nb, ex.names)
    built = autograde.build(sub.exercise, cache)
    graded = autograde.grade(sub.exercise, code, built)
    found = provenance(sub.exercise, nb, code)
    if found:
        graded["flag"], graded["note"] = found
        if graded["flag"] == SOLUTION_NOTEBOOK:  # certain: the kit's own file, not a student notebook
            graded["score"] = 0
            for check in graded["checks"]:
                check["points"] = 0
    return graded


def grade_all(paths: list[str], jobs: int = 1, cache: str | None = None) -> list[tuple[Submission, dict]]:
    subs = collect(paths)
    for ex_id in sorted({s.exercise for s in subs if s.exercise}):
        autograde.build(ex_id, cache)  # once, before the jobs start
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        grades = list(pool.map(lambda s: grade_one(s, cache), subs))
    return list(zip(subs, grades))


def table(graded: list[tuple[Submission, dict]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per learner, one column per exercise (``points/possible``), then the total."""
    exercises = [e.id for e in catalog.EXERCISES if any(s.exercise == e.id for s, _ in graded)]
    learners = sorted({s.learner for s, _ in graded})
    cells: dict[tuple[str, str], str] = {}
    totals = {learner: [0.0, 0.0] for learner in learners}
    for sub, grade in graded:
        if sub.exercise is None:
            continue
        mark = MARKS.get(grade.get("flag"), "*" if grade.get("note") else "")
        cells[(sub.learner, sub.exercise)] = f"{_num(grade['score'])}/{_num(grade['possible'])}{mark}"
        totals[sub.learner][0] += grade["score"] or 0
        totals[sub.learner][1] += grade["possible"] or 0
    header = ["learner", *exercises, "total"]
    rows = [[learner, *(cells.get((learner, e), "-") for e in exercises),
             f"{_num(totals[learner][0])}/{_num(totals[learner][1])}"] for learner in learners]
    return header, rows


def _num(x) -> str:
    if x is None:
        return "?"
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def as_markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def as_text(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows])


def write_reports(graded: list[tuple[Submission, dict]], out: Path) -> tuple[list[str], list[list[str]]]:
    header, rows = table(graded)
    out.mkdir(parents=True, exist_ok=True)
    notes_of: dict[str, list[str]] = {}
    for sub, grade in graded:
        if grade.get("note"):
            notes_of.setdefault(sub.learner, []).append(f"{sub.exercise}{MARKS.get(grade.get('flag'), '')}: {grade['note']}")
    buffer = io.StringIO()  # the CSV carries the notes too, one column, for a spreadsheet's review
    csv.writer(buffer).writerows([header + ["notes"], *(row + ["; ".join(notes_of.get(row[0], []))] for row in rows)])
    (out / "grades.csv").write_text(buffer.getvalue())
    notes = [f"- {s.learner}, {s.exercise}: {g['note']}" for s, g in graded if g.get("note")]
    legend = "\n`*` to review: the points stand; `!` the published solution notebook, unchanged: no points.\n\n"
    (out / "grades.md").write_text(as_markdown(header, rows) + (legend + "\n".join(notes) + "\n" if notes else ""))
    per_learner: dict[str, dict] = {}
    for sub, grade in graded:
        entry = per_learner.setdefault(sub.learner, {"learner": sub.learner, "exercises": {}})
        entry["exercises"][sub.exercise or sub.path.name] = {"file": str(sub.path), **grade}
    for learner, entry in per_learner.items():
        folder = out / _safe(learner)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(json.dumps(entry, indent=1, default=str))
    return header, rows


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "learner"


def main(paths: list[str], jobs: int = 1, out: str = "grades", time_scale: float = 1.0, memory_gb: float = 6.0) -> int:
    """Grade, print the table and each failed check's sentence, write the reports; 0 when all passed."""
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        print(f"ddpkit: error: no such file or folder: {missing[0]}", file=sys.stderr)
        return 2
    try:
        import otter  # noqa: F401
    except ImportError:
        print("ddpkit: error: ddpkit check grades with otter-grader: pip install 'ddpkit[grader]'", file=sys.stderr)
        return 2
    if not (autograde.EXERCISES_DIR / "solutions").is_dir():
        print("ddpkit: error: ddpkit check works from a clone of the repository (its autograders are built from "
              "exercises/solutions/): git clone https://github.com/ddpkit/ddpkit and run it there", file=sys.stderr)
        return 2
    autograde.TIME_SCALE["value"] = time_scale
    autograde.MEMORY_MB["value"] = int(memory_gb * 1024)
    graded = grade_all(paths, jobs)
    if not graded:
        print(f"ddpkit: error: no notebook (.ipynb) under {', '.join(paths)}", file=sys.stderr)
        return 2
    header, rows = write_reports(graded, Path(out))
    print(as_text(header, rows))
    for sub, grade in graded:
        for check in grade["checks"]:
            if not check["passed"]:
                print(f"{sub.path}  {check['check']}: {check['message']}")
        if grade.get("note"):
            print(f"{sub.path}  {grade['note']}")
    print(f"written: {os.path.join(out, 'grades.csv')}, {os.path.join(out, 'grades.md')} and one results.json per learner")
    full = all(g["possible"] and g["score"] == g["possible"] for _, g in graded)  # a note asks for review only
    return 0 if full else 1
