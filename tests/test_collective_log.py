"""CollectiveLog on real gloo ranks: what it records, and that it leaves torch.distributed as it found it."""

import torch
import torch.distributed as dist

from ddpkit.launch import launch
from ddpkit.parallel.collective_log import CollectiveLog


def _collectives(ctx):
    group = ctx.world_group
    with CollectiveLog() as log:
        with log.during("forward"):
            out = torch.empty(2 * ctx.world_size, dtype=torch.bfloat16)
            dist.all_gather_into_tensor(out, torch.ones(2, dtype=torch.bfloat16), group=group)
        with log.during("backward"):
            dist.all_reduce(torch.ones(3), group=group)
    dist.all_reduce(torch.ones(1), group=group)  # after the log: not recorded
    return log.records


def test_records_phase_op_dtype_bytes_and_group():
    records = launch(_collectives, world_size=2, output="none", backend="gloo")[0]
    assert records == [
        {"phase": "forward", "op": "all_gather", "dtype": "bfloat16", "numel": 2, "bytes": 4, "group_size": 2},
        {"phase": "backward", "op": "all_reduce", "dtype": "float32", "numel": 3, "bytes": 12, "group_size": 2}]


def test_restores_what_it_wrapped():
    original = dist.all_reduce
    with CollectiveLog() as log:
        assert dist.all_reduce is not original
    assert dist.all_reduce is original and log.records == []
