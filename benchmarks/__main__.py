"""``python -m benchmarks [--quick] [--results DIR]``: run every benchmark (each writes ``<name>.json``), then the report.

Targets, not tests: these machines are noisy, so each benchmark measures ddpkit and its baseline side
by side in one run and reports the ratio.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
import async_save  # noqa: E402
import bucket_sweep  # noqa: E402
import checkpoint_cost  # noqa: E402
import collectives  # noqa: E402
import launch_latency  # noqa: E402
import pipeline_bubble  # noqa: E402
import recovery  # noqa: E402
import report  # noqa: E402
import sharding_memory  # noqa: E402
import startup  # noqa: E402
import trainer_overhead  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run, noisier numbers)")
    parser.add_argument("--results", default=None,
                        help="write the JSON, plots and report here instead of benchmarks/results (the README is then left alone)")
    args = parser.parse_args()
    quick = args.quick
    if args.results:
        _common.RESULTS = os.path.abspath(args.results)
    checkpoint_cost.main(repeats=5 if quick else 15)
    trainer_overhead.main(steps=100 if quick else 600)
    launch_latency.main(repeats=3 if quick else 40, teardown_launches=20 if quick else 200)
    startup.main(repeats=2 if quick else 5)
    collectives.main(repeats=2 if quick else 5)
    recovery.main(repeats=1 if quick else 3)
    sharding_memory.main(steps=2 if quick else 3)
    async_save.main(repeats=1 if quick else 3)
    bucket_sweep.main(steps=8 if quick else 30)
    pipeline_bubble.main(micro_counts=(2, 8) if quick else (2, 4, 8, 16), repeats=1 if quick else 2)
    print(report.write_report(_common.RESULTS, readme=None if args.results else report.README))


if __name__ == "__main__":
    main()
