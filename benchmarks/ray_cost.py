"""What one ``ddpkit train --launcher ray`` costs: wall seconds, and CPU seconds of every process it starts.

Run by ``.ci/extras`` (not by ``python -m benchmarks``: Ray is an optional extra). It decides whether CI can
afford Ray's tests, so it measures the two numbers that decision needs:

* **wall seconds**, the launcher's and Ray's side by side (the same config): on a busy machine these grow
  with the load, so the line also gives the load average when the run started;
* **CPU seconds of the whole process tree**, which hardly depend on the load: on an idle 2-core machine a
  run takes at least half of them in wall time. Ray's head (GCS server, raylet, agents) and its workers are
  not all waited for by the command that started them (the raylet's workers are orphaned when it exits), so
  ``time`` undercounts them. This script makes itself a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``,
  see ``man 2 prctl``): every orphaned descendant is re-parented to it, and once it has reaped them all,
  ``getrusage(RUSAGE_CHILDREN)`` holds the CPU time of every process the run started.

    python benchmarks/ray_cost.py --runs 2
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import subprocess
import sys
import tempfile
import time

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
CONFIG = ("--world-size", "2", "--steps", "6", "--timeout", "20")  # tests/test_ray_launch.py's config


def become_subreaper() -> None:
    """Orphaned descendants come to this process (Linux >= 3.4), so their CPU time is counted here."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def reap_all(limit_s: float = 60.0) -> None:
    """Wait for every descendant (orphans included) to exit; they are Ray's, stopping after ray.shutdown()."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)
    raise RuntimeError(f"descendants still running {limit_s:.0f} s after the run")


def cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(extra: tuple[str, ...], summary: str) -> dict:
    """One ``ddpkit train`` run in a child process: wall seconds, CPU seconds of its whole tree, its digest."""
    load = os.getloadavg()[0]
    cpu0, t0 = cpu_children(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "train", *CONFIG, *extra, "--summary-json", summary],
                          capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    reap_all()
    if proc.returncode != 0:
        raise RuntimeError(f"ddpkit train {' '.join(extra)} failed:\n{proc.stderr[-3000:]}")
    import json

    with open(summary) as handle:
        digest = json.load(handle)["param_sha256"]
    return {"wall_s": wall, "cpu_s": cpu_children() - cpu0, "load": load, "param_sha256": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each launcher, alternating")
    args = parser.parse_args()
    become_subreaper()
    with tempfile.TemporaryDirectory(prefix="ddpkit-ray-cost-") as folder:
        for run in range(args.runs):
            for name, extra in (("ray", ("--launcher", "ray")), ("fork", ())):
                m = measure(extra, os.path.join(folder, f"{name}{run}.json"))
                print(f"{name:>4} launcher: {m['wall_s']:5.1f} s wall, {m['cpu_s']:5.1f} CPU s (whole process tree), "
                      f"load {m['load']:.1f} at start, param_sha256 {m['param_sha256'][:16]}", flush=True)


if __name__ == "__main__":
    main()
