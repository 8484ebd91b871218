"""Check for notebook 10's exercise: ZeRO-1, an AdamW whose state is sharded over the ranks.

The contract: ``cls(params, lr, betas, eps, weight_decay)`` with ``step()`` and ``zero_grad()``, used on
an **unwrapped** model (it averages the gradients over the ranks itself). The check trains an MLP for 3
steps on 2 and on 4 real ranks, each rank on its own samples, and compares every rank's parameters with
DDP + ``torch.optim.AdamW`` on the same samples (atol 1e-6), with eps = 0.1, comparable to the gradients,
so that a sum where a mean belongs shows. On 4 ranks it measures every tensor the optimizer object
holds (its ``state``, and anything else it keeps, parameters and their gradients excluded): at most
half of AdamW's state.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddpkit.exercises import Result, graded, run_on_ranks

STEPS, BATCH, HP = 3, 8, {"lr": 0.01, "betas": (0.9, 0.999), "eps": 0.1, "weight_decay": 0.01}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 16, generator=gen), torch.randint(0, 4, (BATCH,), generator=gen)


def _reference(world: int) -> list[torch.Tensor]:
    """DDP + AdamW, as one process: the mean of every rank's mean-loss gradient, then AdamW."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), **HP)
    for step in range(STEPS):
        for rank in range(world):
            x, y = _batch(step, rank)
            (nn.functional.cross_entropy(model(x), y) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def held_bytes(obj, exclude: set[int]) -> int:
    """Bytes of every distinct tensor reachable from ``obj`` (through containers and objects' attributes,
    an inner torch optimizer's ``state`` included), those in ``exclude`` left out."""
    seen_tensors, seen_objects, total, stack = set(), set(), 0, [obj]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            key = (item.untyped_storage().data_ptr(), item.numel())
            if id(item) not in exclude and key not in seen_tensors and item.numel():
                seen_tensors.add(key)
                total += item.numel() * item.element_size()
            continue
        if id(item) in seen_objects:
            continue
        seen_objects.add(id(item))
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
    return total


def _on_rank(ctx, cls) -> dict:
    model = _model()
    optimizer = cls(list(model.parameters()), **HP)
    for step in range(STEPS):
        x, y = _batch(step, ctx.rank)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    exclude = {id(p) for p in model.parameters()} | {id(p.grad) for p in model.parameters() if p.grad is not None}
    return {"params": [p.detach().clone() for p in model.parameters()], "bytes": held_bytes(optimizer, exclude)}


def _adamw_bytes() -> int:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), **HP)
    x, y = _batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    exclude = {id(p) for p in model.parameters()} | {id(p.grad) for p in model.parameters()}
    return held_bytes(optimizer, exclude)


@graded("10_zero1", "zero1")
def check_zero1(cls) -> Result:
    """Check a ZeRO-1 optimizer on 2 and 4 ranks (see the module docstring)."""
    for world in (2, 4):
        runs = run_on_ranks(getattr(cls, "__name__", "the ZeRO-1 optimizer"), _on_rank, cls, world_size=world)
        if isinstance(runs, Result):
            return runs
        expected = _reference(world)
        for rank, run in enumerate(runs):
            if any(not torch.equal(a, b) for a, b in zip(run["params"], runs[0]["params"])):
                return Result(False, f"on {world} ranks, rank {rank} holds other parameters than rank 0 after {STEPS} steps: "
                                     f"every rank must all-gather the updated shards after its step")
        for rank, run in enumerate(runs):
            diff = max(float((a - b).abs().max()) for a, b in zip(run["params"], expected))
            if diff > 1e-6:
                return Result(False, f"on {world} ranks, the parameters differ from DDP + AdamW by up to {diff:.2e} after {STEPS} "
                                     f"steps: average the gradients over the ranks (reduce-scatter, then divide by {world}) and "
                                     f"update each shard with AdamW's rule")
        if world == 4:
            ratio = max(run["bytes"] for run in runs) / _adamw_bytes()
            if ratio > 0.5:
                return Result(False, f"on 4 ranks the optimizer holds {ratio:.2f}x AdamW's state on its fullest rank: keep the "
                                     f"moments (and master copy) of this rank's shard only")
    return Result(True, f"DDP + AdamW's parameters on 2 and 4 ranks after {STEPS} steps, with {ratio:.2f}x AdamW's state per rank on 4")
