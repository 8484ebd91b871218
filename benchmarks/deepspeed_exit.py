"""How a DeepSpeed ZeRO-3 job's processes end under torchrun, by the way they leave: aborts counted per run.

Run by ``.ci/extras`` (not by ``python -m benchmarks``: DeepSpeed is an optional extra). A process that
trained under ZeRO-3 and then ends the ordinary way tears its process group down in C++ destructors at
interpreter exit, which can abort with "terminate called without an active exception" after training has
finished; the exit code is then non-zero and torchrun reports the job failed. This script runs
``ddpkit.engines.deepspeed_job`` under torchrun ``--runs`` times with each way of leaving
(``--exit os-exit``, the kit's; ``destroy``: ``gc.collect()`` and ``destroy_process_group()`` first;
``interpreter``: nothing special) and counts, per way, the runs that aborted or exited non-zero, and the
runs whose weights differ from the first one's (they must not: the abort comes after training).

    python benchmarks/deepspeed_exit.py --runs 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpkit.engines import deepspeed_job  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=8, help="runs per way of leaving (default 8)")
    p.add_argument("--exits", default=",".join(deepspeed_job.EXITS), help="comma-separated ways of leaving")
    args = p.parse_args(argv)
    exits = args.exits.split(",")
    counts = {e: {"runs": 0, "aborted": 0, "failed": 0, "other_weights": 0, "wall_s": 0.0} for e in exits}
    first_sha = None
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.runs):
            for way in exits:  # interleaved, so that the machine's load falls on every way alike
                r = deepspeed_job.run_under("torchrun", folder, stage=3, exit=way)
                deepspeed_job.remove(r["shm_new"])
                c = counts[way]
                sha = r["summary"]["param_sha256"] if r["summary"] else None
                first_sha = first_sha or sha
                c["runs"] += 1
                c["aborted"] += r["aborted"]
                c["failed"] += r["returncode"] != 0
                c["other_weights"] += sha != first_sha
                c["wall_s"] += r["wall_s"]
                print(f"run {i + 1} {way}: exit code {r['returncode']}, aborted {r['aborted']}, "
                      f"{r['wall_s']:.1f} s", flush=True)
    for way, c in counts.items():
        print(f"ZeRO-3 under torchrun, --exit {way}: {c['aborted']} of {c['runs']} runs aborted "
              f"('terminate called'), {c['failed']} exited non-zero, {c['other_weights']} with other weights, "
              f"{c['wall_s'] / max(1, c['runs']):.1f} s a run, load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
