"""Check for the exercise on FSDP-style sharding from scratch: all-gather before use, reduce-scatter after.

The contract: ``cls(module)`` keeps only this rank's flat shard of the module's parameters (ceil(P/N)
elements, rank 0's weights, padded), returned by ``shard_parameters()`` for the optimizer; ``forward``
all-gathers the full parameters into the module and runs it; ``finish()``, called after backward,
reduce-scatters the gradients (averaged over the ranks) into the shard's ``.grad`` and frees the full
parameters and gradients again. The check trains 3 SGD steps on 2 real ranks next to DDP on the same
samples (FSDP2 computes DDP's update too; the suite checks that), on 2 and 3 ranks, then compares the
full parameters, and checks what the wrapper holds between steps and which collectives ran (all-gather
in forward, reduce-scatter in ``finish``, no all-reduce). What it holds is measured on everything
reachable from the wrapper, its classes and their module (not only ``module.parameters()``): besides
its shard (exactly ceil(P/N) elements) and the shard's gradient, at most a tenth of the full parameters'
bytes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

STEPS, LR = 3, 0.1
GATHERS = ("all_gather_into_tensor", "all_gather", "_all_gather_base")
SCATTERS = ("reduce_scatter_tensor", "reduce_scatter", "_reduce_scatter_base")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 5))  # 731 parameters: not divisible by 2


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def _on_rank(ctx, cls) -> dict:  # noqa: C901
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    reference = DDP(_model(100))
    reference_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    module = _model(100 + ctx.rank)  # each rank initialised differently: the wrapper starts from rank 0's
    full_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    wrapped = cls(module)
    optimizer = torch.optim.SGD(wrapped.shard_parameters(), lr=LR)
    calls: dict[str, list[str]] = {"forward": [], "finish": []}
    phase = {"now": "forward"}
    originals = {name: getattr(c10d, name) for name in (*GATHERS, *SCATTERS, "all_reduce") if hasattr(c10d, name)}

    def recorder(name):
        def wrapper(*args, **kwargs):
            calls[phase["now"]].append(name)
            return originals[name](*args, **kwargs)
        return wrapper

    held_after_finish = 0
    for step in range(STEPS):
        x, y = _batch(step, ctx.rank)
        nn.functional.cross_entropy(reference(x), y).backward()
        reference_opt.step()
        reference_opt.zero_grad()
        for name in originals:
            setattr(c10d, name, recorder(name))
            setattr(dist, name, recorder(name))
        try:
            phase["now"] = "forward"
            loss = nn.functional.cross_entropy(wrapped(x), y)
            loss.backward()
            phase["now"] = "finish"
            wrapped.finish()
        finally:
            for name, original in originals.items():
                setattr(c10d, name, original)
                setattr(dist, name, original)
        from ddpkit.exercises.sharding import held_bytes, learner_roots

        shard_ids = {id(p) for p in wrapped.shard_parameters()} | {id(p.grad) for p in wrapped.shard_parameters()}
        held_after_finish = max(held_after_finish, held_bytes([wrapped, *learner_roots(cls)], shard_ids))
        if any(p.grad is None for p in wrapped.shard_parameters()):
            raise Wrong("after finish() the shard has no gradient: reduce-scatter the gradients into shard.grad")
        optimizer.step()
        optimizer.zero_grad()
    wrapped(_batch(0, 0)[0])  # one more forward gathers the final parameters
    diff = max(float((p - q).abs().max()) for p, q in zip(module.parameters(), reference.module.parameters()))
    shard_bytes = sum(p.numel() * p.element_size() for p in wrapped.shard_parameters())
    return {"diff": diff, "calls": calls, "held_after_finish": held_after_finish, "full_bytes": full_bytes,
            "shard_bytes": shard_bytes}


@graded("10_fsdp_from_scratch", "fsdp")
def check_fsdp(cls) -> Result:
    for world in (2, 3):
        runs = run_on_ranks(getattr(cls, "__name__", "the sharded wrapper"), _on_rank, cls, world_size=world)
        if isinstance(runs, Result):
            return runs
        wrong = _verdict(runs, world)
        if wrong:
            return wrong
    run = runs[0]
    return Result(True, f"DDP's parameters after {STEPS} steps on 2 and 3 ranks; all-gather in forward, reduce-scatter "
                        f"after backward; {run['shard_bytes']:,} of {run['full_bytes']:,} bytes held between steps")


def _verdict(runs: list[dict], world: int) -> Result | None:
    import math

    run = runs[0]
    want = math.ceil(run["full_bytes"] / 4 / world) * 4
    if any(r["shard_bytes"] != want for r in runs):
        worst = max(runs, key=lambda r: abs(r["shard_bytes"] - want))
        return Result(False, f"on {world} ranks a shard holds {worst['shard_bytes']:,} bytes where ceil(P/N) elements "
                             f"make {want:,}: how long is each rank's slice?")
    if any(r["diff"] > 1e-6 for r in runs):
        worst = max(runs, key=lambda r: r["diff"])
        return Result(False, f"on {world} ranks after {STEPS} steps the parameters differ from DDP's by "
                             f"{worst['diff']:.2e}: the same starting weights? the mean of the gradients?")
    if not any(name in GATHERS for name in run["calls"]["forward"]):
        return Result(False, "no all-gather in forward: the full parameters must be gathered from the shards before use")
    if "all_reduce" in run["calls"]["finish"] or "all_reduce" in run["calls"]["forward"]:
        return Result(False, "an all-reduce gives every rank the whole gradient; a reduce-scatter gives each its shard "
                             "for the same traffic")
    if not any(name in SCATTERS for name in run["calls"]["finish"]):
        return Result(False, "no reduce-scatter in finish(): each rank needs only its shard of the averaged gradient")
    if run["held_after_finish"] > 0.1 * run["full_bytes"]:
        return Result(False, f"between steps the wrapper still holds {run['held_after_finish']:,} bytes besides its shard "
                             f"(the model's full parameters are {run['full_bytes']:,}): what is kept after finish()?")
    return None
