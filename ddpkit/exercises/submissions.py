"""A room's notebooks: who wrote each, which exercise it is, and the code to grade in it.

A folder of submissions is either one folder per learner (``submissions/alice/09_ring_all_reduce.ipynb``)
or flat files named for the learner and the exercise (``alice_09_ring_all_reduce.ipynb``,
``09_ring_all_reduce-alice.ipynb``). The exercise is the one the notebook's metadata names (the student
notebooks carry it), else the one its file name contains. What is graded is the learner's code only
(:func:`ddpkit.exercises.sources.learner_code`).

Where a notebook's code comes from is reported beside its points (:func:`provenance`), and decides them
in one case only, the one that is certain:

* a notebook that holds the cells ``otter assign`` removes from every student notebook (the master's
  ``# ASSIGNMENT CONFIG`` cell, its hidden tests, the student introduction kept in its first cell's
  metadata) is the published solution notebook, not a student notebook: with its code unchanged it
  gets no points (``solution_notebook``); with code of its own it is graded and flagged for review;
* a student notebook whose code matches the published solution (comments, docstrings and the names it
  binds aside) keeps its points and is flagged for review (``review``): the natural answer to a short
  exercise is often the solution's, so a match is a question for the instructor, not proof.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ddpkit.exercises import catalog
from ddpkit.exercises.sources import learner_code, normalised


@dataclass(frozen=True)
class Submission:
    learner: str
    exercise: str | None  # None: not an exercise notebook the grader knows
    path: Path


def exercise_of(path: Path, nb=None) -> str | None:
    """The exercise a notebook is: its metadata's ``ddpkit.exercise``, else the longest id in its name."""
    meta = (nb.metadata.get("ddpkit", {}) if nb is not None else {}) or {}
    if isinstance(meta, dict) and meta.get("exercise") in catalog.BY_ID:
        return meta["exercise"]
    found = [ex for ex in catalog.BY_ID if ex in path.stem]
    return max(found, key=len) if found else None


def collect(paths: list[str]) -> list[Submission]:
    """Every notebook under ``paths`` (files or folders), with its learner and exercise."""
    import nbformat

    out = []
    for given in paths:
        root = Path(given)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        for path in files:
            try:
                nb = nbformat.read(path, as_version=4)
            except Exception:  # noqa: BLE001 - an unreadable file is reported as such
                nb = None
            exercise = exercise_of(path, nb)
            out.append(Submission(_learner(root, path, exercise), exercise, path))
    return out


def _learner(root: Path, path: Path, exercise: str | None) -> str:
    if root.is_dir() and path.parent != root:
        return path.relative_to(root).parts[0]
    stem = path.stem.replace(exercise, "") if exercise else re.sub(r"\d\d_[a-z0-9_]+", "", path.stem)
    name = re.sub(r"^[\W_]+|[\W_]+$", "", stem)
    return name or path.stem


_published: dict[str, str | None] = {}


def published_solution(exercise_id: str) -> str | None:
    """The structure of the published solution's code (see :func:`ddpkit.exercises.sources.normalised`)."""
    if exercise_id not in _published:
        import nbformat

        from ddpkit.exercises.autograde import master

        nb = nbformat.read(master(exercise_id), as_version=4)
        _published[exercise_id] = normalised(_solution_only(learner_code(nb, catalog.exercise(exercise_id).names)))
    return _published[exercise_id]


def _solution_only(code: str) -> str:
    """A master's marked code without otter's prompt strings and markers."""
    return re.sub(r"(\"\"\"|''') # BEGIN PROMPT.*?(\"\"\"|''') # END PROMPT", "", code, flags=re.S)


def matches_published_solution(exercise_id: str, code: str) -> bool:
    mine = normalised(_solution_only(code))
    return mine is not None and mine == published_solution(exercise_id)


def is_solution_notebook(nb) -> bool:
    """Does ``nb`` hold a cell that ``otter assign`` removes from every student notebook (the master's
    assignment configuration, a hidden test, the student introduction in the first cell's metadata)?"""
    for cell in nb.cells:
        first = cell.source.lstrip().split("\n", 1)[0].strip()
        if cell.cell_type == "raw" and first in ("# ASSIGNMENT CONFIG", "# BEGIN TESTS", "# BEGIN QUESTION"):
            return True
    first_meta = nb.cells[0].metadata.get("ddpkit", {}) if nb.cells else {}
    return isinstance(first_meta, dict) and "student_source" in first_meta


REVIEW, SOLUTION_NOTEBOOK = "review", "solution_notebook"
MARKS = {REVIEW: "*", SOLUTION_NOTEBOOK: "!"}  # beside the points in the room's table


def provenance(exercise_id: str, nb, code: str) -> tuple[str, str] | None:
    """``(flag, note)`` for a notebook whose code may not be the learner's own (see the module docstring),
    or None."""
    matches = matches_published_solution(exercise_id, code)
    if is_solution_notebook(nb):
        if matches:
            return SOLUTION_NOTEBOOK, ("the published solution notebook itself (it holds the master's cells that no "
                                       "student notebook has), its code unchanged: no points")
        return REVIEW, ("submitted in the published solution notebook (it holds the master's cells), with code of "
                        "its own: graded, to review")
    if matches:
        return REVIEW, ("the code matches the published solution (comments, docstrings and variable names aside): "
                        "points kept, to review")
    return None
