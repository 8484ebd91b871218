"""Check for notebook 04's exercise: start every replica from the same weights.

The contract: ``broadcast_parameters(model)``: after it returns, every rank holds rank 0's parameters
(what ``DistributedDataParallel`` does when it wraps a model). The check builds the model from a
different seed on each of 2, 3 and 4 real ranks (a frozen parameter and a weight shared by two layers
included; the seeds are drawn when it runs and each rank knows only its own), calls it, and compares
every rank's parameters with rank 0's before the call.
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn

from ddpkit.exercises import Result, graded, run_on_ranks


def _on_rank(ctx, fn, seed: int) -> dict:
    torch.manual_seed(seed)  # every rank initialises differently, as unseeded processes would
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.Linear(12, 12), nn.Linear(12, 3))
    model[3].weight = model[2].weight  # tied: one parameter, two layers
    model[0].bias.requires_grad_(False)  # frozen: still part of the replica
    before = [p.detach().clone() for p in model.parameters()]
    fn(model)
    return {"before": before, "after": [p.detach().clone() for p in model.parameters()]}


@graded("04_broadcast_parameters", "broadcast_parameters")
def check_broadcast_parameters(fn) -> Result:
    rng = random.SystemRandom()
    for world in (2, 3, 4):
        runs = run_on_ranks(getattr(fn, "__name__", "broadcast_parameters"), _on_rank, fn, world_size=world,
                            rank_args=[(rng.getrandbits(31),) for _ in range(world)])
        if isinstance(runs, Result):
            return runs
        source = runs[0]["before"]
        for rank, run in enumerate(runs):
            if len(run["after"]) == len(source) and all(torch.equal(a, b) for a, b in zip(run["after"], source)):
                continue
            owners = [r for r in range(world) if all(torch.equal(a, b) for a, b in zip(run["after"], runs[r]["before"]))]
            if owners == [rank]:
                return Result(False, f"on {world} ranks, rank {rank} kept its own parameters: every replica must end with "
                                     f"rank 0's values")
            if owners and owners[0] != 0:
                return Result(False, f"on {world} ranks, rank {rank} ended with rank {owners[0]}'s parameters, not rank "
                                     f"0's: check which rank the values come from")
            wrong = sum(not torch.equal(a, b) for a, b in zip(run["after"], source))
            return Result(False, f"on {world} ranks, rank {rank}'s parameters differ from rank 0's in {wrong} of "
                                 f"{len(source)} tensors: is every parameter sent, the frozen one too?")
    return Result(True, "2, 3 and 4 ranks hold rank 0's parameters (a frozen and a tied one included), each "
                        "initialised differently before")
