"""Check for the exercise on FSDP-style sharding from scratch: all-gather before use, reduce-scatter after.

The contract: ``cls(module)`` keeps only this rank's flat shard of the module's parameters (ceil(P/N)
elements, rank 0's weights, padded), returned by ``shard_parameters()`` for the optimizer; ``forward``
all-gathers the full parameters into the module and runs it; ``finish()``, called after backward,
reduce-scatters the gradients (averaged over the ranks) into the shard's ``.grad`` and frees the full
parameters and gradients again. The check trains 3 SGD steps on 2 and on 3 real ranks, each rank from
its own initial weights and on its own samples (drawn when it runs; a rank is given only its own), and
compares the full parameters with those of DDP on the same samples, which it computes itself (FSDP2
computes DDP's update too; the suite checks that). It records every collective at the dispatcher
(:class:`ddpkit.exercises.witness.Collectives`): an all-gather in forward, a reduce-scatter in
``finish``, no all-reduce. And it counts what a rank keeps between steps (after ``finish``) the way
:mod:`ddpkit.exercises.holdings` counts it: every tensor alive that was not there before the wrapper was
built, wherever it is kept (not only ``module.parameters()``), less the shard and its gradient; that
must be at most a tenth of the full parameters' bytes, and the shard must be exactly ceil(P/N) elements.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

STEPS, LR = 3, 0.1
GATHERS = frozenset({"allgather", "_allgather_base", "allgather_into_tensor_coalesced", "all_gather_into_tensor"})
SCATTERS = frozenset({"reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor"})
REDUCES = frozenset({"allreduce", "allreduce_coalesced", "all_reduce"})


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 5))  # 731 parameters: not divisible by 2


def _draw(world: int) -> tuple[list[int], list[list]]:
    """Each rank's initial seed and samples for every step, drawn now."""
    import secrets

    gen = torch.Generator().manual_seed(secrets.randbits(62))
    return ([secrets.randbits(31) for _ in range(world)],
            [[(torch.randn(8, 16, generator=gen), torch.randint(0, 5, (8,), generator=gen)) for _ in range(STEPS)]
             for _ in range(world)])


def _reference(seed: int, data: list[list]) -> list[torch.Tensor]:
    """DDP with SGD, as one process: rank 0's weights, each step the mean of the ranks' gradients."""
    model = _model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        for x, y in (batches[step] for batches in data):
            (nn.functional.cross_entropy(model(x), y) / len(data)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _on_rank(ctx, cls, seed: int, batches: list) -> dict:
    from ddpkit.exercises import holdings
    from ddpkit.exercises.witness import Collectives

    before = holdings.baseline([t for batch in batches for t in batch])  # before the model and the learner's code
    module = _model(seed)  # each rank initialised differently: the wrapper starts from rank 0's
    full_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    wrapped = cls(module)
    optimizer = torch.optim.SGD(wrapped.shard_parameters(), lr=LR)
    calls: dict[str, list[str]] = {"forward": [], "finish": []}
    held_after_finish = 0
    for step in range(STEPS):
        x, y = batches[step]
        with Collectives() as forward:
            loss = nn.functional.cross_entropy(wrapped(x), y)
            loss.backward()
        with Collectives() as finish:
            wrapped.finish()
        calls["forward"] += forward.names()
        calls["finish"] += finish.names()
        shards = list(wrapped.shard_parameters())
        if any(p.grad is None for p in shards):
            raise Wrong("after finish() the shard has no gradient: reduce-scatter the gradients into shard.grad")
        if step in (0, STEPS - 1):
            del loss
            held = holdings.held_bytes(before, shards + [p.grad for p in shards])
            held_after_finish = max(held_after_finish, held)
        optimizer.step()
        optimizer.zero_grad()
    wrapped(batches[0][0])  # one more forward gathers the final parameters
    shard_bytes = sum(p.numel() * p.element_size() for p in wrapped.shard_parameters())
    return {"params": [p.detach().clone() for p in module.parameters()], "calls": calls,
            "held_after_finish": held_after_finish, "full_bytes": full_bytes, "shard_bytes": shard_bytes}


@graded("10_fsdp_from_scratch", "fsdp")
def check_fsdp(cls) -> Result:
    for world in (2, 3):
        seeds, data = _draw(world)
        runs = run_on_ranks(getattr(cls, "__name__", "the sharded wrapper"), _on_rank, cls, world_size=world,
                            rank_args=[(seeds[r], data[r]) for r in range(world)])
        if isinstance(runs, Result):
            return runs
        want = _reference(seeds[0], data)
        for run in runs:
            run["diff"] = max((float((p - q).abs().max()) if isinstance(p, torch.Tensor) and p.shape == q.shape
                               else float("inf")) for p, q in zip(run["params"], want)) if len(run["params"]) == len(want) \
                else float("inf")
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
    if REDUCES & set(run["calls"]["finish"] + run["calls"]["forward"]):
        return Result(False, "an all-reduce gives every rank the whole gradient; a reduce-scatter gives each its shard "
                             "for the same traffic")
    if not any(name in SCATTERS for name in run["calls"]["finish"]):
        return Result(False, "no reduce-scatter in finish(): each rank needs only its shard of the averaged gradient")
    if run["held_after_finish"] > 0.1 * run["full_bytes"]:
        return Result(False, f"between steps the wrapper still holds {run['held_after_finish']:,} bytes besides its shard "
                             f"(the model's full parameters are {run['full_bytes']:,}): what is kept after finish()?")
    return None
