"""The scaling model held against real ranks: does it predict what a DDP step costs here?

:mod:`ddpkit.parallel.cost` predicts data parallelism's efficiency, ideal step over actual step, from
two numbers: one rank's compute per step and the all-reduce of the gradients on the fitted link. A
curve drawn from a model cannot fail by itself: efficiency falls with N for any positive
communication time. What can fail is the model's prediction of a step that really runs, so
:func:`measure_steps` times, on the same ranks, in alternating rounds (the same load on each kind):

* ``without``: forward + backward of one micro-batch on a DDP replica whose comm hook sends nothing:
  everything a DDP step does but the communication;
* ``ddp``: the same on a DDP replica with PyTorch's default hook, whose backward ends only when the
  last bucket's all-reduce has finished (the reducer waits for it).

:func:`check_prediction` compares the measured efficiency, ``without`` over ``ddp``, with the model's:
``without`` over itself plus the ring all-reduce of each of DDP's buckets on the fitted link. Each kind
is timed by its fastest round (the link is fitted to the fastest calls too): a round that lost the
core to another process for a time slice says nothing about the mechanism. A DDP whose all-reduce is
removed runs at an efficiency near 1, far above the model's, and the check fails
(``tests/test_negative_controls_advanced.py``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddpkit.parallel.cost import AlphaBeta, ring_all_reduce_seconds


def _batch(cfg, rank: int):
    gen = torch.Generator().manual_seed(rank)
    if cfg.model == "gpt":
        tokens = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_len), generator=gen)
        return tokens, tokens
    inputs = torch.randn(cfg.micro_batch_size, cfg.input_width, generator=gen)
    return inputs, torch.randint(0, cfg.num_classes, (cfg.micro_batch_size,), generator=gen)


def _skip_all_reduce(state, bucket):
    """A DDP comm hook that sends nothing: every replica keeps its own gradient (the step without communication)."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _noting(hook, buckets: list[int], noting: list[bool]):
    """``hook``, noting each bucket's bytes while ``noting[0]``."""
    def noted(state, bucket):
        if noting[0]:
            buckets.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return hook(state, bucket)
    return noted


def measure_steps(ctx, cfg, rounds: int = 30, communicate: bool = True) -> dict:
    """Time ``rounds`` rounds of each kind (see the module docstring) on every rank at once (a function
    for ``ddpkit.launch``). Returns this rank's seconds for every round of each kind and the bytes of
    each gradient bucket DDP all-reduced. ``communicate=False`` takes the all-reduce out of the DDP step
    too (the negative control)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from ddpkit.models import build_model, loss_fn

    quiet, real = DistributedDataParallel(build_model(cfg)), DistributedDataParallel(build_model(cfg))
    buckets: list[int] = []  # what DDP hands its hook, one step's worth (both replicas have the same layout)
    noting = [False]
    quiet.register_comm_hook(None, _noting(_skip_all_reduce, buckets, noting))
    real.register_comm_hook(None, allreduce_hook if communicate else _skip_all_reduce)  # PyTorch's default: divide, all-reduce
    inputs, targets = _batch(cfg, ctx.rank)

    def step(model):
        loss_fn(model(inputs), targets).backward()  # DDP: returns once the last bucket's all-reduce is done
        model.zero_grad(set_to_none=True)

    kinds = {"without": lambda: step(quiet), "ddp": lambda: step(real)}  # the same bucket layout, with and without sending
    seconds: dict[str, list[float]] = {name: [] for name in kinds}
    for round_ in range(rounds + 2):  # two warm-up rounds (DDP rebuilds its buckets after the first), not counted
        noting[0] = round_ == 2  # the buckets of one step, as DDP has settled them
        for name, fn in kinds.items():
            dist.barrier()  # every rank starts each timing together: a step waits for the slowest rank anyway
            started = time.perf_counter()
            fn()
            if round_ >= 2:
                seconds[name].append(time.perf_counter() - started)
    return {**seconds, "bucket_bytes": buckets}


def check_prediction(measured: list[dict], link: AlphaBeta, below: float = 0.4, above: float = 0.15) -> dict:
    """The model's efficiency at this world size against the measured one (``measured``: every rank's
    :func:`measure_steps`). A kind's time is its fastest round on the slowest rank. The ideal step is
    the DDP step without its all-reduce; the model adds the ring all-reduce of each of DDP's buckets on
    the fitted ``link``, none of it hidden (the buckets fill at the end of backward, when little compute
    is left to hide them behind). So the model is close to an upper bound: on a machine whose cores all
    compute, gloo's threads take their time from backward and the step can fall well below it (by up to
    0.3 measured here beside a busy process per core), but it cannot rise much above it.
    ``ok``: the measured efficiency lies between the model's minus ``below`` and plus ``above``. A
    link fitted wrong by a factor of a few, or a DDP step without its all-reduce (efficiency near 1,
    the negative control), lands outside."""
    world = len(measured)
    fastest = {kind: max(min(rank[kind]) for rank in measured) for kind in ("without", "ddp")}
    buckets = measured[0]["bucket_bytes"]
    predicted_comm = sum(ring_all_reduce_seconds(link, b, world) for b in buckets)
    predicted = fastest["without"] / (fastest["without"] + predicted_comm)
    actual = fastest["without"] / fastest["ddp"]
    return {"world": world, "bucket_bytes": buckets, "step_without_comm_s": fastest["without"], "ddp_step_s": fastest["ddp"],
            "predicted_comm_s": predicted_comm, "measured_comm_s": fastest["ddp"] - fastest["without"],
            "measured_efficiency": actual, "predicted_efficiency": predicted, "band": [predicted - below, predicted + above],
            "ok": predicted - below <= actual <= predicted + above}
