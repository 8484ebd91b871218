import random

import numpy as np
import pytest
import torch

from ddpkit import runtime


def test_auto_backend_is_gloo_without_gpus():
    assert not torch.cuda.is_available()
    assert runtime.resolve_backend("auto", 2) == "gloo"


@pytest.mark.parametrize("requested, fix", [("nccl", "--backend gloo"), ("mpi", "use one of")])
def test_impossible_backend_is_a_clear_error(requested, fix):
    with pytest.raises(ValueError, match=fix):
        runtime.resolve_backend(requested, 2)


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


def test_threads_per_rank_never_oversubscribes(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(runtime.os.sched_getaffinity(0))
    for ranks in (1, 2, 4, 64):
        assert runtime.threads_per_rank(ranks) * min(ranks, cores) <= max(cores, ranks)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert runtime.threads_per_rank(2) == 3  # the user's explicit choice wins


def test_seed_everything_reproduces_every_generator():
    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(1))
    runtime.seed_everything(5)
    first = draw()
    runtime.seed_everything(5)
    assert draw() == first
    runtime.seed_everything(6)
    assert draw() != first
