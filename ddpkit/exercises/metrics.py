"""Check for notebook 07's exercise: the global mean loss every rank reports.

The contract: ``global_mean_loss(loss_sum, count) -> float``: this rank's sum of per-sample losses and
its number of samples in; the mean over **all** ranks' samples out, the same on every rank. The ranks'
counts differ (a last, smaller batch; uneven shards), so a mean of the ranks' means is wrong. The check
runs it on 2, 3 and 4 real ranks, three draws each, with losses and counts drawn when it runs; each rank
is given only its own, and the check computes the mean itself (the value is never shown: a constant, or
a mean computed from anything but the other ranks' numbers, cannot pass).
"""

from __future__ import annotations

import random

from ddpkit.exercises import Result, graded, run_on_ranks

DRAWS = 3


def _cases(world: int, rng: random.Random) -> list[list[tuple[float, int]]]:
    """For each draw, each rank's (mean loss, count)."""
    return [[(rng.uniform(0.2, 4.0), rng.choice((1, 2, 3, 5, 8, 13, 21, 34))) for _ in range(world)]
            for _ in range(DRAWS)]


def _on_rank(ctx, fn, mine: list[tuple[float, int]]) -> list[float]:
    return [float(fn(mean * count, count)) for mean, count in mine]


@graded("07_global_mean_loss", "global_mean_loss")
def check_global_mean_loss(fn) -> Result:
    rng = random.Random(random.SystemRandom().getrandbits(64))  # drawn now, never shown
    for world in (2, 3, 4):
        cases = _cases(world, rng)
        runs = run_on_ranks(getattr(fn, "__name__", "global_mean_loss"), _on_rank, fn, world_size=world,
                            rank_args=[([case[rank] for case in cases],) for rank in range(world)])
        if isinstance(runs, Result):
            return runs
        for k, case in enumerate(cases):
            got = [run[k] for run in runs]
            want = sum(m * c for m, c in case) / sum(c for _, c in case)
            mean_of_means = sum(m for m, _ in case) / world
            if max(got) - min(got) > 1e-9 * max(1.0, abs(max(got))):
                return Result(False, f"on {world} ranks the ranks report different losses: every rank must report one "
                                     f"number, reduced over all ranks")
            if abs(got[0] - mean_of_means) < 1e-9 and abs(want - mean_of_means) > 1e-6:
                return Result(False, f"on {world} ranks every rank reports the mean of the ranks' means: ranks with "
                                     f"more samples must weigh more")
            if abs(got[0] - want) > 1e-6 * max(1.0, abs(want)):
                return Result(False, f"on {world} ranks with uneven counts, every rank reports a number that is not "
                                     f"the mean over all samples: check what each rank contributes")
    return Result(True, f"every rank reports the mean over all samples, on 2, 3 and 4 uneven ranks, {DRAWS} draws each")
