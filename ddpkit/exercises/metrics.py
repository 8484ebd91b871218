"""Check for notebook 07's exercise: the global mean loss every rank reports.

The contract: ``global_mean_loss(loss_sum, count) -> float``: this rank's sum of per-sample losses and
its number of samples in; the mean over **all** ranks' samples out, the same on every rank. The ranks'
counts differ (a last, smaller batch; uneven shards), so a mean of the ranks' means is wrong. The check
runs it on 2, 3 and 4 real ranks, each with counts and losses drawn from three seeds, and compares with
the mean it computes itself (the value is never shown: a constant cannot pass).
"""

from __future__ import annotations

import random

from ddpkit.exercises import Result, graded, run_on_ranks

SEEDS = (0, 1, 2)


def _case(world: int, seed: int) -> list[tuple[float, int]]:
    rng = random.Random(1000 * world + seed)
    return [(rng.uniform(0.2, 4.0), rng.choice((1, 2, 3, 5, 8, 13, 21, 34))) for _ in range(world)]


def _on_rank(ctx, fn) -> list[float]:
    return [float(fn(mean * count, count)) for mean, count in (_case(ctx.world_size, seed)[ctx.rank] for seed in SEEDS)]


@graded("07_global_mean_loss", "global_mean_loss")
def check_global_mean_loss(fn) -> Result:
    for world in (2, 3, 4):
        runs = run_on_ranks(getattr(fn, "__name__", "global_mean_loss"), _on_rank, fn, world_size=world)
        if isinstance(runs, Result):
            return runs
        for k, seed in enumerate(SEEDS):
            case = _case(world, seed)
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
    return Result(True, f"every rank reports the mean over all samples, on 2, 3 and 4 uneven ranks, {len(SEEDS)} "
                        f"draws each")
