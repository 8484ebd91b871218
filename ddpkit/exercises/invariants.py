"""Check for notebook 15's exercise: the capstone's invariant, every replica holds the same weights.

The contract: ``same_everywhere(model) -> bool``, called by every rank: True on every rank when all ranks
hold exactly the same parameters, False on every rank as soon as one differs anywhere (even in the last
bit of one element). The check runs it on 2, 3 and 4 real ranks: identical replicas, one rank's single
element nudged by one unit in the last place, and two of its elements swapped (every norm and sum stays
the same). Which rank differs, the cases' order and the weights are drawn when it runs; a rank is told
nothing about the others.
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn

from ddpkit.exercises import Result, graded, run_on_ranks

WORLDS = (3, 2, 4)


def _on_rank(ctx, fn, seed: int, changes: list[str]) -> list[bool]:
    answers = []
    for change in changes:  # this rank's own replica in each case: as is, or changed
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        with torch.no_grad():
            w = model[0].weight
            if change == "ulp":
                w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))
            elif change == "swap":  # every norm and sum stays the same
                w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()
        answers.append(bool(fn(model)))
    return answers


@graded("15_same_everywhere", "same_everywhere")
def check_same_everywhere(fn) -> Result:
    rng = random.SystemRandom()
    for world in WORLDS:
        odd = rng.randrange(world)
        cases = [("identical replicas", None), (f"one element one ulp apart on rank {odd}", "ulp"),
                 (f"two elements swapped on rank {odd} (the same norm)", "swap")]
        rng.shuffle(cases)
        seed = rng.getrandbits(31)
        changes = [[change if rank == odd and change else "none" for _, change in cases] for rank in range(world)]
        runs = run_on_ranks(getattr(fn, "__name__", "same_everywhere"), _on_rank, fn, seed, world_size=world,
                            rank_args=[(changes[rank],) for rank in range(world)])
        if isinstance(runs, Result):
            return runs
        for k, (case, change) in enumerate(cases):
            answers = [run[k] for run in runs]
            if len(set(answers)) > 1:
                return Result(False, f"on {world} ranks with {case}, the ranks answered {answers}: every rank must "
                                     f"reach the same verdict (compare through a collective)")
            if answers[0] != (change is None):
                hint = "" if change is None else ": a norm or a sum cannot see it; what does your comparison keep of each tensor?"
                return Result(False, f"on {world} ranks with {case}, every rank answered {answers[0]}{hint}")
    return Result(True, "the same verdict on every rank of 2, 3 and 4; one ulp and a norm-preserving swap both caught")
