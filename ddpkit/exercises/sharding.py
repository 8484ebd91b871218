"""Check for notebook 10's exercise: ZeRO-1, an AdamW whose state is sharded over the ranks.

The contract: ``cls(params, lr, betas, eps, weight_decay)`` with ``step()`` and ``zero_grad()``, used on
an **unwrapped** model (it averages the gradients over the ranks itself). The check trains an MLP for 3
steps on 2 and on 4 real ranks, each rank on its own samples, and compares every rank's parameters with
DDP + ``torch.optim.AdamW`` on the same samples (atol 1e-6), with eps = 0.1, comparable to the gradients,
so that a sum where a mean belongs shows. On 4 ranks it measures the optimizer state a rank keeps:
every tensor reachable from the optimizer object, from its class and from the module that defines it
(a module global is state too), except the parameters, their gradients, and buffers that only hold a
copy of them (an all-gather buffer holds the parameters, a reduce-scatter buffer the gradients: keeping
them is a layout choice, not optimizer state). It must be at most half of AdamW's state, whatever the
layout (a flat shard, or whole parameters per rank as in CS336's design: the model's parameters are
alike in size so that either partition is balanced).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn

from ddpkit.exercises import Result, graded, run_on_ranks

STEPS, BATCH, HP = 3, 8, {"lr": 0.01, "betas": (0.9, 0.999), "eps": 0.1, "weight_decay": 0.01}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 32, generator=gen), torch.randint(0, 32, (BATCH,), generator=gen)


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


def held_bytes(obj, exclude: set[int], copies: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of every distinct tensor reachable from ``obj`` (through containers and objects' attributes,
    an inner torch optimizer's ``state`` included), those in ``exclude`` left out, and those whose values
    start with one of ``copies`` (flat vectors: buffers holding the parameters or the gradients)."""
    seen_tensors, seen_objects, total, stack = set(), set(), 0, [obj]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            key = (item.untyped_storage().data_ptr(), item.numel())
            if id(item) not in exclude and key not in seen_tensors and item.numel() and not _is_copy(item, copies):
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
        elif hasattr(item, "__dict__") and not isinstance(item, (type, types.ModuleType, types.FunctionType)):
            stack.extend(vars(item).values())
    return total


def _is_copy(tensor: torch.Tensor, copies: tuple[torch.Tensor, ...]) -> bool:
    flat = tensor.detach().reshape(-1)
    for copy in copies:
        n = min(flat.numel(), copy.numel())
        if n >= copy.numel() // 2 and torch.equal(flat[:n].float(), copy[:n].float()):
            return True
    return False


def learner_roots(cls) -> list:
    """Where a learner's optimizer can keep state besides itself: its classes and the module defining it."""
    import sys

    roots = []
    for klass in getattr(cls, "__mro__", (cls,)):
        module = getattr(klass, "__module__", "") or ""
        if module.startswith(("torch", "ddpkit", "builtins")):
            continue
        roots.append(dict(vars(klass)))
        if module in sys.modules:
            roots.append({k: v for k, v in vars(sys.modules[module]).items() if not k.startswith("__")})
    return roots


def _on_rank(ctx, cls) -> dict:
    model = _model()
    optimizer = cls(list(model.parameters()), **HP)
    for step in range(STEPS):
        x, y = _batch(step, ctx.rank)
        nn.functional.cross_entropy(model(x), y).backward()
        local_grads = torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()])  # what a reduce-scatter buffer holds
        optimizer.step()
        optimizer.zero_grad()
    params = list(model.parameters())
    exclude = {id(p) for p in params} | {id(p.grad) for p in params if p.grad is not None}
    copies = (torch.cat([p.detach().reshape(-1) for p in params]), local_grads)
    held = held_bytes([optimizer, *learner_roots(cls)], exclude, copies)
    return {"params": [p.detach().clone() for p in params], "bytes": held}


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
    """Check a ZeRO-1 optimizer on 2, 3 and 4 ranks (see the module docstring)."""
    for world in (2, 3, 4):
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
                return Result(False, f"on {world} ranks, the parameters differ from DDP + AdamW by up to {diff:.2e} after "
                                     f"{STEPS} steps: is each shard's gradient the mean over the ranks, and its update "
                                     f"AdamW's?")
        if world == 4:
            ratio = max(run["bytes"] for run in runs) / _adamw_bytes()
            if ratio > 0.5:
                return Result(False, f"on 4 ranks a rank keeps {ratio:.2f}x AdamW's state (in the optimizer, its class or its "
                                     f"module): which moments does this rank need?")
    return Result(True, f"DDP + AdamW's parameters on 2, 3 and 4 ranks after {STEPS} steps, with {ratio:.2f}x AdamW's state "
                        f"per rank on 4")
