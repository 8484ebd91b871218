"""FSDP2 prefetch: the same all-gathers issued earlier; what that costs in memory and buys in overlap.

Before a unit computes, FSDP2 must all-gather its parameters. Issued at that moment, the gather is on
the critical path: the unit waits for it. *Prefetching* issues it earlier, while the previous unit still
computes, so that communication and compute overlap. ``set_modules_to_forward_prefetch`` and
``set_modules_to_backward_prefetch`` name the units to gather ahead ("the prefetched all-gather is
issued earlier from the CPU"; two or more are "required for more aggressive overlap and will use more
reserved memory", their docstrings). FSDP2 already prefetches one unit in backward on its own, explicitly
(the reverse of the forward order, ``FSDPParamGroup._backward_prefetch``); in forward it prefetches
implicitly: it issues unit k+1's all-gather after unit k's kernels, on its own stream, so on a GPU the
gather runs while unit k still computes, and two gathered units can be alive (PyTorch's FSDP notes). A
forward prefetch list of one module only moves that issue earlier on the CPU. On gloo the issue blocks,
so the counts here see one unit in forward.

* **Memory** (:func:`run_prefetch`): with k units prefetched, k + 1 units' whole parameters are alive
  at once; counted from the order of events, in forward and in backward.
* **Overlap** (:func:`profile_pairs`, :func:`measure_overlap`): ``torch.profiler`` on real gloo ranks,
  FSDP2's all-gathers (``gloo:all_gather`` on gloo's worker threads) against the training thread's
  operators, with the measure of :mod:`ddpkit.debug.timeline`.

**Why this needs one switch on gloo.** FSDP2 calls its all-gathers with ``async_op=False`` and relies on
a GPU's streams for the overlap: on NCCL such a call only queues the collective on a communication
stream and returns, and the transfer runs beside the kernels already queued. On gloo the same call blocks the calling
thread until the bytes have arrived, so with FSDP2's defaults nothing can overlap on a CPU (that is the
control here: ``blocking``). ``FSDPModule._set_unshard_async_op(True)`` (private in torch 2.13) makes
FSDP2 pass ``async_op=True`` and wait on the work handle just before the unit runs: the CPU equivalent
of the stream, and the ``prefetch`` mode here. Reduce-scatters have no such switch (FSDP2 calls them
without ``async_op``), so on gloo they block in both modes; gloo runs ``reduce_scatter_tensor`` as an
all-reduce of the whole buffer, which is the name the trace shows.

The two modes train copies of one model (same weights) alternately, one step each in turn, under one
profiler session per launch: a busy machine slows both alike. A pair is counted for prefetch when its
all-gathers overlapped more of their time with compute than the blocking step next to it did; a sign
test on the pairs (:mod:`ddpkit.timing`) says whether that is chance, and more pairs are taken until it
is sure or the budget is spent.
"""

from __future__ import annotations

import os
import statistics

import torch

from ddpkit import timing
from ddpkit.debug import timeline
from ddpkit.parallel import fsdp
from ddpkit.parallel.collective_log import CollectiveLog
from ddpkit.parallel.fsdp_depth import batch_for, check_supported, fsdp_api, make_model

COMM = {"all_gather": "gloo:all_gather", "reduce_scatter": "gloo:all_reduce"}  # gloo's names for FSDP2's two
MODES = ("blocking", "prefetch")
MARK = "ddpkit."  # prefix of this module's record_function windows


def run_prefetch(ctx, *, prefetch: int = 0, width: int = 64, depth: int = 4) -> dict:
    """One forward and backward with each unit set to all-gather the next ``prefetch`` units in forward
    (``set_modules_to_forward_prefetch``) and the previous ``prefetch`` in backward
    (``set_modules_to_backward_prefetch``); ``0`` leaves FSDP2's defaults.

    Counted from the order of events. Forward: at the start of each unit's forward, the units gathered
    so far minus those whose forward has ended (resharded after it). Backward: after each all-gather,
    the units gathered in backward minus those whose gradients were reduce-scattered (a unit reshards
    right after its reduce-scatter). Returns the most units alive at once in each, and their bytes."""
    check_supported()
    fully_shard, _, _ = fsdp_api()
    model = make_model(width, depth)
    units = fsdp.shard_units(model)
    unit_bytes = [sum(p.numel() * p.element_size() for p in u.parameters()) for u in units]
    for unit in units:
        fully_shard(unit, reshard_after_forward=True)
    fully_shard(model)
    if prefetch:
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + prefetch])
            unit.set_modules_to_backward_prefetch(units[max(0, i - prefetch):i][::-1])
    with CollectiveLog() as log:
        hooks = [h for i, u in enumerate(units) for h in (
            u.register_forward_pre_hook(lambda *_, i=i: log.mark("unit_start", unit=i)),
            u.register_forward_hook(lambda *_, i=i: log.mark("unit_end", unit=i)))]
        x, y = batch_for(ctx.rank, 0, width)
        with log.during("forward"):
            loss = torch.nn.functional.mse_loss(model(x), y)
        with log.during("backward"):
            loss.backward()
        for hook in hooks:
            hook.remove()
    gathered = ended = alive = 0
    for r in log.records:
        if r["phase"] != "forward":
            continue
        gathered += r["op"] == "all_gather"
        ended += r["op"] == "unit_end"
        if r["op"] == "unit_start":
            alive = max(alive, gathered - ended)
    gathered = reduced = alive_backward = 0
    for r in log.records:
        if r["phase"] == "backward":
            gathered += r["op"] == "all_gather"
            reduced += r["op"] == "reduce_scatter"
            alive_backward = max(alive_backward, gathered - reduced)
    return {"prefetch": prefetch, "max_units_alive": alive, "max_alive_bytes": alive * max(unit_bytes),
            "max_units_alive_backward": alive_backward, "max_alive_bytes_backward": alive_backward * max(unit_bytes),
            "unit_bytes": max(unit_bytes), "order": [r["op"] + (str(r["unit"]) if "unit" in r else "")
                                                      for r in log.records if r["phase"] == "forward"],
            "backward_order": [r["op"] for r in log.records if r["phase"] == "backward"],
            "backward_all_gather": log.count("all_gather", "backward")}


def async_unshard(model: torch.nn.Module) -> None:
    """Make FSDP2 issue ``model``'s all-gathers with ``async_op=True`` (see the module docstring: on gloo
    the default blocks the thread). Refuses, with the reason, a torch without the switch."""
    setter = getattr(model, "_set_unshard_async_op", None)
    if setter is None:
        raise RuntimeError(f"torch {torch.__version__}'s FSDP2 has no _set_unshard_async_op: this lesson uses "
                           "torch 2.13's switch for all-gathers that do not block a gloo rank")
    setter(True)


def build(mode: str, width: int, depth: int, lr: float = 0.01):
    """A :func:`~ddpkit.parallel.fsdp_depth.make_model` sharded unit by unit with FSDP2, and its SGD.
    ``blocking``: FSDP2's defaults; ``prefetch``: async all-gathers, each unit gathering the next one
    ahead in forward and the previous one in backward."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    fully_shard, _, _ = fsdp_api()
    model = make_model(width, depth)
    units = fsdp.shard_units(model)
    for unit in units:
        fully_shard(unit, reshard_after_forward=True)
    fully_shard(model)
    if mode == "prefetch":
        async_unshard(model)
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 2])
            unit.set_modules_to_backward_prefetch(units[max(0, i - 1):i])
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def profile_pairs(ctx, folder: str, *, pairs: int = 8, width: int = 512, depth: int = 6, batch: int = 128,
                  modes: tuple[str, str] = MODES, warmup: int = 2) -> dict:
    """On this rank: ``pairs`` steps of each of ``modes`` (control first, treated second), one of each in
    turn (the order alternating), all under one ``torch.profiler`` session; return what each step's
    window holds.

    Per step and mode: its wall time under the profiler, the overlapped fraction of all-gathers and of
    reduce-scatters (forward and backward all-gathers also apart), and the intervals (compute,
    all-gathers, reduce-scatters) to draw. The trace is written to ``folder`` for Perfetto.
    Passing the same mode twice is the negative control of the comparison."""
    check_supported()
    built = [build(mode, width, depth) for mode in modes]
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(ctx.rank))

    def step(j: int, k: int) -> None:
        model, optimizer = built[k]
        with torch.profiler.record_function(f"{MARK}step {k} {j}"):
            with torch.profiler.record_function(f"{MARK}forward"):
                loss = model(x).square().mean()
            with torch.profiler.record_function(f"{MARK}backward"):
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    for j in range(warmup):
        for k in (0, 1):
            step(-1 - j, k)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for j in range(pairs):
            for k in ((0, 1) if j % 2 == 0 else (1, 0)):
                step(j, k)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{ctx.rank}.fsdp_prefetch.trace.json")
    prof.export_chrome_trace(path)
    spans = timeline.thread_intervals(path, tuple(COMM.values()), marks=MARK)
    steps = [m for m in spans["marks"] if m[0].startswith(f"{MARK}step")]
    phases = [m for m in spans["marks"] if not m[0].startswith(f"{MARK}step")]
    out = {"rank": ctx.rank, "modes": list(modes), "trace": path, "pairs": [{} for _ in range(pairs)]}
    for name, start, end in steps:
        k, j = (int(v) for v in name.split()[1:])
        lanes = {"compute": timeline.clip(spans["compute"], start, end),
                 **{op: timeline.clip(spans["comm"][gloo], start, end) for op, gloo in COMM.items()}}
        row = {"step_s": end - start, "start": start, "lanes": lanes,
               **{op: timeline.overlapped_fraction(lanes["compute"], lanes[op]) for op in COMM}}
        for phase in ("forward", "backward"):  # this step's window of each phase
            a, b = next((a, b) for n, a, b in phases if n == f"{MARK}{phase}" and start <= a < end)
            row[f"{phase}_all_gather"] = timeline.overlapped_fraction(
                timeline.clip(lanes["compute"], a, b), timeline.clip(lanes["all_gather"], a, b))
        out["pairs"][j][k] = row
    return out


def measure_overlap(folder: str, *, world_size: int = 2, pairs: int = 8, max_rounds: int = 3,
                    modes: tuple[str, str] = MODES, confidence: float = 0.99, say=print, **sizes) -> dict:
    """Launch :func:`profile_pairs` on ``world_size`` gloo ranks, round after round, until the sign test
    over all pairs so far is sure (``above``: the treated mode overlaps its all-gathers more than the
    control; ``below``; or ``unclear`` after ``max_rounds``). A pair's value is the treated step's
    all-gather overlapped fraction minus the control step's, averaged over the ranks.

    Returns the verdict, the pair values, per-mode medians (overlapped fractions, step times), the last
    round's per-rank results (for the picture) and its traces merged into one file for Perfetto."""
    from ddpkit.launch import launch

    values, rounds, per_mode = [], [], {m: {"all_gather": [], "reduce_scatter": [], "forward_all_gather": [],
                                            "backward_all_gather": [], "step_s": []} for m in ("control", "treated")}
    verdict = "unclear"
    for round_ in range(max_rounds):
        say(f"round {round_ + 1}: {pairs} pairs of profiled steps ({modes[0]} vs {modes[1]}) on {world_size} ranks ...")
        ranks = launch(profile_pairs, os.path.join(folder, f"round{round_}"), world_size=world_size, backend="gloo",
                       output="none", kwargs={"pairs": pairs, "modes": tuple(modes), **sizes})
        for j in range(pairs):
            values.append(statistics.fmean(r["pairs"][j][1]["all_gather"] - r["pairs"][j][0]["all_gather"] for r in ranks))
            for k, role in enumerate(("control", "treated")):
                for key, kept in per_mode[role].items():
                    kept.append(statistics.fmean(r["pairs"][j][k][key] for r in ranks))
        rounds.append(ranks)
        verdict = timing.verdict(values, 0.0, confidence)
        if verdict != "unclear":
            break
    merged = timeline.merge_traces([r["trace"] for r in rounds[-1]], os.path.join(folder, "fsdp_prefetch.trace.json"))
    return {"verdict": verdict, "values": values, "rounds": len(rounds), "modes": list(modes), "last": rounds[-1],
            "median": {role: {key: statistics.median(v) for key, v in kept.items()} for role, kept in per_mode.items()},
            "merged_trace": merged}


def draw(result: dict, axes) -> None:
    """The pair whose value is the median of the last round, one axis per mode: for each rank, its
    compute, all-gathers and reduce-scatters on one clock."""
    ranks = result["last"]
    pairs = len(ranks[0]["pairs"])
    diffs = [statistics.fmean(r["pairs"][j][1]["all_gather"] - r["pairs"][j][0]["all_gather"] for r in ranks)
             for j in range(pairs)]
    j = sorted(range(pairs), key=diffs.__getitem__)[pairs // 2]
    colors = {"compute": "#3182bd", "all_gather": "#fd8d3c", "reduce_scatter": "#e6550d"}
    for k, ax in enumerate(axes):
        rows = [(f"r{r['rank']} {lane.replace('_', '-')}", r["pairs"][j][k]["lanes"][lane], colors[lane])
                for r in ranks for lane in colors]
        start = min(r["pairs"][j][k]["start"] for r in ranks)
        shares = ", ".join(f"{r['pairs'][j][k]['all_gather']:.2f}" for r in ranks)
        title = f"{result['modes'][k]}: share of all-gather time overlapped with compute, per rank: {shares}"
        timeline.draw(ax, rows, start, title)
