"""Check for notebook 09's exercise: an all-reduce (sum, in place) from point-to-point messages only.

The contract: ``fn(tensor)`` sums ``tensor`` over all ranks in place, using only ``send``/``recv``,
``isend``/``irecv`` or ``batch_isend_irecv``. The check runs it on 2, 3 and 4 real ranks for lengths
from 1 to a few thousand, ragged ones included, on integer-valued tensors drawn when it runs (so any
summation order gives the same bits; each rank holds only its own), and compares every rank's result
with the sum it computes itself. Every c10d operation the function issues is recorded at the dispatcher
(:class:`ddpkit.exercises.witness.Collectives`), so a collective reached by any name (an alias, the
process group's own method, a functional collective) is seen, and each message is counted once,
blocking ``send`` or ``isend`` alike. At length >= 1000 on >= 3 ranks each rank must send about
2(N-1)/N of the tensor, as a ring does: gathering everything on one rank and sending the sum back is
correct but sends N-1 times the tensor from that rank.
"""

from __future__ import annotations

import secrets

import torch

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

LENGTHS = (1, 5, 1000, 4097)


def _on_rank(ctx, fn, inputs: list[torch.Tensor]) -> dict:
    from ddpkit.exercises.witness import COLLECTIVE_OPS, Collectives

    out = []
    for mine in inputs:
        tensor = mine.clone()
        with Collectives() as seen:  # every c10d operation, whatever name reached it
            result = fn(tensor)
        if result is not None and result is not tensor and torch.is_tensor(result) and not torch.equal(result, tensor):
            raise Wrong("the function returned a new tensor and left its argument unchanged: the sum must land in "
                        "the tensor it was given")
        collective = [op for op in seen.names() if op in COLLECTIVE_OPS]
        if collective:
            raise Wrong(f"it ran a collective ({collective[0]}) where only point-to-point sends and receives belong")
        out.append({"sum": tensor.detach().clone(), "sent": seen.sent_bytes()})
    return {"rank": ctx.rank, "rows": out}


@graded("09_ring_all_reduce", "ring_all_reduce")
def check_ring_all_reduce(fn) -> Result:
    """Check an all-reduce built from point-to-point messages on 2, 3 and 4 ranks (see the module docstring)."""
    gen = torch.Generator().manual_seed(secrets.randbits(62))  # drawn now: no rank can know another's numbers
    for world in (2, 3, 4):
        inputs = [[torch.randint(-1000, 1000, (length,), generator=gen).float() for length in LENGTHS]
                  for _ in range(world)]
        runs = run_on_ranks(getattr(fn, "__name__", "the all-reduce"), _on_rank, fn, world_size=world,
                            rank_args=[(inputs[rank],) for rank in range(world)])
        if isinstance(runs, Result):
            return runs
        for k, length in enumerate(LENGTHS):
            want = sum(inputs[rank][k] for rank in range(world))
            for rank, run in enumerate(runs):
                got = run["rows"][k]["sum"]
                if not (isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)):
                    return Result(False, f"on {world} ranks, length {length}: rank {rank}'s result differs from the "
                                         f"sum over the ranks: follow one chunk around the ring on paper")
        if world >= 3:
            for rank, run in enumerate(runs):
                k = next(k for k, length in enumerate(LENGTHS) if length >= 1000)
                share = run["rows"][k]["sent"] / (4 * LENGTHS[k])
                ring = 2 * (world - 1) / world
                if share > 1.25 * ring + 4 * world / LENGTHS[k]:
                    return Result(False, f"on {world} ranks rank {rank} sent {share:.2f}x the tensor, more than a ring's "
                                         f"2(N-1)/N: does one rank collect or send the whole tensor?")
                if share < 0.8 * ring:
                    return Result(False, f"on {world} ranks rank {rank} sent {share:.2f}x the tensor, less than a ring's "
                                         f"2(N-1)/N: does each rank send its share of every chunk?")
    return Result(True, "bitwise the sum on 2, 3 and 4 ranks for lengths 1 to 4097, each rank sending 2(N-1)/N of the "
                        "tensor")
