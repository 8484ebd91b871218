"""Check for the exercise on DDP from scratch: broadcast at construction, gradient hooks, buckets that
all-reduce while backward is still running.

The contract: ``cls(module, bucket_bytes)`` wraps ``module``: at construction every rank takes rank 0's
parameters; ``forward`` is the module's; during ``backward`` gradients are gathered into buckets of about
``bucket_bytes``, each bucket's all-reduce launched (``async_op=True``) as soon as its last gradient is
ready; ``finish()``, called after ``backward`` and before the optimizer step, waits for them and leaves
every gradient averaged over the ranks. The check trains 3 SGD steps on 2 real ranks (each rank
initialised differently, each on its own samples) next to ``torch.nn.parallel.DistributedDataParallel``
on the same samples: the parameters must match, and at least one all-reduce must have been launched
before ``backward`` returned (the overlap that makes DDP fast), with more than one bucket.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

STEPS, LR = 3, 0.1


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(8, 32, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def _on_rank(ctx, cls) -> dict:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    reference = DDP(_model(100))  # torch's, from the weights rank 0 starts with (DDP broadcasts them too)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    model = _model(100 + ctx.rank)  # each rank initialised differently: the wrapper must broadcast
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    wrapped = cls(model, bucket_bytes=size // 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    launches, original = [], c10d.all_reduce

    def recorded(*args, **kwargs):
        launches.append((time.perf_counter(), bool(kwargs.get("async_op", len(args) > 3 and args[3]))))
        return original(*args, **kwargs)

    overlapped = []
    for step in range(STEPS):
        x, y = _batch(step, ctx.rank)
        nn.functional.cross_entropy(reference(x), y).backward()
        reference_opt.step()
        reference_opt.zero_grad()
        launches.clear()
        c10d.all_reduce = dist.all_reduce = recorded
        try:
            nn.functional.cross_entropy(wrapped(x), y).backward()
            backward_done = time.perf_counter()
            wrapped.finish()
        finally:
            c10d.all_reduce = dist.all_reduce = original
        if not launches:
            raise Wrong("no all-reduce ran in a step: launch one per bucket from the gradient hooks")
        overlapped.append({"calls": len(launches), "before_backward_end": sum(t < backward_done for t, _ in launches),
                           "async": all(a for _, a in launches)})
        optimizer.step()
        optimizer.zero_grad()
    diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), reference.module.parameters()))
    return {"diff": diff, "overlap": overlapped}


@graded("05_ddp_from_scratch", "ddp")
def check_ddp(cls) -> Result:
    runs = run_on_ranks(getattr(cls, "__name__", "the DDP wrapper"), _on_rank, cls, world_size=2)
    if isinstance(runs, Result):
        return runs
    for rank, run in enumerate(runs):
        if run["diff"] > 1e-6:
            return Result(False, f"after {STEPS} steps rank {rank}'s parameters differ from torch DDP's by {run['diff']:.2e}: "
                                 f"broadcast rank 0's parameters at construction, and average (not sum) the gradients")
    first = runs[0]["overlap"][-1]
    if first["calls"] < 2:
        return Result(False, f"{first['calls']} all-reduce per step with buckets of a quarter of the model: fill several "
                             f"buckets, in the order gradients arrive (the last layer's first)")
    if not first["async"]:
        return Result(False, "an all-reduce was called without async_op=True: a blocking one stops backward until it is done")
    if first["before_backward_end"] == 0:
        return Result(False, f"all {first['calls']} all-reduces were launched after backward finished: launch each bucket's "
                             f"all-reduce from a gradient hook as soon as its last gradient is ready")
    return Result(True, f"torch DDP's parameters after {STEPS} steps from different initial weights, {first['calls']} buckets, "
                        f"{first['before_backward_end']} all-reduce(s) launched while backward was still running")
