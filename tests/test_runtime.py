import random

import numpy as np
import pytest
import torch

import torch.distributed as dist

from ddpkit import runtime
from ddpkit.launch import launch
from ddpkit.parallel.dims import ParallelDims


def test_auto_backend_is_gloo_without_gpus():
    assert not torch.cuda.is_available()
    assert runtime.resolve_backend("auto", 2) == "gloo"


@pytest.mark.parametrize("requested, fix", [("nccl", "--backend gloo"), ("mpi", "use one of")])
def test_impossible_backend_is_a_clear_error(requested, fix):
    with pytest.raises(ValueError, match=fix):
        runtime.resolve_backend(requested, 2)


def test_parallel_dims_lay_ranks_out_like_a_device_mesh():
    dims = ParallelDims.from_world(8, tp=2, pp=2)
    assert (dims.dp, dims.tp, dims.pp, dims.world_size) == (2, 2, 2, 8)
    assert [tuple(dims.coords(r).values()) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    with pytest.raises(ValueError, match="not divisible by tp x pp"):
        ParallelDims.from_world(6, tp=4)


def layout(ctx, tp):
    ctx = ctx.with_dims(ParallelDims.from_world(ctx.world_size, tp=tp))
    ids = torch.tensor([float(ctx.dp_rank)])
    dist.all_reduce(ids, group=ctx.dp_group)  # sums the dp indices of my data-parallel peers only
    return {"dp_rank": ctx.dp_rank, "dp_size": ctx.dp_size, "mesh": ctx.mesh.get_coordinate(), "dp_sum": ids.item(),
            "dp_group_size": dist.get_world_size(ctx.dp_group)}


def test_the_data_parallel_group_is_the_dp_axis_of_the_mesh():
    out = launch(layout, 2, world_size=4, output="none")
    assert [r["dp_rank"] for r in out] == [0, 0, 1, 1]  # tensor-parallel peers share a data-parallel index
    assert [tuple(r["mesh"]) for r in out] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert all(r["dp_size"] == r["dp_group_size"] == 2 and r["dp_sum"] == 1.0 for r in out)


def test_context_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ctx = runtime.RankContext.from_env()
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size) == (3, 1, 4, 2)
    assert ctx.backend == "gloo" and ctx.device == torch.device("cpu") and not ctx.is_main
    assert runtime.under_torchrun()


def test_context_without_environment_says_what_to_do(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun or ddpkit.launch"):
        runtime.RankContext.from_env()


def test_one_thread_per_rank_unless_the_user_says_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert runtime.threads_per_rank() == runtime.threads_per_rank(forked=True) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert runtime.threads_per_rank() == 3  # the user's explicit choice wins
    assert runtime.threads_per_rank(forked=True) == 1  # except in a forked rank (GNU OpenMP and fork)
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert runtime.threads_per_rank() == 1


def test_seed_everything_reproduces_every_generator():
    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(1))
    runtime.seed_everything(5)
    first = draw()
    runtime.seed_everything(5)
    assert draw() == first
    runtime.seed_everything(6)
    assert draw() != first


def test_the_workers_of_one_torchrun_round_agree_on_their_store_keys():
    # two nodes after a worker failure: the failing node's agent counted the restart, the other did not
    failed_node = {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1"}
    healthy_node = {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert runtime.attempt_prefix(failed_node) == runtime.attempt_prefix(healthy_node)
    # one node: every worker has the same count, and each restart gets keys of its own; also the control:
    # the same two counts under the one-node rule would part the two nodes' workers
    first, second = ({"GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": n} for n in ("0", "1"))
    assert runtime.attempt_prefix(first) != runtime.attempt_prefix(second)
