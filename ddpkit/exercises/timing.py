"""How long a check may take on this machine, now, and whether a rank that stopped answering hung.

A fixed limit is unfair: on a busy runtime (Colab's two shared vCPUs, a room grading in parallel) a
correct answer is slow, not hung. So every sandbox first measures a **baseline**: the seconds this
machine takes right now to start two gloo ranks and run a few small all-reduces (``probe``). Limits are
multiples of it, never below a floor:

* the collective timeout inside the ranks (:func:`collective_timeout`), after which a rank that waits
  for a peer gives up;
* the wall-clock limit of a whole check, set by the parent from the same baseline.

When a rank is given up on, *what it was doing* decides the sentence: every rank writes its CPU time
every ``BEAT_S`` seconds (:func:`start_heartbeat`); a rank that used the CPU during the last seconds was
computing (**too slow on this machine**, or a loop that never ends), a rank that did not was waiting for
something that never came (**hung**).
"""

from __future__ import annotations

import json
import os
import threading
import time

FLOOR_S = 5.0  # never less than this, on any machine
CEILING_S = 300.0  # never more than this: a limit must still be a limit
COLLECTIVE_FACTOR = 25.0  # a peer may be this many baselines late before it is given up on
BEAT_S = 0.2
# CPU seconds per wall second above which a rank counts as computing: a sleeping one uses about 0.001,
# a computing one on a loaded machine may get only a tenth of a core
BUSY_FRACTION = 0.03

_baseline = {"seconds": None}


def _probe_ranks(ctx) -> None:
    import torch
    import torch.distributed as dist

    t = torch.ones(256)
    for _ in range(10):
        dist.all_reduce(t)


def probe() -> float:
    """Seconds to start two gloo ranks and run ten small all-reduces, on this machine now."""
    from ddpkit.launch import launch

    started = time.perf_counter()
    launch(_probe_ranks, world_size=2, backend="gloo", timeout=CEILING_S, output="none", progress="off")
    seconds = time.perf_counter() - started
    _baseline["seconds"] = seconds
    return seconds


def baseline() -> float | None:
    return _baseline["seconds"]


def set_baseline(seconds: float | None) -> None:
    _baseline["seconds"] = seconds


def collective_timeout(scale: float = 1.0) -> float:
    """The collective timeout a check gives its ranks: the baseline times a factor, within bounds."""
    seconds = _baseline["seconds"]
    if seconds is None:
        return FLOOR_S * scale
    return min(CEILING_S, max(FLOOR_S, COLLECTIVE_FACTOR * seconds)) * scale


def start_heartbeat(folder: str, rank: int) -> None:
    """Write (wall time, CPU time of this process) every BEAT_S seconds to ``folder/beat-<rank>.json``."""
    path = os.path.join(folder, f"beat-{rank}.json")
    samples: list[tuple[float, float]] = []

    def beat() -> None:
        while True:
            samples.append((time.monotonic(), time.process_time()))
            del samples[:-50]
            tmp = f"{path}.tmp"
            with open(tmp, "w") as handle:
                json.dump(samples, handle)
            os.replace(tmp, path)
            time.sleep(BEAT_S)

    threading.Thread(target=beat, name="ddpkit-heartbeat", daemon=True).start()


def was_busy(folder: str, rank: int, window_s: float = 2.0) -> bool | None:
    """Did rank ``rank`` use the CPU during its last ``window_s`` seconds? None if it never beat."""
    try:
        with open(os.path.join(folder, f"beat-{rank}.json")) as handle:
            samples = json.load(handle)
    except (OSError, ValueError):
        return None
    if len(samples) < 2:
        return None
    end_wall, end_cpu = samples[-1]
    start = next(((w, c) for w, c in samples if end_wall - w <= window_s), samples[0])
    wall = end_wall - start[0]
    return wall > 0 and (end_cpu - start[1]) / wall > BUSY_FRACTION


def group_busy(pgid: int, window_s: float = 0.5) -> bool:
    """Did the processes of group ``pgid`` use the CPU during the next ``window_s`` seconds (Linux)?"""
    first = _group_cpu(pgid)
    time.sleep(window_s)
    return (_group_cpu(pgid) - first) / window_s > BUSY_FRACTION


def _group_cpu(pgid: int) -> float:
    ticks = 0
    for pid in _group_pids(pgid):
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, ValueError, IndexError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            if int(fields[2]) == pgid:  # pgrp
                pids.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def group_rss_bytes(pgid: int) -> int:
    """Resident memory of every process in group ``pgid`` (Linux; 0 elsewhere)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in _group_pids(pgid):
        try:
            with open(f"/proc/{pid}/statm") as handle:
                total += int(handle.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total
