"""``ddpkit check PATH...``: execute exercise notebooks and print one line per exercise.

For an instructor at the end of a workshop: every learner's notebook is executed from top to bottom in a
fresh kernel (nbclient, the engine papermill and nbval use), and each check's result is printed on one
line, prefixed with the notebook's name. A notebook that fails before its check gets the error's first
line instead. The exit code is 0 when every check passed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

RESULT_PREFIXES = ("PASSED: ", "NOT YET: ")


def check_notebook(path: str | os.PathLike, timeout: float = 300.0) -> list[str]:
    """The check lines of one executed notebook (or one line naming the error that stopped it)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
        stopped = None
    except (CellExecutionError, CellTimeoutError) as exc:
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        stopped = f"ERROR: a cell failed: {lines[-1][:200] if lines else type(exc).__name__}"
    found = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            text = "".join(output.get("data", {}).get("text/plain", "")) or "".join(output.get("text", ""))
            found += [line for line in text.splitlines() if line.startswith(RESULT_PREFIXES)]
    if stopped:
        found.append(stopped)
    return found or ["ERROR: no check ran (is the check cell still in the notebook?)"]


def main(paths: list[str], timeout: float = 300.0) -> int:
    """Print ``PATH  RESULT`` for every check of every notebook; 0 when all passed (2: cannot run notebooks here)."""
    try:
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError:
        print("ddpkit: error: ddpkit check executes notebooks and needs nbclient and nbformat: "
              "pip install 'ddpkit[notebook]'", file=sys.stderr)
        return 2
    all_passed = True
    width = max((len(p) for p in paths), default=0)
    for path in paths:
        if not Path(path).is_file():
            print(f"{path:<{width}}  ERROR: no such notebook", flush=True)
            all_passed = False
            continue
        for line in check_notebook(path, timeout):
            all_passed &= line.startswith("PASSED: ")
            print(f"{path:<{width}}  {line}", flush=True)
    return 0 if all_passed else 1
