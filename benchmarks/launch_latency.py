"""Time for ddpkit.launch to bring N gloo ranks to a first barrier and back, against raw
torch.multiprocessing.start_processes doing the same (same start method), interleaved in one run.
Target: launch <= 1.10x raw."""

import datetime
import os
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summarize, write_results  # noqa: E402

from ddpkit.launch import free_port, launch  # noqa: E402
from ddpkit.runtime import destroy_process_group  # noqa: E402


def ddpkit_barrier(ctx):
    dist.barrier()


def raw_barrier(rank, world_size, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=30))
    dist.barrier()
    destroy_process_group()


def main(repeats: int = 15) -> None:
    results = {}
    for world_size in (2, 4):
        ours, raw = [], []
        for _ in range(repeats):  # interleaved, so drift on a noisy machine hits both alike
            t = time.perf_counter()
            launch(ddpkit_barrier, world_size=world_size, start_method="fork", output="none")
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            mp.start_processes(raw_barrier, args=(world_size, free_port()), nprocs=world_size, start_method="fork")
            raw.append(time.perf_counter() - t)
        o, r = summarize(ours), summarize(raw)
        results[f"world_{world_size}"] = {"ddpkit": o, "raw_start_processes": r,
                                          "ratio_median": o["median_s"] / r["median_s"], "target_ratio": 1.10}
    write_results("launch_latency", results)


if __name__ == "__main__":
    main()
