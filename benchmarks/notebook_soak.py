"""Every notebook, run again and again while other processes keep every core busy.

``python benchmarks/notebook_soak.py [--runs N] [--notebooks 05 07] [--hogs K] [--rerun]`` runs each notebook ``N``
times in a fresh kernel (headless: progress as text lines) with ``K`` busy-looping processes beside it
(default: one per core; ``--hogs 0`` when other work already keeps every core busy), and records the
machine's load average over the soak. For each run it records:

* whether it passed: executed without an error **and** what it recorded passes the same checks as
  ``tests/test_notebooks.py``;
* its wall time;
* the **longest silence**: the longest stretch inside one code cell without new output (from the cell's
  start to its first output, between outputs, and from the last output to the cell's end). A learner
  staring at a cell that says nothing for 20 s assumes it hung.

``--rerun`` proves instead that re-running works, in one kernel: Run All, then every code cell again
in order, each of them twice in a row (the first of the two runs a cell after a whole Run All and the
cells before it again; the second runs it right after itself). A run passes if no execution raised and
the records the cells left (each cell's last run) pass the tests' checks; its longest silence is over
every execution. These results go under ``rerun`` in the same file.

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
    """Executes a notebook and notes when each execution of a code cell started, wrote output, and ended
    (a cell run twice has two executions: the time between them, when other cells ran, is no silence)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.executions: list[tuple[int, list[float]]] = []  # (cell index, its marks), one per execution
        self.on_cell_execute = lambda cell, cell_index: self.executions.append((cell_index, [time.monotonic()]))
        self.on_cell_executed = lambda cell, cell_index, execute_reply: self.executions[-1][1].append(time.monotonic())

    def output(self, outs, msg, display_id, cell_index):
        if self.executions:
            self.executions[-1][1].append(time.monotonic())
        return super().output(outs, msg, display_id, cell_index)

    def longest_silence(self) -> tuple[float, int]:
        """(seconds, cell index) of the longest stretch without output inside one execution of a cell."""
        gaps = [(max((b - a for a, b in zip(m, m[1:])), default=0.0), i) for i, m in self.executions]
        return max(gaps, default=(0.0, -1))

    def execute_rerun(self) -> None:
        """Run All, then every code cell again, each twice in a row, in the same kernel (``--rerun``)."""
        self.reset_execution_trackers()
        with self.setup_kernel():
            self.wait_for_reply(self.kc.kernel_info())
            order = list(enumerate(self.nb.cells)) + [pair for pair in enumerate(self.nb.cells) for _ in range(2)]
            for index, cell in order:
                self.execute_cell(cell, index, execution_count=self.code_cells_executed + 1)


def hog(stop) -> None:
    """Keep one core busy until told to stop."""
    x = 0
    while not stop.is_set():
        x = (x * 1103515245 + 12345) % 2**31


def run_once(path: Path, rerun: bool = False) -> dict:
    nb = nbformat.read(path, as_version=4)
    client = TimedClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    started = time.monotonic()
    error = None
    try:
        client.execute_rerun() if rerun else client.execute()
        CHECKS[lesson(path)](read_records(json.loads(nbformat.writes(nb))))
    except Exception as exc:  # noqa: BLE001 - a failed run is a result
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # no terminal colours
        where = f" (execution {len(client.executions)}, cell {client.executions[-1][0]})" if rerun and client.executions else ""
        error = f"{type(exc).__name__}{where}: {text[-1500:]}"
    silence, cell = client.longest_silence()
    return {"ok": error is None, "error": error, "wall_s": round(time.monotonic() - started, 1),
            "longest_silence_s": round(silence, 1), "silent_cell": cell, "load_1min": round(os.getloadavg()[0], 1),
            **({"executions": len(client.executions)} if rerun else {})}


def main(runs: int = 10, notebooks: list[str] | None = None, busy: int | None = None, rerun: bool = False) -> dict:
    os.environ["DDPKIT_PROGRESS"] = "text"
    paths = [p for p in sorted((REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb")) if not notebooks or lesson(p) in notebooks]
    stop = mp.Event()
    hogs = [mp.Process(target=hog, args=(stop,), daemon=True) for _ in range((os.cpu_count() or 1) if busy is None else busy)]
    for h in hogs:
        h.start()
    results = {}
    try:
        for path in paths:
            results[path.stem] = [run_once(path, rerun) for _ in range(runs)]
            done = results[path.stem]
            print(f"{path.stem}{' (re-run in one kernel)' if rerun else ''}: {sum(r['ok'] for r in done)}/{runs} passed, "
                  f"wall {min(r['wall_s'] for r in done)}-{max(r['wall_s'] for r in done)} s, "
                  f"longest silence {max(r['longest_silence_s'] for r in done)} s", flush=True)
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
    old = json.loads(previous.read_text()) if previous.exists() else {}
    fresh = {"summary": summary, "runs": results}
    if rerun:  # the re-run mode's results sit beside the soak's, which are kept as they were
        kept = {k: v for k, v in old.items() if k not in ("benchmark", "when", "torch", "python", "cpus")}
        part = old.get("rerun", {})
        if notebooks:
            fresh = {key: {**part.get(key, {}), **fresh[key]} for key in fresh}
        payload = {**kept, "rerun": {"mode": "Run All, then every code cell again, each twice in a row, in one kernel",
                                     "load": f"{len(hogs)} busy processes",
                                     **{key: dict(sorted(value.items())) for key, value in fresh.items()}}}
        return write_results("notebook_soak", payload)
    if notebooks and old:  # a run of some notebooks keeps the others' last results
        fresh = {key: {**old.get(key, {}), **fresh[key]} for key in fresh}
    return write_results("notebook_soak", {"load": f"{len(hogs)} busy processes", **{k: dict(sorted(v.items())) for k, v in fresh.items()},
                                           **({"rerun": old["rerun"]} if "rerun" in old else {})})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--notebooks", nargs="*", help="lesson prefixes, e.g. 05 07 10b (default: all)")
    parser.add_argument("--hogs", type=int, default=None, help="busy processes beside the notebook (default: one per core)")
    parser.add_argument("--rerun", action="store_true", help="re-run in one kernel: Run All, then each code cell twice")
    args = parser.parse_args()
    main(args.runs, args.notebooks, args.hogs, args.rerun)
