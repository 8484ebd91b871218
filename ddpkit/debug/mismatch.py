"""Ranks that disagree about a collective: what you see without help, and what torch can tell you.

Every rank of a process group must issue the same collectives in the same order, with the same
shapes and dtypes. When one does not, the backend is not told: each rank sends and waits for bytes
according to its own call. On gloo the symptoms are a timeout on one rank ("Timed out waiting ... for
recv") and "Connection closed by peer" on another, or no error at all when the byte counts happen to
fit; nothing names the two calls that disagree.

``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps every process group created afterwards in a
``ProcessGroupWrapper``: before each collective, the ranks exchange a *fingerprint* of it (sequence
number, op type, tensor shapes, dtypes and devices) over a separate gloo group, and a mismatch raises
on every rank, naming both calls (PyTorch docs, "Debugging torch.distributed applications":
https://docs.pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications). The check costs one
extra collective per collective, so it is for debugging, not for production runs. The functions here
set the level inside the rank (``torch.distributed.set_debug_level``), then create the group they
use, so the notebook's own environment is left alone.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from ddpkit.debug import flight
from ddpkit.failures import LaunchError
from ddpkit.launch import launch

CASES = ("op", "shape", "dtype", "none")
"""How the odd rank's call differs: another op (broadcast instead of all_reduce), a tensor of another
shape, another dtype; ``none`` is the control where every rank makes the same call."""


def mismatched_collective(ctx, case: str, detail: bool, timeout_s: float, odd_rank: int = 1,
                          fr_folder: str | None = None) -> list[float]:
    """Every rank all-reduces a 4-element float32 tensor, except ``odd_rank``, whose call differs by ``case``.

    Without ``detail`` the calls go to the world group (its timeout is the launch's); with it, to a new
    group created after the debug level is set, with ``timeout_s``. With ``fr_folder``, each rank dumps
    its Flight Recorder there before raising, as a watchdog would.
    """
    if case not in CASES:
        raise ValueError(f"case must be one of {', '.join(CASES)}, got {case!r}")
    group = ctx.world_group  # created by the launcher, with the launch's timeout
    if detail:
        dist.set_debug_level(dist.DebugLevel.DETAIL)  # groups created from now on are wrapped
        group = dist.new_group(list(range(ctx.world_size)), timeout=datetime.timedelta(seconds=timeout_s),
                               backend="gloo")
    tensor = torch.ones(4)
    odd = ctx.rank == odd_rank
    try:
        dist.all_reduce(tensor, group=group)  # one good collective first: the rings agree up to here
        if odd and case == "op":
            dist.broadcast(tensor, src=0, group=group)
        elif odd and case == "shape":
            dist.all_reduce(torch.ones(8), group=group)
        elif odd and case == "dtype":
            dist.all_reduce(torch.ones(4, dtype=torch.float64), group=group)
        else:
            dist.all_reduce(tensor, group=group)
    finally:
        if fr_folder is not None:
            flight.dump(fr_folder, ctx.rank)
    return tensor.tolist()


def skipped_collective(ctx, steps: int, skip_step: int | None, fr_folder: str = "", odd_rank: int = 1,
                       evaluate_s: float = 60.0) -> int:
    """A loop that all-reduces its loss every step; ``odd_rank`` skips one step's all-reduce in a branch.

    The branch is the common one: "this batch's loss is not finite, skip it". The skipping rank runs
    one collective ahead: its next all-reduces pair with its peers' previous ones (same shape, so
    nothing fails: the values are silently wrong), and after the loop its peers wait for one
    all-reduce it will never issue. It goes on to its evaluation (here a sleep), outside any
    collective, so only the launcher's watchdog can name it. Both rings are dumped: the waiting
    ranks' on their timeout, the stalled rank's when the launcher stops it (SIGTERM). ``evaluate_s`` is
    far longer than the collective timeout, so the launcher stops the stalled rank first.
    """
    if fr_folder:
        flight.dump_on_sigterm(fr_folder, ctx.rank)
    done = 0
    try:
        for step in range(steps):
            loss = torch.tensor([float(step)])
            if ctx.rank == odd_rank and step == skip_step:
                loss = torch.tensor([float("nan")])
            if not torch.isfinite(loss).all():
                continue  # the bug: this rank alone leaves out a collective the others make
            dist.all_reduce(loss, group=ctx.world_group)
            done += 1
    except RuntimeError:
        if fr_folder:
            flight.dump(fr_folder, ctx.rank)
        raise
    time.sleep(evaluate_s)
    return done


def outcome(fn, *args, world_size: int = 2, timeout: float = 5.0, **kwargs) -> dict:
    """Launch ``fn(ctx, *args, **kwargs)`` on real ranks and say what a learner would see: the root
    cause, the other failures, each rank's last log lines (C++ messages are only there), the launcher's
    Flight Recorder summary of a stall, the time."""
    started = time.monotonic()
    try:
        results = launch(fn, *args, world_size=world_size, timeout=timeout, output="none", kwargs=kwargs)
    except LaunchError as err:
        return {"raised": True, "root": err.root_cause.headline(), "rank": err.rank, "logs": _logs(err.log_dir),
                "kind": err.root_cause.kind, "stack": err.root_cause.traceback, "flight": err.flight_summary,
                "others": [f.headline() for f in err.others], "seconds": time.monotonic() - started}
    return {"raised": False, "results": results, "seconds": time.monotonic() - started}


def _logs(folder: str, tail: int = 16_000) -> dict[int, str]:
    """The end of each rank's log in a failed launch's folder (the C++ messages are only there)."""
    logs = {}
    for rank in range(64):
        path = os.path.join(folder, f"rank{rank}.log")
        if not os.path.exists(path):
            break
        with open(path, "rb") as handle:
            logs[rank] = handle.read().decode(errors="replace")[-tail:]
    return logs
