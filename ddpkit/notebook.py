"""Helpers for the notebooks: pick a runtime that can work here, and record results for the tests.

``record(name, value)`` stores a JSON value in the cell's outputs under a ddpkit MIME type (front
ends show nothing for it; papermill keeps it), so ``tests/test_notebooks.py`` can read back what the
notebook measured and check it, instead of trusting that a cell "looked right".
"""

from __future__ import annotations

import json
import os
import sys

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
        display({RESULT_MIME: payload, "text/plain": f"recorded {name}"}, raw=True)
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
