"""Where the time goes: ``torch.profiler`` on real DDP ranks, compute and communication on one timeline.

On gloo, a DDP all-reduce shows up twice in a CPU trace: ``c10d::allreduce_`` on the training thread,
where the bucket is handed over (it returns at once), and ``gloo:all_reduce`` on one of gloo's worker
threads, for as long as the bytes are being exchanged. DDP launches each bucket's all-reduce as soon as
its gradients are ready, during the rest of ``backward``; the question a trace answers is how much
of that communication time the training thread spent computing (hidden) rather than waiting (exposed).

This module's measure: *compute* is the union of the training thread's ``aten::`` operator intervals
(a thread waiting for a collective runs no operator), *communication* is the union of the
``gloo:all_reduce`` intervals, and the **overlapped fraction** is the length of their intersection over
the length of communication. Each rank's Chrome trace (``export_chrome_trace``, which Perfetto and
``chrome://tracing`` open) is merged into one file with one process per rank. See PyTorch's profiler
recipe (https://docs.pytorch.org/tutorials/recipes/recipes/profiler_recipe.html).

:func:`thread_intervals` is the same measure for any gloo collective (FSDP2's ``gloo:all_gather``, and its
reduce-scatters, which gloo runs as ``gloo:all_reduce``), cut into the windows a ``record_function``
marked; :func:`draw` puts such intervals, lane by lane, on a matplotlib axis.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.files import write_atomic

COMM = "gloo:all_reduce"
MODES = ("ddp", "after backward")


def profiled_steps(ctx, mode: str, folder: str, steps: int = 3, width: int = 384, depth: int = 6,
                   batch: int = 256, bucket_cap_mb: float = 0.5) -> str:
    """Train an MLP for ``steps`` profiled steps (after two warm-up steps); write this rank's trace.

    ``mode`` is ``ddp`` (DDP's bucketed all-reduces, launched during backward) or ``after backward``
    (the same model without DDP, every gradient all-reduced after backward has finished: nothing left
    to overlap with, the control). Returns the trace's path.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    model = DDP(net, bucket_cap_mb=bucket_cap_mb, process_group=ctx.world_group) if mode == "ddp" else net
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(ctx.rank))

    def step():
        model(x).square().mean().backward()
        if mode == "after backward":
            for p in net.parameters():
                dist.all_reduce(p.grad, group=ctx.world_group)
                p.grad.div_(ctx.world_size)
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{ctx.rank}.{mode.replace(' ', '_')}.trace.json")
    prof.export_chrome_trace(path)
    return path


def intervals(trace_path: str) -> dict[str, list[tuple[float, float]]]:
    """A rank's compute and communication intervals (seconds on a clock shared by the ranks' traces)."""
    with open(trace_path) as handle:
        trace = json.load(handle)
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    comm = [e for e in events if e["name"] == COMM]
    main = {e["tid"] for e in events if e["name"] == "c10d::allreduce_"} or {e["tid"] for e in events if e["name"].startswith("aten::")}
    compute = [e for e in events if e["tid"] in main and e["name"].startswith("aten::")]

    def spans(evs):
        return _union([((base_us + e["ts"]) / 1e6, (base_us + e["ts"] + e["dur"]) / 1e6) for e in evs])

    return {"compute": spans(compute), "comm": spans(comm), "comm_threads": len({e["tid"] for e in comm})}


def thread_intervals(trace_path: str, comm: tuple[str, ...], marks: str = "") -> dict:
    """A rank's compute intervals, its communication intervals by name, and its marked windows.

    The training thread is the one that called into ``c10d::`` (FSDP2 issues ``_allgather_base_`` and
    ``_reduce_scatter_base_``, not DDP's ``allreduce_``; gloo's worker threads run ``aten::`` copies of
    their own, so "every thread with an operator" would count them as compute). ``comm`` names the gloo
    events to collect (each its own list of intervals); ``marks`` is the prefix of the
    ``record_function`` names whose windows to return, as ``(name, start, end)`` in trace order.
    Seconds on the clock the ranks' traces share.
    """
    with open(trace_path) as handle:
        trace = json.load(handle)
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    main = {e["tid"] for e in events if e["name"].startswith("c10d::")}

    def span(e):
        return (base_us + e["ts"]) / 1e6, (base_us + e["ts"] + e["dur"]) / 1e6

    return {"compute": _union([span(e) for e in events if e["tid"] in main and e["name"].startswith("aten::")]),
            "comm": {name: _union([span(e) for e in events if e["name"] == name]) for name in comm},
            "marks": sorted(((e["name"], *span(e)) for e in events if marks and e["tid"] in main
                             and e["name"].startswith(marks)), key=lambda m: m[1])}


def clip(spans: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The parts of ``spans`` inside ``[start, end]``."""
    return [(max(a, start), min(b, end)) for a, b in spans if b > start and a < end]


def draw(ax, rows: list[tuple[str, list[tuple[float, float]], str]], start: float, title: str = "") -> None:
    """One lane per ``(label, spans, color)`` row, top to bottom, in milliseconds since ``start``."""
    for lane, (label, spans, color) in enumerate(rows):
        bars = [((a - start) * 1e3, (b - a) * 1e3) for a, b in spans]
        ax.broken_barh(bars, (len(rows) - lane - 0.9, 0.8), color=color)
    ax.set_yticks([len(rows) - lane - 0.5 for lane in range(len(rows))], [label for label, _, _ in rows], fontsize=8)
    ax.set_xlabel("ms since the step began", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)


def overlapped_fraction(compute: list[tuple[float, float]], comm: list[tuple[float, float]]) -> float:
    """Share of the communication time during which the training thread was computing."""
    total = _length(comm)
    return _length(_intersect(compute, comm)) / total if total else 0.0


def comm_threads(trace_path: str) -> dict[str, set[int]]:
    """The threads of a rank's trace that ran each half of a gloo all-reduce: DDP's hand-over
    (``c10d::allreduce_``, on the training thread) and the exchange (``gloo:all_reduce``, on gloo's own
    worker threads). Empty sets for a trace without communication."""
    with open(trace_path) as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    return {name: {e["tid"] for e in events if e["name"] == name} for name in ("c10d::allreduce_", COMM)}


def trace_processes(merged_path: str) -> dict[int, dict]:
    """A merged trace's processes: for each ``pid``, the name Perfetto shows and how many events it holds."""
    with open(merged_path) as handle:
        events = json.load(handle)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return {pid: {"name": name, "events": sum(1 for e in events if e.get("pid") == pid and e.get("ph") != "M")}
            for pid, name in sorted(names.items())}


def merge_traces(paths: list[str], out: str) -> str:
    """One Chrome/Perfetto trace with each rank as its own process (named ``rank N``)."""
    merged = []
    for rank, path in enumerate(paths):
        with open(path) as handle:
            trace = json.load(handle)
        base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
        for event in trace["traceEvents"]:
            if "ts" in event and event.get("name") != "process_name":  # ours names the process by rank
                event = {**event, "pid": rank, "ts": float(event["ts"]) + base_us}
                merged.append(event)
        merged.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
    write_atomic(out, json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}).encode())
    return out


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)
