"""Helpers for the notebooks: pick a runtime, give each cell a fresh folder, stream commands, record results.

``record(name, value)`` stores a JSON value in the cell's outputs under a ddpkit MIME type (front
ends show nothing for it; papermill keeps it), so ``tests/test_notebooks.py`` can read back what the
notebook measured and check it, instead of trusting that a cell "looked right".
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from ddpkit.runtime import gpu_count

RESULT_MIME = "application/vnd.ddpkit.result+json"


def in_colab() -> bool:
    return "google.colab" in sys.modules


def pick_runtime(requested_world_size: int = 2) -> dict:
    """CPU count, GPU count, and a world size + backend that can run here.

    NCCL needs one GPU per rank, and Colab gives at most one: so NCCL only when there are at least
    ``requested_world_size`` GPUs; otherwise that many gloo ranks on the CPU. Never calls
    ``torch.cuda.is_available()``, which would initialise CUDA in the notebook's kernel and rule out
    forking ranks from it.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    gpus = gpu_count()  # counted without initialising CUDA here, so ranks can still be forked
    backend = "nccl" if gpus >= requested_world_size else "gloo"
    return {"cpus": cpus, "gpus": gpus, "world_size": requested_world_size, "backend": backend,
            "torch": str(torch.__version__), "colab": in_colab()}


def record(name: str, value) -> None:
    """Store ``value`` (JSON-serialisable) in this cell's outputs under ``name``."""
    payload = {"name": name, "value": value}
    json.dumps(payload)  # fail here, not in the test, if it is not JSON
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display({RESULT_MIME: payload}, raw=True)  # no text/plain: front ends show nothing
    else:
        print(f"recorded {name}: {json.dumps(value)[:200]}")


def read_records(notebook: dict) -> dict:
    """All values a notebook recorded, by name (from an executed notebook's JSON)."""
    found = {}
    for cell in notebook.get("cells", []):
        for output in cell.get("outputs", []):
            payload = output.get("data", {}).get(RESULT_MIME)
            if payload:
                found[payload["name"]] = payload["value"]
    return found


def fresh_dir(path: str | os.PathLike) -> Path:
    """``path`` as an empty folder: whatever an earlier run of the cell left there is removed first, so a
    cell that trains or saves can be run again (or after Restart and Run All) and sees no stale files."""
    path = Path(path)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def requires(namespace: dict, *names: str, cell: str) -> None:
    """Raise a clear NameError when a cell runs before the one that defines ``names``.

    ``requires(globals(), "ck", "straight", cell="What a checkpoint holds")`` at the top of a cell says
    which earlier cell to run, instead of a bare ``NameError: name 'ck' is not defined``.
    """
    missing = [n for n in names if n not in namespace]
    if missing:
        raise NameError(f"run the cell under '{cell}' first: this one uses {', '.join(missing)} from it")


def run_command(argv: list[str], *, env: dict | None = None, timeout: float = 180.0,
                show=lambda line: True, heartbeat_s: float = 4.0) -> subprocess.CompletedProcess:
    """Run a command and print its output line by line while it runs, in the order it was written.

    stdout and stderr share one pipe (so their lines interleave exactly as written) and Python children
    are unbuffered. ``show(line)`` picks which lines to print; all of them are returned (as ``stdout``).
    After ``heartbeat_s`` seconds without a shown line, a short "still running" line says the cell is alive.
    Raises ``subprocess.TimeoutExpired`` after killing the command if it runs past ``timeout`` seconds; a
    timeout or an interrupted cell kills every process the command started (:func:`kill_tree`).
    """
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            bufsize=1, errors="replace")  # in the kernel's process group: a kernel shutdown reaches it
    try:
        return _follow(proc, argv, started, timeout, show, heartbeat_s)
    except BaseException:  # a timeout, or the cell interrupted: nothing the command started outlives it
        kill_tree(proc.pid)
        proc.wait()
        raise


def _follow(proc: subprocess.Popen, argv: list[str], started: float, timeout: float, show, heartbeat_s: float):
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline, seen, last_shown = started + timeout, [], started
    while True:
        now = time.monotonic()
        if now - last_shown >= heartbeat_s:  # nothing shown for a while (lines may arrive, filtered out)
            print(f"... still running ({now - started:.0f} s)", flush=True)
            last_shown = now
        try:
            line = lines.get(timeout=max(0.0, min(deadline - now, heartbeat_s - (now - last_shown))))
        except queue.Empty:
            if time.monotonic() < deadline:
                continue
            raise subprocess.TimeoutExpired(argv, timeout, output="".join(seen)) from None
        if line is None:
            break
        seen.append(line)
        if show(line):
            print(line, end="", flush=True)
            last_shown = time.monotonic()
    proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, "".join(seen), "")


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process descended from it, whatever session or process group it moved to.

    Killing the command, or its process group, is not enough: torchrun starts every worker in a session of
    its own (``start_new_session=True``, so that it can signal each worker's group), and a worker outlives
    a torchrun that is SIGKILLed. The tree is frozen first (SIGSTOP, walked again until nothing new
    appears), so that no process forks a child behind the walk, then killed. Linux reads the tree from
    ``/proc``; elsewhere only ``pid`` itself is killed.
    """
    frozen: set[int] = set()
    while fresh := {pid, *_descendants(pid)} - frozen:
        for p in fresh:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGSTOP)
        frozen |= fresh
    for p in frozen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), from ``/proc/*/stat``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*") if os.path.isdir("/proc") else []:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, ...
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def show_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Show ``rows`` (dicts with the same keys) as a table: HTML in a notebook, aligned text otherwise.
    Returns the text form."""
    columns = columns or list(rows[0])
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    text = "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in [columns, *cells])
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        from html import escape
        head = "".join(f"<th>{escape(c)}</th>" for c in columns)
        body = "".join("<tr>" + "".join(f"<td>{escape(v)}</td>" for v in line) + "</tr>" for line in cells)
        display({"text/html": f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>",
                 "text/plain": text}, raw=True)
    else:
        print(text)
    return text
