"""Every notebook, run again and again while other processes keep every core busy.

``python benchmarks/notebook_soak.py [--runs N] [--notebooks 05 07] [--hogs K]`` runs each notebook ``N``
times in a fresh kernel (headless: progress as text lines) with ``K`` busy-looping processes beside it
(default: one per core; ``--hogs 0`` when other work already keeps every core busy), and records the
machine's load average over the soak. For each run it records:

* whether it passed: executed without an error **and** what it recorded passes the same checks as
  ``tests/test_notebooks.py``;
* its wall time;
* the **longest silence**: the longest stretch inside one code cell without new output (from the cell's
  start to its first output, between outputs, and from the last output to the cell's end). A learner
  staring at a cell that says nothing for 20 s assumes it hung.

Results go to ``benchmarks/results/notebook_soak.json``. Timing lessons must hold here: a notebook
whose slowdowns were sized from a constant instead of a measured baseline fails under this load.
"""

import argparse
import json
import multiprocessing as mp
import os
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import write_results  # noqa: E402
from test_notebooks import CHECKS, lesson  # noqa: E402

from ddpkit.notebook import read_records  # noqa: E402


class TimedClient(NotebookClient):
    """Executes a notebook and notes when each code cell started, wrote output, and ended."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.marks: dict[int, list[float]] = {}
        self.on_cell_execute = lambda cell, cell_index: self.marks.setdefault(cell_index, []).append(time.monotonic())
        self.on_cell_executed = lambda cell, cell_index, execute_reply: self.marks[cell_index].append(time.monotonic())

    def output(self, outs, msg, display_id, cell_index):
        self.marks.setdefault(cell_index, []).append(time.monotonic())
        return super().output(outs, msg, display_id, cell_index)

    def longest_silence(self) -> tuple[float, int]:
        """(seconds, cell index) of the longest stretch without output inside one cell."""
        gaps = [(max((b - a for a, b in zip(m, m[1:])), default=0.0), i) for i, m in self.marks.items()]
        return max(gaps, default=(0.0, -1))


def hog(stop) -> None:
    """Keep one core busy until told to stop."""
    x = 0
    while not stop.is_set():
        x = (x * 1103515245 + 12345) % 2**31


def run_once(path: Path) -> dict:
    nb = nbformat.read(path, as_version=4)
    client = TimedClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    started = time.monotonic()
    error = None
    try:
        client.execute()
        CHECKS[lesson(path)](read_records(json.loads(nbformat.writes(nb))))
    except Exception as exc:  # noqa: BLE001 - a failed run is a result
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # no terminal colours
        error = f"{type(exc).__name__}: {text[-1500:]}"
    silence, cell = client.longest_silence()
    return {"ok": error is None, "error": error, "wall_s": round(time.monotonic() - started, 1),
            "longest_silence_s": round(silence, 1), "silent_cell": cell, "load_1min": round(os.getloadavg()[0], 1)}


def main(runs: int = 10, notebooks: list[str] | None = None, busy: int | None = None) -> dict:
    os.environ["DDPKIT_PROGRESS"] = "text"
    paths = [p for p in sorted((REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb")) if not notebooks or lesson(p) in notebooks]
    stop = mp.Event()
    hogs = [mp.Process(target=hog, args=(stop,), daemon=True) for _ in range((os.cpu_count() or 1) if busy is None else busy)]
    for h in hogs:
        h.start()
    results = {}
    try:
        for path in paths:
            results[path.stem] = [run_once(path) for _ in range(runs)]
            done = results[path.stem]
            print(f"{path.stem}: {sum(r['ok'] for r in done)}/{runs} passed, wall {min(r['wall_s'] for r in done)}-"
                  f"{max(r['wall_s'] for r in done)} s, longest silence {max(r['longest_silence_s'] for r in done)} s",
                  flush=True)
            for r in done:
                if not r["ok"]:
                    print("    " + r["error"].replace("\n", "\n    "), flush=True)
    finally:
        stop.set()
        for h in hogs:
            h.join()
    summary = {name: {"passed": sum(r["ok"] for r in rs), "runs": len(rs),
                      "min_wall_s": min(r["wall_s"] for r in rs), "max_wall_s": max(r["wall_s"] for r in rs),
                      "longest_silence_s": max(r["longest_silence_s"] for r in rs),
                      "load": f"{len(hogs)} busy processes, load average {min(r['load_1min'] for r in rs)}-{max(r['load_1min'] for r in rs)}"}
               for name, rs in results.items()}
    previous = REPO / "benchmarks" / "results" / "notebook_soak.json"
    if notebooks and previous.exists():  # a run of some notebooks keeps the others' last results
        old = json.loads(previous.read_text())
        summary = {**old.get("summary", {}), **summary}
        results = {**old.get("runs", {}), **results}
    return write_results("notebook_soak", {"load": f"{len(hogs)} busy processes", "summary": dict(sorted(summary.items())),
                                           "runs": dict(sorted(results.items()))})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--notebooks", nargs="*", help="lesson prefixes, e.g. 05 07 10b (default: all)")
    parser.add_argument("--hogs", type=int, default=None, help="busy processes beside the notebook (default: one per core)")
    args = parser.parse_args()
    main(args.runs, args.notebooks, args.hogs)
