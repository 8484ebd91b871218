"""Check for notebook 09's exercise: an all-reduce (sum, in place) from point-to-point messages only.

The contract: ``fn(tensor)`` sums ``tensor`` over all ranks in place, using only ``send``/``recv``,
``isend``/``irecv`` or ``batch_isend_irecv``. The check runs it on 2, 3 and 4 real ranks for lengths
from 1 to a few thousand, ragged ones included, on integer-valued tensors (so any summation order gives
the same bits, which must equal ``dist.all_reduce``'s), counting every byte each rank sends. At length
>= 1000 on >= 3 ranks each rank must send about 2(N-1)/N of the tensor, as a ring does: a version that
gathers everything on one rank and sends the sum back is correct but sends N-1 times the tensor from
that rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

LENGTHS = (1, 5, 1000, 4097)
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce", "reduce_scatter", "all_to_all", "gather", "scatter",
               "all_gather_into_tensor", "reduce_scatter_tensor")


def _on_rank(ctx, fn) -> dict:
    import torch.distributed.distributed_c10d as c10d

    sent = {"bytes": 0}
    called = []
    originals = {}

    def counting(name):
        original = getattr(c10d, name)
        originals[name] = original

        def wrapper(*args, **kwargs):
            if name in ("send", "isend"):  # batch_isend_irecv calls isend for each of its sends
                tensor = args[0] if args else kwargs["tensor"]
                sent["bytes"] += tensor.numel() * tensor.element_size()
            else:
                called.append(name)
            return original(*args, **kwargs)
        return wrapper

    # patched where the learner calls them (dist.*) and where torch looks them up (P2POp checks its op)
    for name in ("send", "isend", *COLLECTIVES):
        if hasattr(c10d, name):
            wrapper = counting(name)
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)
    out = []
    try:
        for length in LENGTHS:
            gen = torch.Generator().manual_seed(1000 * length + ctx.rank)
            mine = torch.randint(-1000, 1000, (length,), generator=gen).float()
            expected = mine.clone()
            originals["all_reduce"](expected)
            tensor = mine.clone()
            sent["bytes"], called[:] = 0, []
            result = fn(tensor)
            if result is not None and result is not tensor and torch.is_tensor(result) and not torch.equal(result, tensor):
                raise Wrong("the function returned a new tensor and left its argument unchanged: sum in place (tensor.copy_(...))")
            if called:
                raise Wrong(f"it called dist.{called[0]}: use only point-to-point sends and receives")
            out.append({"length": length, "equal": torch.equal(tensor, expected), "sent": sent["bytes"],
                        "max_diff": float((tensor - expected).abs().max())})
    finally:
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
    return {"rank": ctx.rank, "rows": out}


@graded("09_ring_all_reduce", "ring_all_reduce")
def check_ring_all_reduce(fn) -> Result:
    """Check an all-reduce built from point-to-point messages on 2, 3 and 4 ranks (see the module docstring)."""
    for world in (2, 3, 4):
        runs = run_on_ranks(getattr(fn, "__name__", "the all-reduce"), _on_rank, fn, world_size=world)
        if isinstance(runs, Result):
            return runs
        for run in runs:
            for row in run["rows"]:
                if not row["equal"]:
                    return Result(False, f"on {world} ranks, length {row['length']}: rank {run['rank']} holds a result that differs "
                                         f"from dist.all_reduce by up to {row['max_diff']:g} (is every chunk summed over every rank?)")
        if world >= 3:
            for run in runs:
                row = next(r for r in run["rows"] if r["length"] >= 1000)
                share = row["sent"] / (4 * row["length"])
                ring = 2 * (world - 1) / world
                if not 0.8 * ring <= share <= 1.25 * ring + 4 * world / row["length"]:
                    return Result(False, f"on {world} ranks rank {run['rank']} sent {share:.2f}x the tensor for length {row['length']}; "
                                         f"a ring sends {ring:.2f}x from every rank: is everything gathered on one rank?")
    return Result(True, "bitwise dist.all_reduce on 2, 3 and 4 ranks for lengths 1 to 4097, each rank sending 2(N-1)/N of the tensor")
