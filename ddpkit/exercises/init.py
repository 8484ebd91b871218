"""Check for notebook 04's exercise: start every replica from the same weights.

The contract: ``broadcast_parameters(model)``: after it returns, every rank holds rank 0's parameters
(what ``DistributedDataParallel`` does when it wraps a model). The check builds the model with a
different seed on each of 3 real ranks, calls it, and compares every rank's parameters with rank 0's
before the call.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddpkit.exercises import Result, graded, run_on_ranks

WORLD = 3


def _on_rank(ctx, fn) -> dict:
    torch.manual_seed(100 + ctx.rank)  # every rank initialises differently, as unseeded processes would
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    before = [p.detach().clone() for p in model.parameters()]
    fn(model)
    return {"before": before, "after": [p.detach().clone() for p in model.parameters()]}


@graded("04_broadcast_parameters", "broadcast_parameters")
def check_broadcast_parameters(fn) -> Result:
    runs = run_on_ranks(getattr(fn, "__name__", "broadcast_parameters"), _on_rank, fn, world_size=WORLD)
    if isinstance(runs, Result):
        return runs
    source = runs[0]["before"]
    for rank, run in enumerate(runs):
        if all(torch.equal(a, b) for a, b in zip(run["after"], source)):
            continue
        owners = [r for r in range(WORLD) if all(torch.equal(a, b) for a, b in zip(run["after"], runs[r]["before"]))]
        if owners == [rank]:
            return Result(False, f"rank {rank} kept its own parameters, which differ from rank 0's: broadcast every parameter "
                                 f"from rank 0 (dist.broadcast(p.data, src=0))")
        if owners and owners[0] != 0:
            return Result(False, f"rank {rank} ended with rank {owners[0]}'s parameters, not rank 0's: broadcast from src=0")
        wrong = sum(not torch.equal(a, b) for a, b in zip(run["after"], source))
        return Result(False, f"rank {rank}'s parameters differ from rank 0's in {wrong} of {len(source)} tensors: broadcast "
                             f"every parameter from rank 0 (dist.broadcast(p.data, src=0))")
    return Result(True, f"all {WORLD} ranks hold rank 0's parameters, each initialised differently before")
