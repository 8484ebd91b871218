"""Check for notebook 03's exercise: how many bytes each rank holds, by ZeRO stage.

The contract: ``state_bytes(params, strategy, world) -> {"params": ..., "grads": ..., "optimizer": ...}``,
bytes per rank for fp32 training with AdamW (4 bytes per weight, 4 per gradient, 8 for the two moments,
no separate master copy), for ``ddp`` (everything whole), ``zero1`` (the optimizer state sharded),
``zero2`` (and the gradients), ``zero3`` (and the parameters); a shard is ceil(params / world) elements.
The ``ddp`` answer is also checked against bytes measured on 2 real ranks after a DDP + AdamW step.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ddpkit.exercises import Result, graded, not_implemented, run_on_ranks

STAGES = {"ddp": (False, False, False), "zero1": (False, False, True), "zero2": (False, True, True), "zero3": (True, True, True)}
WHAT = {0: "parameters", 1: "gradients", 2: "optimizer state"}


def expected(params: int, strategy: str, world: int) -> dict:
    shard = math.ceil(params / world)
    w, g, o = STAGES[strategy]
    return {"params": 4 * (shard if w else params), "grads": 4 * (shard if g else params), "optimizer": 8 * (shard if o else params)}


def _measured(ctx) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters())
    ddp(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    return {"numel": sum(p.numel() for p in model.parameters()), "params": sum(size(p) for p in model.parameters()),
            "grads": sum(size(p.grad) for p in model.parameters()),
            "optimizer": sum(size(v) for s in optimizer.state.values() for k, v in s.items() if k != "step")}


@graded("03_state_bytes", "state_bytes")
def check_state_bytes(fn) -> Result:
    import random

    from ddpkit.exercises import learner

    runs = run_on_ranks(getattr(fn, "__name__", "state_bytes"), _measured, world_size=2)
    if isinstance(runs, Result):
        return runs
    measured = runs[0]
    rng = random.SystemRandom()
    sizes = [(1_000, 4), (1_001, 4), (7_000_000_000, 8), (10, 3)]  # then two drawn now: no table of answers passes
    sizes += [(rng.randint(2, 10**10), rng.randint(2, 16)) for _ in range(2)]
    calls = [(params, strategy, world) for params, world in sizes for strategy in STAGES]
    try:
        answers = learner.many(fn, calls + [(measured["numel"], "ddp", 2)])
    except NotImplementedError:
        return not_implemented(getattr(fn, "__name__", "state_bytes"))
    except learner.Raised as exc:
        return Result(False, exc.sentence("state_bytes"))
    for (params, strategy, world), got in zip(calls, answers):
        want = expected(params, strategy, world)
        if not isinstance(got, dict):
            return Result(False, f"state_bytes returned {type(got).__name__}: return a dict with params, grads and optimizer")
        for k, key in enumerate(("params", "grads", "optimizer")):
            if got.get(key) != want[key]:
                return Result(False, f"{strategy} with {params:,} parameters on {world} ranks: the {WHAT[k]} "
                                     f"per rank are wrong: does this stage shard them, and how many bytes "
                                     f"per element?")
    predicted = answers[-1]
    if any(predicted.get(k) != measured[k] for k in ("params", "grads", "optimizer")):
        return Result(False, "measured on 2 DDP ranks after an AdamW step, the bytes differ from the prediction for ddp: "
                             "count what each rank really holds")
    return Result(True, f"every stage on 10 to 7 billion parameters and 2 more drawn now, and DDP's bytes measured on "
                        f"2 ranks ({measured['optimizer']:,} bytes of Adam moments)")
