"""Check for notebook 12's exercise: Megatron's f and g, the two functions that make tensor parallelism.

The contract: ``copy_to_parallel(x)`` (f: the identity in forward, an all-reduce of the gradient in
backward) and ``reduce_from_parallel(x)`` (g: an all-reduce in forward, the identity in backward), both
over the default process group. The check builds an MLP split over 2, 3 and 4 real ranks with them
(first layer by output columns, second by input rows, the pattern of every transformer block), compares
its output and the gradient of its input with the whole MLP's, and counts the all-reduces: one in
forward, one in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

WORLDS, D, H = (2, 3, 4), 8, 24  # H divides by every world size


def _weights():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(H, D, generator=gen) / D**0.5, torch.randn(H, generator=gen) * 0.1,
            torch.randn(D, H, generator=gen) / H**0.5, torch.randn(D, generator=gen) * 0.1)


def _on_rank(ctx, f, g) -> dict:
    import torch.distributed.distributed_c10d as c10d

    w1, b1, w2, b2 = _weights()
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(1))
    whole_in = x.clone().requires_grad_(True)
    whole = F.linear(F.gelu(F.linear(whole_in, w1, b1)), w2, b2)
    whole.sum().backward()
    rows = slice(ctx.rank * H // ctx.world_size, (ctx.rank + 1) * H // ctx.world_size)
    calls = {"n": 0}
    original = c10d.all_reduce

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    c10d.all_reduce = dist.all_reduce = counted
    try:
        split_in = x.clone().requires_grad_(True)
        hidden = F.gelu(F.linear(f(split_in), w1[rows], b1[rows]))  # column-parallel: this rank's hidden units
        out = g(F.linear(hidden, w2[:, rows])) + b2  # row-parallel: partial sums, all-reduced by g
        forward_calls = calls["n"]
        out.sum().backward()
        backward_calls = calls["n"] - forward_calls
    finally:
        c10d.all_reduce = dist.all_reduce = original
    if split_in.grad is None:
        raise Wrong("no gradient reached the input: f and g must be autograd Functions (or differentiable) that pass it on")
    return {"out": float((out.detach() - whole.detach()).abs().max()), "grad": float((split_in.grad - whole_in.grad).abs().max()),
            "forward": forward_calls, "backward": backward_calls}


@graded("12_f_and_g", "f_and_g")
def check_f_and_g(copy_to_parallel, reduce_from_parallel) -> Result:
    for world in WORLDS:
        runs = run_on_ranks(getattr(copy_to_parallel, "__name__", "copy_to_parallel"), _on_rank, copy_to_parallel,
                            reduce_from_parallel, world_size=world)
        if isinstance(runs, Result):
            return runs
        run = max(runs, key=lambda r: (r["out"], r["grad"]))
        if run["out"] > 1e-5:
            return Result(False, f"on {world} ranks the split MLP's output differs from the whole one by {run['out']:.2e}: "
                                 f"each rank holds a partial sum, so reduce_from_parallel (g) must all-reduce in forward")
        if run["grad"] > 1e-5:
            return Result(False, f"on {world} ranks the input's gradient differs from the whole MLP's by {run['grad']:.2e}: "
                                 f"each rank computed only its part, so copy_to_parallel (f) must all-reduce the gradient "
                                 f"in backward")
        if (run["forward"], run["backward"]) != (1, 1):
            return Result(False, f"on {world} ranks, {run['forward']} all-reduce(s) in forward and {run['backward']} in "
                                 f"backward, not 1 and 1: f is the identity in forward, g the identity in backward")
    return Result(True, "the split MLP equals the whole one on 2, 3 and 4 ranks (output and input gradient), with one "
                        "all-reduce each way")
