"""Collectives on gloo: the hand-written ring against gloo's all_reduce, and gloo against a memory copy.

Ring: ``ddpkit.parallel.comm.ring_all_reduce`` (Python, send/recv) against ``dist.all_reduce`` on the
same ranks, 1 to 64 MB, interleaved; reports the time ratio per size. Limit: gloo's all_reduce busbw
at 64 MB as a fraction of a memory copy's bandwidth measured in the same run.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_results  # noqa: E402

from ddpkit.launch import launch  # noqa: E402
from ddpkit.parallel import comm  # noqa: E402

MB = 2**20


def measure(ctx, sizes, iters):
    rows = []
    for nbytes in sizes:
        gloo = comm.time_collective("all_reduce", nbytes, iters=iters)
        ring = comm.time_collective("ring_all_reduce", nbytes, iters=iters)
        rows.append({"bytes": nbytes, "gloo_s": gloo, "ring_s": ring, "ring_over_gloo": ring / gloo,
                     "gloo_busbw": comm.bandwidths("all_reduce", nbytes, gloo, ctx.world_size)["busbw"]})
    return rows


def main(repeats: int = 5, world_size: int = 2) -> dict:
    sizes = [1 * MB, 4 * MB, 16 * MB, 64 * MB]
    rows = launch(measure, sizes, repeats, world_size=world_size, output="none")[0]
    memcpy = comm.memcpy_bandwidth(64 * MB)
    largest = rows[-1]
    return write_results("collectives", {
        "world_size": world_size, "rows": rows, "memcpy_bandwidth": memcpy,
        "gloo_busbw_64mb_over_memcpy": largest["gloo_busbw"] / memcpy,
        "ring_over_gloo": {str(r["bytes"]): round(r["ring_over_gloo"], 3) for r in rows},
    })


if __name__ == "__main__":
    main()
