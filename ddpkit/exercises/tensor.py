"""Check for notebook 12's exercise: Megatron's f and g, the two functions that make tensor parallelism.

The contract: ``copy_to_parallel(x)`` (f: the identity in forward, an all-reduce of the gradient in
backward) and ``reduce_from_parallel(x)`` (g: an all-reduce in forward, the identity in backward), both
over the default process group. The check builds an MLP split over 2, 3 and 4 real ranks with them
(first layer by output columns, second by input rows, the pattern of every transformer block), compares
its output and the gradient of its input with the whole MLP's, which it computes itself, and counts the
all-reduces at the dispatcher (:class:`ddpkit.exercises.witness.Collectives`): one in forward, one in
backward. The weights and the input are drawn when it runs, and each rank holds only its slice of the
weights, so no rank can compute the whole MLP by itself.
"""

from __future__ import annotations

import secrets

import torch
import torch.nn.functional as F

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

WORLDS, D, H = (2, 3, 4), 8, 24  # H divides by every world size


def _weights():
    gen = torch.Generator().manual_seed(secrets.randbits(62))
    return (torch.randn(H, D, generator=gen) / D**0.5, torch.randn(H, generator=gen) * 0.1,
            torch.randn(D, H, generator=gen) / H**0.5, torch.randn(D, generator=gen) * 0.1,
            torch.randn(4, D, generator=gen))


def _whole(w1, b1, w2, b2, x) -> tuple[torch.Tensor, torch.Tensor]:
    whole_in = x.clone().requires_grad_(True)
    whole = F.linear(F.gelu(F.linear(whole_in, w1, b1)), w2, b2)
    whole.sum().backward()
    return whole.detach(), whole_in.grad


def _on_rank(ctx, f, g, x, w1_rows, b1_rows, w2_cols, b2) -> dict:
    from ddpkit.exercises.witness import Collectives

    split_in = x.clone().requires_grad_(True)
    with Collectives() as forward:
        hidden = F.gelu(F.linear(f(split_in), w1_rows, b1_rows))  # column-parallel: this rank's hidden units
        out = g(F.linear(hidden, w2_cols)) + b2  # row-parallel: partial sums, all-reduced by g
    with Collectives() as backward:
        out.sum().backward()
    if split_in.grad is None:
        raise Wrong("no gradient reached the input: f and g must be autograd Functions (or differentiable) that pass it on")
    reduces = ("allreduce", "all_reduce")
    return {"out": out.detach().clone(), "grad": split_in.grad.detach().clone(),
            "forward": sum(op in reduces for op in forward.names()), "backward": sum(op in reduces for op in backward.names())}


@graded("12_f_and_g", "f_and_g")
def check_f_and_g(copy_to_parallel, reduce_from_parallel) -> Result:
    for world in WORLDS:
        w1, b1, w2, b2, x = _weights()
        want_out, want_grad = _whole(w1, b1, w2, b2, x)
        rows = [slice(r * H // world, (r + 1) * H // world) for r in range(world)]
        runs = run_on_ranks(getattr(copy_to_parallel, "__name__", "copy_to_parallel"), _on_rank, copy_to_parallel,
                            reduce_from_parallel, x, world_size=world,
                            rank_args=[(w1[rows[r]].clone(), b1[rows[r]].clone(), w2[:, rows[r]].clone(), b2) for r in range(world)])
        if isinstance(runs, Result):
            return runs
        out_err = max(_diff(run["out"], want_out) for run in runs)
        grad_err = max(_diff(run["grad"], want_grad) for run in runs)
        forward, backward = max(run["forward"] for run in runs), max(run["backward"] for run in runs)
        if out_err > 1e-5:
            return Result(False, f"on {world} ranks the split MLP's output differs from the whole one by {out_err:.2e}: "
                                 f"each rank's second layer gives a partial sum; where do the partial sums meet?")
        if grad_err > 1e-5:
            return Result(False, f"on {world} ranks the input's gradient differs from the whole MLP's by {grad_err:.2e}: "
                                 f"each rank's first layer sends back only its part of it; what does backward do at f?")
        if (forward, backward) != (1, 1):
            return Result(False, f"on {world} ranks, {forward} all-reduce(s) in forward and {backward} in backward, "
                                 f"not 1 and 1: which of f and g communicates in each direction?")
    return Result(True, "the split MLP equals the whole one on 2, 3 and 4 ranks (output and input gradient), with one "
                        "all-reduce each way")


def _diff(got, want: torch.Tensor) -> float:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return float("inf")
    return float((got.double() - want.double()).abs().max())
