"""Check for notebook 11's exercise: load a checkpoint sharded over N ranks onto M ranks.

The contract: ``load_shard(files, rank, world, numel) -> tensor``: ``files`` are the paths of the shards
that N ranks wrote (rank r's flat shard of a ``numel``-long vector, ceil(numel/N) long, the last padded
with zeros), in rank order; return this rank's shard for a world of ``world`` ranks (ceil(numel/world)
long, the last padded with zeros). The check writes the shards of 4 ranks and loads them on 2 and on 3
real ranks, then writes those of 3 and loads them on 4, and compares each reassembled vector with the
original (so no world size, old or new, can be assumed). The values are drawn when it runs: only the
files hold them.
"""

from __future__ import annotations

import math
import os
import secrets
import tempfile

import torch

from ddpkit.exercises import Result, graded, run_on_ranks

NUMEL = 1_001


def _original() -> torch.Tensor:
    """Values drawn now (integers, so any copy is exact): the only way to them is through the files."""
    gen = torch.Generator().manual_seed(secrets.randbits(62))
    return torch.randint(-10_000, 10_000, (NUMEL,), generator=gen).float()


PLANS = ((4, 2), (4, 3), (3, 4))  # (written by, loaded on)


def _write(root: str, world: int, original: torch.Tensor) -> list[str]:
    """The files ``world`` ranks write (each its own padded slice: the bytes a rank's ``torch.save`` makes)."""
    shard = math.ceil(NUMEL / world)
    padded = torch.zeros(shard * world)
    padded[:NUMEL] = original
    os.makedirs(root, exist_ok=True)
    paths = []
    for rank in range(world):
        paths.append(os.path.join(root, f"shard-{rank}-of-{world}.pt"))
        torch.save(padded[rank * shard:(rank + 1) * shard].clone(), paths[-1])
    return paths


def _read(ctx, fn, files: list[str]) -> torch.Tensor:
    return torch.as_tensor(fn(files, ctx.rank, ctx.world_size, NUMEL)).detach().float().reshape(-1).clone()


@graded("11_load_shard", "load_shard")
def check_load_shard(fn) -> Result:
    original = _original()
    with tempfile.TemporaryDirectory(prefix="ddpkit-check-reshard-") as root:
        for old, world in PLANS:
            files = _write(os.path.join(root, f"{old}-{world}"), old, original)
            shards = run_on_ranks(getattr(fn, "__name__", "load_shard"), _read, fn, files, world_size=world)
            if isinstance(shards, Result):
                return shards
            want = math.ceil(NUMEL / world)
            for rank, shard in enumerate(shards):
                if not isinstance(shard, torch.Tensor) or shard.numel() != want:
                    size = shard.numel() if isinstance(shard, torch.Tensor) else "no"
                    return Result(False, f"on {world} ranks, rank {rank}'s shard has {size} elements, not "
                                         f"ceil({NUMEL}/{world}) = {want}: how long is every new shard, the last one too?")
            whole = torch.cat(shards)
            if not torch.equal(whole[:NUMEL], original):
                first = int((whole[:NUMEL] != original).nonzero()[0])
                return Result(False, f"saved on {old} ranks, loaded on {world}: element {first} of the vector is not "
                                     f"the saved one: where does each old shard's data end, and where does rank "
                                     f"{first // want}'s new shard start?")
            if whole[NUMEL:].abs().sum() != 0:
                return Result(False, f"on {world} ranks the padding past element {NUMEL} is not zero: the old padding leaked in")
    return Result(True, f"saved as 4 shards and loaded exactly on 2 and 3 ranks, saved as 3 and loaded on 4 ({NUMEL} "
                        f"elements, padding included)")
