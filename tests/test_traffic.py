"""The Flight Recorder as one collective counter for every engine, on real gloo ranks: what a window counts,
what it leaves out (before it, the comparison's own loss all-reduce), DDP's C++ all-reduce, and a ring too
small for the window refused rather than undercounted."""

from __future__ import annotations

import pytest

from ddpkit.launch import launch


def _window(ctx):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddpkit.engines import traffic
    from ddpkit.step import global_loss_sum

    model = DistributedDataParallel(torch.nn.Linear(4, 1))  # its start-up broadcast: before the window
    early = traffic.last_record_id()
    dist.all_reduce(torch.ones(3))  # before the window too
    start = traffic.last_record_id()
    dist.all_reduce(torch.ones(5))
    dist.all_reduce(torch.ones(5))
    dist.broadcast(torch.ones(2, 3), src=0)
    dist.all_gather_into_tensor(torch.empty(2 * ctx.world_size), torch.ones(2))
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * ctx.world_size))
    global_loss_sum(ctx, 1.0)  # the comparison's own bookkeeping
    model(torch.ones(2, 4)).sum().backward()  # DDP's reducer: one bucket of 4 + 1 gradients
    return {"counted": traffic.per_step(traffic.since(start), 1), "from_early": traffic.per_step(traffic.since(early), 1),
            "raw": traffic.since(start)}


@pytest.fixture(scope="module")
def window():
    return launch(_window, world_size=2, output="none", backend="gloo")[0]


def test_a_window_counts_each_kind_of_collective_and_who_issued_it(window):
    counted = window["counted"]
    assert {k: (v["calls"], v["numel"]) for k, v in counted.items()} == {
        "all_reduce": (3, 15), "broadcast": (1, 6), "all_gather": (1, 2), "reduce_scatter": (1, 4)}
    assert "C++ (DDP's reducer, in backward)" in counted["all_reduce"]["issuers"]
    assert counted["reduce_scatter"]["gloo"] == ["all_reduce"], "gloo runs a reduce-scatter as an all-reduce"


def test_what_the_window_leaves_out_is_seen_without_it(window):
    # negative controls: the same ring read from an earlier start counts the earlier all-reduce, and the
    # loss all-reduce is there, only marked as bookkeeping
    assert window["from_early"]["all_reduce"]["calls"] == window["counted"]["all_reduce"]["calls"] + 1
    bookkeeping = [e for e in window["raw"] if e["bookkeeping"]]
    assert len(bookkeeping) == 1 and bookkeeping[0]["op"] == "all_reduce" and "global_loss_sum" in bookkeeping[0]["issuer"]


def _overflow(ctx):
    import torch
    import torch.distributed as dist

    from ddpkit.engines import traffic

    start = traffic.last_record_id()
    for _ in range(6):
        dist.all_reduce(torch.ones(1))
    try:
        traffic.since(start)
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_a_ring_too_small_for_the_window_is_refused(monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "4")  # the ranks' ring keeps 4 entries
    # spawned: a rank forked from a process whose recorder already started keeps that recorder's size
    message = launch(_overflow, world_size=2, output="none", backend="gloo", start_method="spawn")[0]
    assert "dropped entries" in message and "TORCH_FR_BUFFER_SIZE" in message, message
