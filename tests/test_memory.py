"""The memory calculator against bytes measured on real ranks, including FSDP2's dim-0 chunking on a
shape whose dim 0 does not divide by the world size."""

import math

import pytest
import torch

from ddpkit.launch import launch
from ddpkit.parallel import fsdp, memory

NEEDS_FSDP2 = pytest.mark.skipif(not fsdp.cpu_supported(), reason="FSDP2 runs on the CPU from torch 2.7")
UNEVEN = [(3, 1000), (1000, 3)]  # Linear(1000, 3) and Linear(3, 1000), no biases: dim 0 = 3 does not divide by 2


def _fsdp2_local_bytes(ctx) -> dict:
    """fully_shard each of two uneven Linear layers, then the root; this rank's local parameter bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1000, 3, bias=False), torch.nn.Linear(3, 1000, bias=False))
    fully_shard = fsdp.fully_shard_fn()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return {"params": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
            "shapes": [list(p.to_local().shape) for p in model.parameters()]}


@NEEDS_FSDP2
def test_fsdp2_calculator_follows_dim0_chunking_on_uneven_shapes():
    measured = launch(_fsdp2_local_bytes, world_size=2, output="none")
    assert [m["params"] for m in measured] == [14000, 10000]  # rank 0: rows 0-1 of (3, 1000); rank 1: row 2
    params = sum(math.prod(s) for s in UNEVEN)
    for rank, m in enumerate(measured):
        expected = memory.bytes_per_rank(params, "fsdp2", 2, "fp32", param_shapes=UNEVEN, rank=rank)
        assert expected["params"] == m["params"] == expected["grads"]
        # negative control: a flat ceil(numel / N) per tensor, the rule this calculator used to follow, is wrong here
        flat = sum(math.ceil(math.prod(s) / 2) for s in UNEVEN) * 4
        assert flat == 12000 != m["params"]


def test_dim0_chunks_are_torch_chunk():
    for shape in [(3, 1000), (5,), (7, 2), (1, 4), (8, 3)]:
        for world in (2, 3, 4, 5):
            chunks = list(torch.chunk(torch.empty(shape), world, dim=0)) + [torch.empty(0)] * world
            assert [memory.fsdp2_local_numel(shape, world, r) for r in range(world)] == [c.numel() for c in chunks[:world]]
