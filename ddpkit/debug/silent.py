"""Bugs that never crash: the loss still falls, and only a check the kit provides notices.

Each function here runs on real ranks and returns what a check needs; the checks themselves are the
kit's: :func:`ddpkit.data.check_partition` (every sample on exactly one rank), the data fingerprint
:func:`ddpkit.metrics.extend_data_sha256` (the global sample ids of each step, folded into one hash),
and :func:`ddpkit.metrics.state_sha256` (the bytes of every tensor), compared across ranks.

* **Ranks fed the same samples**: a sampler that is not distributed hands every rank the whole
  dataset; data parallelism then averages N copies of the same gradient. The partition check finds
  every sample N times.
* **A forgotten ``set_epoch``**: ``DistributedSampler`` shuffles with ``seed + epoch``, and the epoch is
  whatever ``set_epoch`` last set (0 if never): every epoch replays epoch 0's order. The epochs' data
  fingerprints are then equal.
* **Dropout in a replicated region of tensor parallelism**: after the row-parallel all-reduce, every
  tensor-parallel rank holds the same activation, and must drop the same elements. A generator seeded
  per rank (right for initialising each rank's own shard of weights) drops different ones, and the
  replicas stop being replicas. Megatron-LM keeps two generators for this reason: one seeded the same
  on every tensor-parallel rank, for dropout outside the model-parallel regions, and one seeded per
  rank, for dropout inside them (``model_parallel_cuda_manual_seed`` in
  ``megatron/core/tensor_parallel/random.py``). Hashes of the activation differ.
* **Parameters that drift apart**: a norm (or a sum) is blind to a permutation: swap two elements on
  one rank and every rank reports the same norm. Hashes of the bytes differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DistributedSampler, RandomSampler

from ddpkit import metrics

SAMPLERS = ("distributed", "no set_epoch", "not distributed")


def sampler_epochs(ctx, kind: str, dataset_len: int, epochs: int, seed: int = 0) -> list[list[int]]:
    """The sample ids this rank's sampler yields in each epoch, for one way of (mis)using samplers."""
    data = range(dataset_len)
    if kind == "not distributed":  # every rank builds the same seeded shuffle of the whole dataset
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(seed))
    elif kind in ("distributed", "no set_epoch"):
        sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed)
    else:
        raise ValueError(f"kind must be one of {', '.join(SAMPLERS)}, got {kind!r}")
    out = []
    for epoch in range(epochs):
        if kind == "distributed":
            sampler.set_epoch(epoch)
        elif kind == "not distributed":
            sampler.generator.manual_seed(seed + epoch)  # a fresh shuffle each epoch, the same on every rank
        out.append(list(sampler))
    return out


def epoch_fingerprints(per_rank: list[list[list[int]]], batch_per_rank: int) -> list[str]:
    """One data fingerprint per epoch: each step's global sample ids folded with ``extend_data_sha256``."""
    prints = []
    for epoch in range(len(per_rank[0])):
        digest = metrics.DATA_SHA256_START
        steps = min(len(rank[epoch]) for rank in per_rank) // batch_per_rank
        for step in range(steps):
            ids = [i for rank in per_rank for i in rank[epoch][step * batch_per_rank:(step + 1) * batch_per_rank]]
            digest = metrics.extend_data_sha256(digest, ids)
        prints.append(digest)
    return prints


def replicated_dropout(ctx, seeding: str, seed: int = 0, width: int = 64) -> dict:
    """Dropout on an activation every tensor-parallel rank holds (as after a row-parallel all-reduce).

    ``seeding`` is ``shared`` (one seed for the replicated region, the fix) or ``per rank`` (the
    generator seeded with ``seed + rank``, as for the rank's own weight shard: the bug). Returns this
    rank's hash of the result and the hashes of every rank, gathered.
    """
    if seeding not in ("shared", "per rank"):
        raise ValueError(f"seeding must be 'shared' or 'per rank', got {seeding!r}")
    activation = torch.ones(width, width)  # identical on every rank
    gen = torch.Generator().manual_seed(seed if seeding == "shared" else seed + ctx.rank)
    keep = (torch.rand(width, width, generator=gen) >= 0.5).float()
    out = activation * keep / 0.5  # inverted dropout, p = 0.5
    return {"hashes": gathered_hashes(ctx, {"out": out}), "kept": float(keep.mean())}


def drifted_replica(ctx, drift: str, seed: int = 0) -> dict:
    """A replica's weights after a bug on rank 1: ``none``, ``swap`` (two elements exchanged: every norm
    and sum unchanged) or ``ulp`` (one element one unit in the last place higher). Returns the norm
    every rank sees and the hashes of every rank's weights, gathered."""
    if drift not in ("none", "swap", "ulp"):
        raise ValueError(f"drift must be none, swap or ulp, got {drift!r}")
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        w = model[0].weight
        if ctx.rank == 1 and drift == "swap":
            w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()
        elif ctx.rank == 1 and drift == "ulp":
            w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))
    state = model.state_dict()
    return {"norm": metrics.state_l2(state), "hashes": gathered_hashes(ctx, state)}


def gathered_hashes(ctx, state: dict[str, torch.Tensor]) -> list[str]:
    """Every rank's ``state_sha256`` of ``state``, gathered on every rank (a collective on the world group)."""
    hashes: list[str] = [""] * ctx.world_size
    dist.all_gather_object(hashes, metrics.state_sha256(state), group=ctx.world_group)
    return hashes
