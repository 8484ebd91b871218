"""Check for notebook 09's exercise: an all-reduce (sum, in place) from point-to-point messages only.

The contract: ``fn(tensor)`` sums ``tensor`` over all ranks in place, using only ``send``/``recv``,
``isend``/``irecv`` or ``batch_isend_irecv``, for a float32, float64 or int64 tensor. The check runs it on
2, 3 and 4 real ranks for lengths from 1 to a few thousand, ragged ones included, on float32 tensors of
integer values drawn when it runs (so any summation order gives the same bits; each rank holds only its
own), then on 3 ranks on float64 and int64 tensors of values near 2^40 (which float32 cannot hold: a
buffer or a message in float32 shows), and compares every rank's result with the sum it computes itself.
Every c10d operation the function issues is recorded at the dispatcher
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


def _wrong_sum(runs: list[dict], inputs: list[list[torch.Tensor]], lengths: tuple, world: int, dtype: str) -> str | None:
    for k, length in enumerate(lengths):
        want = sum(inputs[rank][k] for rank in range(world))
        for rank, run in enumerate(runs):
            got = run["rows"][k]["sum"]
            if not (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
                    and torch.equal(got, want)):
                if dtype == "float32":
                    return (f"on {world} ranks, length {length}: rank {rank}'s result differs from the sum over the "
                            f"ranks: follow one chunk around the ring on paper")
                return (f"on {world} ranks a {dtype} tensor of length {length}: rank {rank}'s result differs from the "
                        f"sum, where float32 ones sum right: is every value carried in the tensor's own dtype?")
    return None


OTHER_DTYPES = {"float64": torch.float64, "int64": torch.int64}
OTHER_LENGTHS = (5, 1000)


@graded("09_ring_all_reduce", "ring_all_reduce")
def check_ring_all_reduce(fn) -> Result:
    """Check an all-reduce built from point-to-point messages on 2, 3 and 4 ranks (see the module docstring)."""
    gen = torch.Generator().manual_seed(secrets.randbits(62))  # drawn now: no rank can know another's numbers
    name = getattr(fn, "__name__", "the all-reduce")
    for world in (2, 3, 4):
        inputs = [[torch.randint(-1000, 1000, (length,), generator=gen).float() for length in LENGTHS]
                  for _ in range(world)]
        runs = run_on_ranks(name, _on_rank, fn, world_size=world, rank_args=[(inputs[rank],) for rank in range(world)])
        if isinstance(runs, Result):
            return runs
        wrong = _wrong_sum(runs, inputs, LENGTHS, world, "float32")
        if wrong:
            return Result(False, wrong)
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
    world = 3
    for dtype, torch_dtype in OTHER_DTYPES.items():  # values float32 cannot hold: 2^40 plus small integers
        inputs = [[(torch.randint(-1000, 1000, (length,), generator=gen) + 2**40).to(torch_dtype)
                   for length in OTHER_LENGTHS] for _ in range(world)]
        runs = run_on_ranks(name, _on_rank, fn, world_size=world, rank_args=[(inputs[rank],) for rank in range(world)])
        if isinstance(runs, Result):
            said = runs.message if len(runs.message) <= 110 else runs.message[:107].rstrip() + "..."
            return Result(False, f"with {dtype} tensors on {world} ranks (float32 ones sum right): {said}; are the "
                                 f"receive buffers of the tensor's dtype?")
        wrong = _wrong_sum(runs, inputs, OTHER_LENGTHS, world, dtype)
        if wrong:
            return Result(False, wrong)
    return Result(True, "bitwise the sum on 2, 3 and 4 ranks for lengths 1 to 4097, each rank sending 2(N-1)/N of the "
                        "tensor, and for float64 and int64 tensors")
