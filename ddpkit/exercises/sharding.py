"""Check for notebook 10's exercise: ZeRO-1, an AdamW whose state is sharded over the ranks.

The contract: ``cls(params, lr, betas, eps, weight_decay)`` with ``step()`` and ``zero_grad()``, used on
an **unwrapped** model (it averages the gradients over the ranks itself). The check trains an MLP for 3
steps on 2, 3 and 4 real ranks, each rank on its own samples (drawn when it runs; a rank is given only
its own), and compares every rank's parameters with DDP + ``torch.optim.AdamW`` on the same samples,
which it computes itself (atol 1e-6), with eps = 0.1, comparable to the gradients, so that a sum where a
mean belongs shows.

On 4 ranks it counts the optimizer state a rank keeps: the bytes of every tensor alive in the rank after
the steps that was not there before the optimizer was built (:mod:`ddpkit.exercises.holdings`: wherever
it is kept, in the optimizer, a closure, a class or a module), less the parameters, their gradients, and
buffers that hold a copy of them (a master copy of the weights, an all-gather or a reduce-scatter
buffer: a layout choice, not state). What is left is AdamW's moments and step counters: it must be at
most half of AdamW's moments for the whole model (8 bytes per parameter), whatever the layout (a flat
shard, or whole parameters per rank as in CS336's design: the model's parameters are alike in size so
that either partition is balanced). A correct flat shard keeps about 1/N of them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddpkit.exercises import Result, graded, run_on_ranks

STEPS, BATCH, HP = 3, 8, {"lr": 0.01, "betas": (0.9, 0.999), "eps": 0.1, "weight_decay": 0.01}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32))


def _draw(world: int) -> list[list]:
    """Every rank's samples for every step, drawn now."""
    import secrets

    gen = torch.Generator().manual_seed(secrets.randbits(62))
    return [[(torch.randn(BATCH, 32, generator=gen), torch.randint(0, 32, (BATCH,), generator=gen)) for _ in range(STEPS)]
            for _ in range(world)]


def _reference(data: list[list]) -> list[torch.Tensor]:
    """DDP + AdamW, as one process: the mean of every rank's mean-loss gradient, then AdamW."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), **HP)
    world = len(data)
    for step in range(STEPS):
        for rank in range(world):
            x, y = data[rank][step]
            (nn.functional.cross_entropy(model(x), y) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _on_rank(ctx, cls, count: bool, batches: list) -> dict:
    from ddpkit.exercises import holdings

    model = _model()
    params = list(model.parameters())
    before = holdings.baseline(params + [t for batch in batches for t in batch]) if count else None  # before the learner's code loads
    optimizer = cls(params, **HP)
    local_grads = torch.zeros(0)
    for step in range(STEPS):
        x, y = batches[step]
        nn.functional.cross_entropy(model(x), y).backward()
        local_grads = torch.cat([p.grad.detach().reshape(-1) for p in params])  # what a reduce-scatter buffer holds
        optimizer.step()
        optimizer.zero_grad()
    out = {"params": [p.detach().clone() for p in params]}
    if count:
        leave_out = params + [p.grad for p in params if p.grad is not None] + [local_grads]
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        out["bytes"] = holdings.held_bytes(before, leave_out, (flat, local_grads))
    return out


def _moments_bytes() -> int:
    """AdamW's two moments for the whole model: 8 bytes per parameter."""
    return 8 * sum(p.numel() for p in _model().parameters())


@graded("10_zero1", "zero1")
def check_zero1(cls) -> Result:
    """Check a ZeRO-1 optimizer on 2, 3 and 4 ranks (see the module docstring)."""
    for world in (2, 3, 4):
        data = _draw(world)
        runs = run_on_ranks(getattr(cls, "__name__", "the ZeRO-1 optimizer"), _on_rank, cls, world == 4,
                            world_size=world, rank_args=[(data[r],) for r in range(world)])
        if isinstance(runs, Result):
            return runs
        expected = _reference(data)
        for rank, run in enumerate(runs):
            if any(not torch.equal(a, b) for a, b in zip(run["params"], runs[0]["params"])):
                return Result(False, f"on {world} ranks, rank {rank} holds other parameters than rank 0 after {STEPS} steps: "
                                     f"every rank must all-gather the updated shards after its step")
        for rank, run in enumerate(runs):
            diff = max(float((a - b).abs().max()) for a, b in zip(run["params"], expected))
            if diff > 1e-6:
                return Result(False, f"on {world} ranks, the parameters differ from DDP + AdamW by up to {diff:.2e} after "
                                     f"{STEPS} steps: is each shard's gradient the mean over the ranks, and its update "
                                     f"AdamW's?")
        if world == 4:
            ratio = max(run["bytes"] for run in runs) / _moments_bytes()
            if ratio > 0.5:
                return Result(False, f"on 4 ranks a rank keeps {ratio:.2f}x AdamW's moments, wherever it keeps them (the "
                                     f"parameters and copies of them aside): which moments does this rank need?")
    return Result(True, f"DDP + AdamW's parameters on 2, 3 and 4 ranks after {STEPS} steps, keeping {ratio:.2f}x AdamW's "
                        f"moments per rank on 4")
