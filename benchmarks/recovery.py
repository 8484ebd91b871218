"""Recovery time after a rank is SIGKILLed (launcher and torchrun), and work lost by save cadence.

Recovery: from the fault to the first step after the restart, split into detection, restart, restore
and first step (``ddpkit.recovery``). Target (seed 003): under 5 minutes. Cadence: a run whose steps
slow down halfway, saved every K steps, then every S seconds with the same number of saves; the
expected and worst seconds of work a failure at a random instant would lose.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_results  # noqa: E402

from ddpkit import recovery  # noqa: E402
from ddpkit.config import TrainConfig  # noqa: E402


def main(repeats: int = 3) -> dict:
    runs = {name: [] for name in ("ddpkit", "torchrun")}
    for _ in range(repeats):
        for name in runs:
            with tempfile.TemporaryDirectory() as workdir:
                runs[name].append(recovery.measure_recovery(workdir, name))
    median = {name: sorted(r, key=lambda x: x["total_s"])[len(r) // 2] for name, r in runs.items()}
    cfg = TrainConfig(steps=60, dataset_size=1024, log_every=1000, fail_mode="slow", fail_at_step=20, slow_step_s=0.08)
    with tempfile.TemporaryDirectory() as workdir:
        cadence = recovery.compare_cadences(cfg, workdir)
    return write_results("recovery", {
        "recovery_median": median, "recovery_runs": runs, "target_s": 300.0,
        "cadence": cadence,
        "worst_lost_ratio_seconds_over_steps": cadence["seconds"]["worst_lost_s"] / cadence["steps"]["worst_lost_s"],
    })


if __name__ == "__main__":
    main()
