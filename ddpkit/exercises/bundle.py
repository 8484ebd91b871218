"""What learners get, made from the masters: the student notebooks, a bundle without solutions, a reset.

* :func:`build_students` runs ``otter assign`` on every master (``exercises/solutions/*.ipynb``) and
  writes the student notebook ``exercises/<id>.ipynb``: the stub where the solution was, no hidden test,
  the master's student introduction (kept in the first cell's metadata) in place of the solution's.
  ``check=True`` only compares: the committed student notebooks must be what the masters make.
* :func:`export` (``ddpkit exercises export DIR``): the student notebooks and the hints, no solution.
* :func:`reset` (``ddpkit exercises reset NOTEBOOK``): put one exercise's stub cells back in a learner's
  notebook, keeping every other cell.
"""

from __future__ import annotations

from pathlib import Path

from ddpkit.exercises import autograde, catalog

_DROP_METADATA = ("otter", "deletable", "editable", "tags")


def student_notebook(exercise_id: str, cache: str | None = None):
    """The student notebook ``otter assign`` makes from the master, tidied (see the module docstring)."""
    import nbformat

    built = autograde.build(exercise_id, cache)
    nb = nbformat.read(built / "student" / f"{exercise_id}.ipynb", as_version=4)
    master = nbformat.read(autograde.master(exercise_id), as_version=4)
    intro = master.cells[0].metadata.get("ddpkit", {}).get("student_source")
    if intro:
        nb.cells[0].source = intro
    for cell in nb.cells:
        for key in _DROP_METADATA:
            cell.metadata.pop(key, None)
        cell.metadata.pop("ddpkit", None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cell.pop("id", None)
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}, "ddpkit": {"exercise": exercise_id},
                   "otter": {"assignment_name": exercise_id}}  # otter run refuses a notebook without it
    nb.nbformat, nb.nbformat_minor = 4, 4
    return nb


def build_students(target: str | Path | None = None, check: bool = False, cache: str | None = None) -> list[str]:
    """Write (or, with ``check``, compare) every student notebook; return the names that differ."""
    import nbformat

    target = Path(target or autograde.EXERCISES_DIR)
    differ = []
    for ex in catalog.EXERCISES:
        nb = student_notebook(ex.id, cache)
        path = target / f"{ex.id}.ipynb"
        text = nbformat.writes(nb)
        if check:
            if not path.exists() or _cells(nbformat.read(path, as_version=4)) != _cells(nb):
                differ.append(path.name)
        else:
            path.write_text(text)
    return differ


def _cells(nb) -> list:
    return [nb.metadata.get("otter"), *((c.cell_type, c.source) for c in nb.cells)]


def export(folder: str | Path, cache: str | None = None) -> Path:
    """A student bundle in ``folder``: every student notebook and README, no solution."""
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} is not empty: choose a new folder for the bundle")
    folder.mkdir(parents=True, exist_ok=True)
    build_students(folder, cache=cache)
    return folder


def reset(notebook: str | Path, exercise_id: str | None = None, cache: str | None = None) -> int:
    """Replace the marked cells of ``notebook`` with the stub's; return how many cells were reset."""
    import nbformat

    from ddpkit.exercises.submissions import exercise_of

    path = Path(notebook)
    nb = nbformat.read(path, as_version=4)
    exercise_id = exercise_id or exercise_of(path, nb)
    if exercise_id is None:
        raise ValueError(f"cannot tell which exercise {path.name} is: name it (e.g. 09_ring_all_reduce)")
    stubs = [c.source for c in student_notebook(exercise_id, cache).cells if c.cell_type == "code" and "### begin" in c.source]
    marked = [c for c in nb.cells if c.cell_type == "code" and "### begin" in c.source]
    if len(marked) != len(stubs):
        raise ValueError(f"{path.name} has {len(marked)} cells with ### begin, the exercise has {len(stubs)}: "
                         f"copy a fresh one from the bundle instead")
    for cell, stub in zip(marked, stubs):
        cell.source, cell.outputs, cell.execution_count = stub, [], None
    nbformat.write(nb, path)
    return len(stubs)
