"""Check for notebook 11's exercise: load a checkpoint sharded over N ranks onto M ranks.

The contract: ``load_shard(files, rank, world, numel) -> tensor``: ``files`` are the paths of the shards
that N ranks wrote (rank r's flat shard of a ``numel``-long vector, ceil(numel/N) long, the last padded
with zeros), in rank order; return this rank's shard for a world of ``world`` ranks (ceil(numel/world)
long, the last padded with zeros). The check writes the shards from 4 real ranks, loads them on 2 and on
3, and compares the reassembled vector with the original.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch

from ddpkit.exercises import Result, graded, run_on_ranks

NUMEL = 1_001


def _original() -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) * 0.5 - 7


def _write(ctx, root: str) -> str:
    shard = math.ceil(NUMEL / ctx.world_size)
    padded = torch.zeros(shard * ctx.world_size)
    padded[:NUMEL] = _original()
    path = os.path.join(root, f"shard-{ctx.rank}-of-{ctx.world_size}.pt")
    torch.save(padded[ctx.rank * shard:(ctx.rank + 1) * shard].clone(), path)
    return path


def _read(ctx, fn, files: list[str]) -> torch.Tensor:
    return torch.as_tensor(fn(files, ctx.rank, ctx.world_size, NUMEL)).detach().clone()


@graded("11_load_shard", "load_shard")
def check_load_shard(fn) -> Result:
    with tempfile.TemporaryDirectory(prefix="ddpkit-check-reshard-") as root:
        files = run_on_ranks("load_shard", _write, root, world_size=4)
        if isinstance(files, Result):
            return files
        for world in (2, 3):
            shards = run_on_ranks(getattr(fn, "__name__", "load_shard"), _read, fn, files, world_size=world)
            if isinstance(shards, Result):
                return shards
            want = math.ceil(NUMEL / world)
            for rank, shard in enumerate(shards):
                if shard.numel() != want:
                    return Result(False, f"on {world} ranks, rank {rank}'s shard has {shard.numel()} elements, not "
                                         f"ceil({NUMEL}/{world}) = {want}: pad the last shard with zeros")
            whole = torch.cat(shards)
            if not torch.equal(whole[:NUMEL], _original()):
                first = int((whole[:NUMEL] != _original()).nonzero()[0])
                return Result(False, f"saved on 4 ranks, loaded on {world}: element {first} is {float(whole[first]):g}, not "
                                     f"{float(_original()[first]):g}: concatenate the old shards, drop their padding, then "
                                     f"cut the new ones")
            if whole[NUMEL:].abs().sum() != 0:
                return Result(False, f"on {world} ranks the padding past element {NUMEL} is not zero: the old padding leaked in")
    return Result(True, f"saved as 4 shards, loaded exactly on 2 and on 3 ranks ({NUMEL} elements, padding included)")
