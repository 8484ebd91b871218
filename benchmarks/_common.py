"""Shared by the benchmarks: where results go, and a robust summary of repeated timings."""

import json
import os
import platform
import statistics
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def summarize(samples: list[float]) -> dict:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "n": len(samples)}


def write_results(name: str, payload: dict) -> dict:
    """Write ``results/<name>.json`` (with the machine it ran on) and print it; return the payload."""
    os.makedirs(RESULTS, exist_ok=True)
    payload = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": str(torch.__version__),
               "python": platform.python_version(), "cpus": os.cpu_count(), **payload}
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as handle:
        json.dump(payload, handle, indent=1)
    print(json.dumps(payload, indent=1))
    return payload
