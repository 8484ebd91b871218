"""Training stall of an async DCP save against a synchronous one, on the same state in one run.

``save_costs.measure_save_costs`` trains a GPT on real ranks, then saves it full, dcp, and dcp
async (snapshot + background write on its own gloo group while training continues). Target: the async
stall <= 10% of the synchronous dcp save.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_results  # noqa: E402

from ddpkit import save_costs  # noqa: E402
from ddpkit.config import TrainConfig  # noqa: E402
from ddpkit.launch import launch  # noqa: E402


def main(repeats: int = 3, world_size: int = 2, d_model: int = 256) -> dict:
    cfg = TrainConfig(model="gpt", world_size=world_size, d_model=d_model, n_layers=4, micro_batch_size=4,
                      dataset_size=512, steps=21, log_every=1000)
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as root:
            runs.append(launch(save_costs.measure_save_costs, cfg, root, world_size=world_size, output="none")[0])
    best = min(runs, key=lambda r: r["async"]["stall_s"] / r["dcp"]["seconds"])
    ratios = sorted(r["async"]["stall_s"] / r["dcp"]["seconds"] for r in runs)
    return write_results("async_save", {
        "world_size": world_size, "state_bytes": runs[0]["dcp"]["bytes"],
        "sync_dcp_s": [r["dcp"]["seconds"] for r in runs], "sync_full_s": [r["full"]["seconds"] for r in runs],
        "async_stall_s": [r["async"]["stall_s"] for r in runs],
        "stall_over_sync_median": ratios[len(ratios) // 2], "stall_over_sync_best": ratios[0],
        "step_s_plain": best["async"]["plain_step_s"], "step_s_during_write": best["async"]["step_s_during"],
        "target": 0.10,
    })


if __name__ == "__main__":
    main()
