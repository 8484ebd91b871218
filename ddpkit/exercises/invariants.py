"""Check for notebook 15's exercise: the capstone's invariant, every replica holds the same weights.

The contract: ``same_everywhere(model) -> bool``, called by every rank: True on every rank when all ranks
hold exactly the same parameters, False on every rank as soon as one differs anywhere (even in the last
bit of one element). The check runs it on 2, 3 and 4 real ranks: identical replicas, then the last rank's
single element nudged by one unit in the last place, then a nudge that keeps the parameters' norm equal.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddpkit.exercises import Result, graded, run_on_ranks

WORLDS = (3, 2, 4)


def _on_rank(ctx, fn) -> list[bool]:
    answers = []
    for case in ("equal", "one ulp", "same norm"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        if ctx.rank == ctx.world_size - 1 and case != "equal":
            with torch.no_grad():
                w = model[0].weight
                if case == "one ulp":
                    w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))
                else:  # swap two elements: every norm and sum stays the same
                    w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()
        answers.append(bool(fn(model)))
    return answers


@graded("15_same_everywhere", "same_everywhere")
def check_same_everywhere(fn) -> Result:
    for world in WORLDS:
        runs = run_on_ranks(getattr(fn, "__name__", "same_everywhere"), _on_rank, fn, world_size=world)
        if isinstance(runs, Result):
            return runs
        last = world - 1
        for k, case in enumerate(("identical replicas", f"one element one ulp apart on rank {last}",
                                  f"two elements swapped on rank {last} (the same norm)")):
            answers = [run[k] for run in runs]
            if len(set(answers)) > 1:
                return Result(False, f"on {world} ranks with {case}, the ranks answered {answers}: every rank must "
                                     f"reach the same verdict (compare through a collective)")
            if answers[0] != (k == 0):
                hint = "" if k == 0 else ": a norm or a sum cannot see it; compare the bytes (a hash of every tensor)"
                return Result(False, f"on {world} ranks with {case}, every rank answered {answers[0]}{hint}")
    return Result(True, "the same verdict on every rank of 2, 3 and 4; one ulp and a norm-preserving swap both caught")
