"""DDP's bucket size against step time and overlap, as Stanford CS336's assignment 2 benchmarks it.

Two real DDP ranks (gloo, one thread each) train the same MLP with ``bucket_cap_mb`` swept over a range
that goes from one bucket per layer to one bucket for the whole model, plus DDP's default (25 MiB, with a
1 MiB first bucket: see :mod:`ddpkit.debug.buckets`). Every cap has its own model in the same ranks, and
one step of each runs in turn (after a barrier), so that a noisy machine slows all alike; the step times
are also given as ratios to the single-bucket model of the same run. The overlapped fraction is the
share of ``gloo:all_reduce`` time during which the training thread ran operators, from a few profiled
steps per cap (:mod:`ddpkit.debug.timeline`). ``python benchmarks/bucket_sweep.py [--quick]``.
"""

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summarize, write_results  # noqa: E402

from ddpkit.debug import buckets  # noqa: E402
from ddpkit.launch import launch  # noqa: E402

WIDTH, DEPTH, BATCH = 512, 8, 32  # 8 layers of 1.0 MiB of fp32 gradients each
CAPS = [0.5, 1.5, 2.5, 6, 25, None]  # 8, 4, 3, 2 and 1 buckets; None: DDP's default (2 buckets: 1 layer, then 7)
ONE_BUCKET = 25


def main(steps: int = 30, warmup: int = 3) -> dict:
    load_before = os.getloadavg()
    per_rank = launch(buckets.sweep, CAPS, steps, warmup, WIDTH, DEPTH, BATCH, world_size=2, output="none")
    load_after = os.getloadavg()

    def slower_rank(cap):  # a step ends when its slower rank does
        r0, r1 = (next(r for r in rank if r["bucket_cap_mb"] == cap) for rank in per_rank)
        return [max(a, b) for a, b in zip(r0["step_s"], r1["step_s"])]

    slowest_base = slower_rank(ONE_BUCKET)
    rows = []
    for r0, r1 in zip(*per_rank):
        times = slower_rank(r0["bucket_cap_mb"])
        rows.append({"bucket_cap_mb": "default" if r0["bucket_cap_mb"] is None else r0["bucket_cap_mb"],
                     "buckets": r0["buckets"], "step": summarize(times),
                     "step_over_one_bucket": statistics.median(a / b for a, b in zip(times, slowest_base)),
                     "overlapped_fraction": [round(r0["overlapped_fraction"], 3), round(r1["overlapped_fraction"], 3)],
                     "comm_s_per_step": [r0["comm_s_per_step"], r1["comm_s_per_step"]]})
    best = min(rows, key=lambda r: r["step_over_one_bucket"])
    return write_results("bucket_sweep", {
        "model": f"MLP {DEPTH} x Linear({WIDTH}, {WIDTH}), batch {BATCH} per rank", "rows": rows, "best_cap_mb": best["bucket_cap_mb"], "best_over_one_bucket": best["step_over_one_bucket"],
        "loadavg_1_5_15": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]},
        "note": f"2 ranks (gloo, 1 thread each), MLP {DEPTH} x Linear({WIDTH}, {WIDTH}), batch {BATCH} per rank, SGD; "
                f"{steps} timed steps per cap after {warmup} warm-up steps, one step of each cap in turn; step time = "
                "the slower rank's; step_over_one_bucket = median of per-step ratios to the single-bucket model "
                f"(bucket_cap_mb {ONE_BUCKET}) in the same run; overlapped fraction per rank from 3 profiled steps. "
                "Load average (os.getloadavg) before and after the run: the machine is shared, so compare within a run."})


if __name__ == "__main__":
    main(steps=8 if "--quick" in sys.argv else 30)
