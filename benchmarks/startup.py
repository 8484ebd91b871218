"""Wall time of ``ddpkit train`` (2 ranks, 40 steps, the defaults) from the shell, and where it goes.

The parts, each measured on its own in fresh interpreters and from the run's own records:
``import`` (Python and ``import ddpkit.cli``, which imports torch), ``prepare_imports`` (what the
parent imports once so that forked ranks inherit it: ``torch._dynamo``, which the first optimizer
step needs, and ``torch.distributed.checkpoint``), ``trainer_build`` (in the ranks: dataset, model,
DDP, optimizer), ``steps`` (the 40 steps), and ``other`` (fork, process group, teardown, output relay).
Goal: under 3 s on an idle 2-core machine with the tested torch.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summarize, write_results  # noqa: E402

IMPORTS = "import time; t = time.perf_counter(); import ddpkit.cli; print(time.perf_counter() - t)"
PREPARE = ("import time, ddpkit.cli; from ddpkit.launch import _import_what_ranks_need as f; "
           "t = time.perf_counter(); f(); print(time.perf_counter() - t)")


def timed(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True, text=True)
    return time.perf_counter() - started


def main(repeats: int = 5) -> dict:
    walls, builds, steps = [], [], []
    with tempfile.TemporaryDirectory() as root:
        for i in range(repeats):
            summary, metrics_dir = os.path.join(root, f"s{i}.json"), os.path.join(root, f"m{i}")
            walls.append(timed([sys.executable, "-m", "ddpkit", "train", "--summary-json", summary,
                                "--metrics-dir", metrics_dir]))
            with open(summary) as handle:
                rank0 = json.load(handle)
            with open(os.path.join(metrics_dir, "rank-00000.jsonl")) as handle:
                step_s = sum(e["step_time_s"] for e in map(json.loads, handle) if e["event"] == "step")
            steps.append(step_s)
            builds.append(rank0["wall_s"] - step_s)
    python_s = statistics.median(timed([sys.executable, "-c", "pass"]) for _ in range(3))
    imports = statistics.median(float(subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True).stdout)
                                for _ in range(3))
    prepare = statistics.median(float(subprocess.run([sys.executable, "-c", PREPARE], capture_output=True, text=True, check=True).stdout)
                                for _ in range(3))
    wall = statistics.median(walls)
    parts = {"python_start_s": python_s, "import_s": imports, "prepare_imports_s": prepare,
             "trainer_build_and_summary_s": statistics.median(builds), "steps_s": statistics.median(steps)}
    parts["other_s"] = wall - sum(parts.values())
    return write_results("startup", {"command": "ddpkit train (2 ranks, 40 steps)", "wall_s": summarize(walls),
                                     "breakdown_median_s": parts, "goal_s": 3.0})


if __name__ == "__main__":
    main()
