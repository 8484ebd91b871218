"""FSDP2 in depth on real gloo ranks: ZeRO-3 vs ZeRO-2 gathers and bytes, mixed-precision dtypes, HSDP vs DDP,
prefetch's memory and the overlap it buys (from profiler traces)."""

import pytest
import torch

from ddpkit.errors import UserError
from ddpkit.launch import launch
from ddpkit.parallel import fsdp, fsdp_depth, fsdp_prefetch

NEEDS_FSDP2 = pytest.mark.skipif(not fsdp.cpu_supported(), reason="FSDP2 runs on the CPU from torch 2.7")


def _two_ranks(ctx):
    return {"zero3": fsdp_depth.run_fsdp(ctx, reshard_after_forward=True),
            "zero2": fsdp_depth.run_fsdp(ctx, reshard_after_forward=False),
            "bf16": fsdp_depth.run_fsdp(ctx, mixed_precision=True),
            "offload": fsdp_depth.run_fsdp(ctx, offload=True),
            "ddp": fsdp_depth.run_ddp(ctx)}


def _four_ranks(ctx):
    return {"hsdp": fsdp_depth.run_fsdp(ctx, mesh="hsdp"), "shard_only": fsdp_depth.run_fsdp(ctx, mesh="shard-only"),
            "ddp": fsdp_depth.run_ddp(ctx), "flat": fsdp_depth.run_fsdp(ctx, steps=1)}


@pytest.fixture(scope="module")
def two():
    return launch(_two_ranks, world_size=2, output="none", backend="gloo")


@NEEDS_FSDP2
def test_reshard_after_forward_gathers_again_in_backward_and_holds_only_shards(two):
    z3, z2 = two[0]["zero3"], two[0]["zero2"]
    units = z3["units"]
    assert z3["per_step"]["forward_all_gather"] == z2["per_step"]["forward_all_gather"] == units
    assert z3["per_step"]["backward_all_gather"] == units
    # negative control: without resharding after forward, the backward all-gathers vanish
    assert z2["per_step"]["backward_all_gather"] == 0
    assert z3["per_step"]["backward_reduce_scatter"] == z2["per_step"]["backward_reduce_scatter"] == units
    expected = fsdp_depth.calculator_bytes(z3["param_sizes"], world=2)
    assert z3["held_between"] == expected["zero3"]
    assert z2["held_between"] == expected["zero3"] + expected["zero2"]  # shards kept + whole parameters
    for run in (z3, z2):  # after backward FSDP2 reshards either way
        assert all(h["after_step"] == {"sharded": expected["zero3"], "unsharded": 0} for h in run["held"])
    assert z3["losses"] == z2["losses"]  # the same arithmetic, only the memory schedule differs


@NEEDS_FSDP2
def test_fsdp2_matches_ddp(two):
    for rank in two:
        assert max(abs(a - b) for a, b in zip(rank["zero3"]["losses"], rank["ddp"]["losses"])) < 1e-5


@NEEDS_FSDP2
def test_mixed_precision_gathers_bf16_and_reduces_fp32(two):
    bf16, fp32 = two[0]["bf16"], two[0]["zero3"]
    assert bf16["dtypes"]["all_gather"] == ["bfloat16"] and bf16["dtypes"]["reduce_scatter"] == ["float32"]
    assert bf16["forward_dtype"] == "bfloat16"
    # negative control: without the policy everything travels in fp32, at twice the gather bytes
    assert fp32["dtypes"]["all_gather"] == ["float32"] and fp32["forward_dtype"] == "float32"
    assert 2 * bf16["bytes_per_step"]["all_gather"] == fp32["bytes_per_step"]["all_gather"]
    assert bf16["bytes_per_step"]["reduce_scatter"] == fp32["bytes_per_step"]["reduce_scatter"]
    gap = max(abs(a - b) / abs(b) for a, b in zip(bf16["losses"], fp32["losses"]))
    assert 0 < gap < 1e-2


def test_bf16_loses_an_update_below_half_its_spacing():
    lost = fsdp_depth.lost_update(1.0, 2.0 ** -9, steps=100)
    assert lost["bf16"] == 1.0 and lost["fp32"] == pytest.approx(1.0 + 100 * 2.0 ** -9)
    assert lost["bf16_spacing"] == 2.0 ** -7
    kept = fsdp_depth.lost_update(1.0, 2.0 ** -6, steps=4)  # control: above the spacing, bf16 keeps it
    assert kept["bf16"] == kept["fp32"] == 1.0 + 4 * 2.0 ** -6


@NEEDS_FSDP2
def test_hsdp_places_replicate_shard_and_matches_ddp():
    ranks = launch(_four_ranks, world_size=4, output="none", backend="gloo")
    hsdp, shard_only = ranks[0]["hsdp"], ranks[0]["shard_only"]
    assert hsdp["placements"] == ["R", "S(0)"] and hsdp["mesh"] == "[[0, 1], [2, 3]]"
    units = hsdp["units"]
    assert hsdp["per_step"]["backward_all_reduce"] == units and hsdp["group_sizes"]["all_reduce"] == [2]
    assert hsdp["group_sizes"]["all_gather"] == hsdp["group_sizes"]["reduce_scatter"] == [2]
    for rank in ranks:
        assert max(abs(a - b) for a, b in zip(rank["hsdp"]["losses"], rank["ddp"]["losses"])) < 1e-5
    # state divided by the shard group (2), not the world (4): twice what FSDP over all four holds
    shard_bytes = lambda run: run["held"][0]["before_forward"]["sharded"]
    assert shard_bytes(hsdp) == shard_bytes(shard_only) == 2 * shard_bytes(ranks[0]["flat"]) > 0
    # negative control: the same shard groups without the replicate all-reduce drift away from DDP
    assert shard_only["per_step"]["backward_all_reduce"] == 0
    assert max(abs(a - b) for a, b in zip(shard_only["losses"], ranks[0]["ddp"]["losses"])) > 1e-5


@NEEDS_FSDP2
def test_cpu_offload_trains_the_same_and_says_what_would_leave_a_gpu(two):
    off, on = two[0]["offload"], two[0]["zero3"]
    assert off["losses"] == on["losses"] and off["param_device"] == "cpu"
    moved = fsdp_depth.offload_bytes(off, world=2)
    shard = on["held"][0]["before_forward"]["sharded"]
    assert moved["state_off_device"] == 4 * shard  # fp32 shard + gradient shard + AdamW's two moments
    assert moved["h2d_per_step"] == 2 * shard and moved["d2h_per_step"] == shard  # gathered twice, one gradient


def _tp_fsdp(ctx):
    return {"tp_fsdp": fsdp_depth.run_tp_fsdp(ctx), "ddp_dp2": fsdp_depth.run_ddp(ctx, replica=ctx.rank // 2),
            "ddp_dp4": fsdp_depth.run_ddp(ctx)}


@NEEDS_FSDP2
def test_tensor_parallel_inside_fsdp2_matches_ddp_over_dp():
    ranks = launch(_tp_fsdp, world_size=4, output="none", backend="gloo")
    run = ranks[0]["tp_fsdp"]
    assert run["placements"]["0.weight"].endswith("Shard(dim=0))") and run["placements"]["2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    units = 4
    assert run["fsdp_per_step"] == {"forward_all_gather": units, "forward_reduce_scatter": 0,
                                    "backward_all_gather": units, "backward_reduce_scatter": units}
    counted = run["comm_debug_mode"]  # torch's own counter agrees with the log on FSDP2's collectives
    count = lambda *words: sum(n for op, n in counted.items() if any(w in op for w in words))  # noqa: E731
    assert count("allgather", "all_gather") == 2 * units and count("reduce_scatter") == units
    assert count("allreduce", "all_reduce") == 2 + 1  # two row-parallel outputs; one column-parallel input gradient
    for rank in ranks:
        assert max(abs(a - b) for a, b in zip(rank["tp_fsdp"]["losses"], rank["ddp_dp2"]["losses"])) < 1e-5
    # control: against DDP whose 4 ranks all see different samples, the comparison fails
    assert max(abs(a - b) for a, b in zip(run["losses"], ranks[0]["ddp_dp4"]["losses"])) > 1e-5


def test_a_2d_mesh_needs_an_even_world_of_four():
    with pytest.raises(ValueError, match="even world of at least 4"):
        fsdp_depth._check_even(2, "HSDP")
    fsdp_depth._check_even(4, "HSDP")  # control: 4 is fine


@pytest.mark.skipif(fsdp.cpu_supported(), reason="this torch runs FSDP2 on the CPU")
def test_old_torch_is_refused_before_ranks_start():
    with pytest.raises(UserError, match="torch >= 2.7"):
        fsdp_depth.check_supported()


def _prefetch(ctx):
    return [fsdp_prefetch.run_prefetch(ctx, prefetch=k) for k in (0, 1, 2)]


@NEEDS_FSDP2
def test_forward_prefetch_gathers_ahead_and_holds_more_units():
    runs = launch(_prefetch, world_size=2, output="none", backend="gloo")[0]
    for run in runs:
        assert run["order"].count("all_gather") == 4 and run["backward_all_gather"] == 4  # the same gathers...
        assert run["max_units_alive"] == 1 + run["prefetch"]  # ...issued earlier: k more units alive at once
        assert run["max_alive_bytes"] == run["max_units_alive"] * run["unit_bytes"]
    assert runs[1]["order"][:3] == ["all_gather", "all_gather", "unit_start0"]
    assert runs[0]["order"][:3] == ["all_gather", "unit_start0", "unit_end0"]  # control: no prefetch, one at a time
    # backward: FSDP2 prefetches one unit by default, so its defaults already hold two; prefetch 2 holds three
    assert [run["max_units_alive_backward"] for run in runs] == [2, 2, 3]
    assert all(run["max_alive_bytes_backward"] == run["max_units_alive_backward"] * run["unit_bytes"] for run in runs)
    assert runs[2]["backward_order"][:4] == ["all_gather"] * 3 + ["reduce_scatter"]
    assert runs[0]["backward_order"][:3] == ["all_gather", "all_gather", "reduce_scatter"]  # control: one ahead, not two


@NEEDS_FSDP2
def test_prefetch_hides_all_gathers_behind_compute_in_a_profiler_trace(tmp_path):
    result = fsdp_prefetch.measure_overlap(str(tmp_path), say=lambda _: None)
    assert result["verdict"] == "above", result["values"]
    control, treated = result["median"]["control"], result["median"]["treated"]
    assert control["all_gather"] < 0.05 < treated["all_gather"]  # a thread blocked in gloo computes nothing
    assert treated["forward_all_gather"] > 0 and treated["backward_all_gather"] > 0  # prefetched both ways
    ranks = result["last"]
    assert all(row[1]["lanes"]["all_gather"] and row[1]["lanes"]["reduce_scatter"] for r in ranks for row in r["pairs"])
    assert (tmp_path / "fsdp_prefetch.trace.json").exists()


@NEEDS_FSDP2
def test_overlap_negative_control_blocking_against_itself_is_never_above(tmp_path):
    result = fsdp_prefetch.measure_overlap(str(tmp_path), modes=("blocking", "blocking"), max_rounds=1, say=lambda _: None)
    assert result["verdict"] == "unclear" and max(abs(v) for v in result["values"]) < 0.05


def test_an_unknown_overlap_mode_is_refused():
    with pytest.raises(ValueError, match="blocking, prefetch"):
        fsdp_prefetch.build("eager", 8, 2)


def test_compute_is_the_training_threads_operators_not_gloos_copies(tmp_path):
    """gloo's worker threads run aten:: copies of their own; counted as compute they would fake an overlap."""
    import json

    from ddpkit.debug import timeline

    events = [{"ph": "X", "name": "c10d::_allgather_base_", "tid": 1, "ts": 0, "dur": 5},  # the training thread issues it
              {"ph": "X", "name": "aten::mm", "tid": 1, "ts": 100, "dur": 50},  # ...computes after the gather
              {"ph": "X", "name": "gloo:all_gather", "tid": 2, "ts": 10, "dur": 80},  # gloo's thread moves the bytes
              {"ph": "X", "name": "aten::copy_", "tid": 2, "ts": 20, "dur": 30},  # ...and copies them
              {"ph": "X", "name": "ddpkit.step 0 0", "tid": 1, "ts": 0, "dur": 160}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events, "baseTimeNanoseconds": 0}))
    spans = timeline.thread_intervals(str(path), ("gloo:all_gather",), marks="ddpkit.")
    assert spans["compute"] == [(100e-6, 150e-6)] and spans["marks"] == [("ddpkit.step 0 0", 0.0, 160e-6)]
    assert timeline.overlapped_fraction(spans["compute"], spans["comm"]["gloo:all_gather"]) == 0.0
    # control: every thread's operators as compute (timeline.intervals without DDP's allreduce_) finds an overlap
    every = timeline.intervals(str(path))
    assert timeline.overlapped_fraction(every["compute"], spans["comm"]["gloo:all_gather"]) > 0.3
    assert timeline.clip([(0.0, 1.0), (2.0, 3.0)], 0.5, 2.5) == [(0.5, 1.0), (2.0, 2.5)]
