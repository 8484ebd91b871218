"""Check for notebook 07's exercise: the global mean loss every rank reports.

The contract: ``global_mean_loss(loss_sum, count) -> float``: this rank's sum of per-sample losses and
its number of samples in; the mean over **all** ranks' samples out, the same on every rank. The ranks'
counts differ (a last, smaller batch; uneven shards), so a mean of the ranks' means is wrong. The check
runs it on 3 real ranks with 2, 8 and 20 samples.
"""

from __future__ import annotations

from ddpkit.exercises import Result, graded, run_on_ranks

COUNTS, MEANS = (2, 8, 20), (3.0, 1.0, 0.5)


def _on_rank(ctx, fn) -> float:
    return float(fn(MEANS[ctx.rank] * COUNTS[ctx.rank], COUNTS[ctx.rank]))


@graded("07_global_mean_loss", "global_mean_loss")
def check_global_mean_loss(fn) -> Result:
    runs = run_on_ranks(getattr(fn, "__name__", "global_mean_loss"), _on_rank, fn, world_size=len(COUNTS))
    if isinstance(runs, Result):
        return runs
    want = sum(m * c for m, c in zip(MEANS, COUNTS)) / sum(COUNTS)
    mean_of_means = sum(MEANS) / len(MEANS)
    if len(set(runs)) > 1:
        return Result(False, f"the ranks report different losses ({', '.join(f'{x:.4f}' for x in runs)}): reduce over all ranks so "
                             f"every rank reports the same number")
    if abs(runs[0] - mean_of_means) < 1e-9:
        return Result(False, f"every rank reports {runs[0]:.4f}, the mean of the ranks' means; over all {sum(COUNTS)} samples it "
                             f"is {want:.4f}: all-reduce the sum and the count, then divide")
    if abs(runs[0] - want) > 1e-6:
        return Result(False, f"every rank reports {runs[0]:.4f}; the mean over all {sum(COUNTS)} samples is {want:.4f}")
    return Result(True, f"every rank reports {want:.4f}, the mean over all {sum(COUNTS)} samples of 3 uneven ranks")
