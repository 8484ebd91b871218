"""Negative controls for the mechanism checks of notebooks 09-16 that no other test covers: remove the
mechanism, run the notebook's own check, and watch it fail."""

import torch

from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.parallel import comm, memory, tensor


def _tp_without_f(ctx, cfg):
    """Notebook 12's check with Megatron's f broken: its backward no longer all-reduces the input gradient."""
    tensor.CopyToTP.backward = staticmethod(lambda c, grad: (grad.clone(), None))
    return tensor.check_against_unsplit(ctx, cfg)


def test_without_fs_all_reduce_the_split_gpt_no_longer_matches_the_whole_one():
    gpt = TrainConfig(model="gpt", steps=1)
    broken = launch(_tp_without_f, gpt, world_size=2, output="none")
    assert max(c["grad_diff"] for c in broken) > 1e-6  # the notebook's `grad_diff <= 1e-6` fails
    assert max(c["output_diff"] for c in broken) <= 1e-6  # forward is untouched: only backward needed f


def _ring_wrong_direction(ctx, sizes):
    """Notebook 09's bitwise check with the ring running the other way round: the same sum, in another order."""
    original = comm.chunk_bounds
    comm.chunk_bounds = lambda numel, world: original(numel, world)[::-1]
    return comm.check_ring(ctx, sizes)


def test_a_ring_that_adds_in_another_order_is_not_bitwise_gloo():
    rows = launch(_ring_wrong_direction, [100_003], world_size=3, output="none")
    assert not all(r[0]["bitwise"] for r in rows)  # the notebook's `bitwise_equal` check fails
    assert max(r[0]["max_diff"] for r in rows) < 1e-2  # ... while the values are still the sum, up to rounding


def test_the_fsdp2_check_fails_for_a_flat_calculator():
    """Notebook 10's `worst < 0.05` (calculator vs FSDP2's measured bytes) with the flat ceil(P/N) rule the
    calculator used to follow, on shapes whose dim 0 does not divide by N: off by far more than 5%."""
    shapes = [(3, 1000), (1000, 3)]
    params = sum(a * b for a, b in shapes)
    chunked = [memory.bytes_per_rank(params, "fsdp2", 2, "fp32", param_shapes=shapes, rank=r)["params"] for r in (0, 1)]
    flat = [4 * sum(-(-a * b // 2) for a, b in shapes)] * 2
    assert chunked == [14000, 10000] and max(abs(f / c - 1) for f, c in zip(flat, chunked)) > 0.05
    assert torch.chunk(torch.empty(3), 2)[1].numel() == 1  # torch.chunk: ceil-sized chunks, the last one short


def test_without_the_second_all_gather_fsdp2_moves_no_more_than_ddp():
    """Negative control for notebook 10's "FSDP2 moves about 1.5x DDP's bytes": keep the gathered
    parameters from forward to backward (reshard_after_forward=False) and the ratio falls to about 1."""
    from ddpkit.parallel import cost, fsdp

    if not fsdp.cpu_supported():
        return
    gpt = TrainConfig(model="gpt", world_size=2)
    ddp = launch(cost.collective_bytes, gpt, "ddp", world_size=2, output="none")[0]["moved_per_step"]
    kept = launch(cost.collective_bytes, gpt, "fsdp2", 2, False, world_size=2, output="none")[0]["moved_per_step"]
    assert not 1.25 < kept / ddp < 1.6 and kept / ddp < 1.1


def _timeline(tmp_path, step_times):
    """A rank-0 metrics log whose steps end after the given durations."""
    import json

    t, lines = 1000.0, [{"event": "started", "rank": 0, "step": 0, "time": 1000.0}]
    for step, seconds in enumerate(step_times, 1):
        t += seconds
        lines.append({"event": "step", "rank": 0, "step": step, "time": t})
    (tmp_path / "rank-00000.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(tmp_path)


def test_time_based_saving_wins_only_when_step_times_are_uneven(tmp_path):
    """Notebook 14's cadence check on one timeline, and its negative control: with even step times (no
    straggler) saving every S seconds no longer bounds the worst loss better than every 10 steps."""
    from ddpkit import recovery

    (tmp_path / "uneven").mkdir(); (tmp_path / "even").mkdir()
    uneven = recovery.cadences_on_one_timeline(_timeline(tmp_path / "uneven", [0.02] * 20 + [0.1] * 40), 10, split_step=20)
    assert abs(uneven["slowdown"] - 5.0) < 1e-6 and uneven["seconds"]["worst_lost_s"] < uneven["steps"]["worst_lost_s"]
    even = recovery.cadences_on_one_timeline(_timeline(tmp_path / "even", [0.07] * 60), 10)
    assert not even["seconds"]["worst_lost_s"] < even["steps"]["worst_lost_s"]
