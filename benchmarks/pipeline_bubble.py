"""Pipeline bubble measured on real ranks against (p-1)/(m+p-1), as the number of micro-batches grows.

``pipeline.run_pipeline`` runs one training step of a 4-block GPT on 2 stages with
``torch.distributed.pipelining`` (GPipe, and 1F1B where this torch runs it on gloo), timing every
forward and backward chunk; the bubble is 1 - busy / (stages x span). Report, not a target: messages
between stages cost time the formula leaves out.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_results  # noqa: E402

from ddpkit.config import TrainConfig  # noqa: E402
from ddpkit.launch import launch  # noqa: E402
from ddpkit.parallel import pipeline  # noqa: E402


def main(micro_counts: tuple[int, ...] = (2, 4, 8, 16), stages: int = 2, repeats: int = 2) -> dict:
    cfg = TrainConfig(model="gpt", d_model=128, n_layers=4, seq_len=64)
    rows = []
    for name in pipeline.runnable_schedules():
        for m in micro_counts:
            results = launch(pipeline.run_pipeline, cfg, name, m, 4, repeats, world_size=stages, output="none")
            timeline = pipeline.measured_timeline(results)
            rows.append({"schedule": name, "micro_batches": m, "measured": pipeline.bubble(timeline),
                         "predicted": pipeline.predicted_bubble(stages, m), "held_on_stage_0": pipeline.in_flight(timeline, 0),
                         "grad_diff": max(r["grad_diff"] for r in results)})
    return write_results("pipeline_bubble", {"stages": stages, "micro_batch_size": 4, "rows": rows})


if __name__ == "__main__":
    main()
