"""Tensor parallelism from scratch against the unsplit model, against DTensor's Colwise/RowwiseParallel,
and through the trainer: the same samples and losses as DDP, resume onto another layout."""

import json

import pytest
import torch
import torch.distributed as dist

from ddpkit import train
from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.models import build_model
from ddpkit.parallel import tensor
from tests.conftest import run_cli

GPT = TrainConfig(model="gpt", n_layers=2)


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_gpt_equals_the_unsplit_model(tp):
    for rank in launch(tensor.check_against_unsplit, GPT, world_size=tp, output="none"):
        assert rank["output_diff"] <= 1e-6 and rank["grad_diff"] <= 1e-6, rank
        # two column/row pairs per block (attention, MLP): 2 all-reduces forward, 2 backward, per block
        assert rank["forward_all_reduces"] == rank["backward_all_reduces"] == 2 * GPT.n_layers
        assert rank["local_params"] < rank["whole_params"]


def test_a_linear_split_by_columns_and_by_rows_equals_the_whole_layer():
    out = launch(tensor.split_linear_demo, 6, 4, world_size=2, output="none")
    for rank, styles in enumerate(out):
        for style, result in styles.items():
            assert result["output_diff"] <= 1e-6 and result["input_grad_diff"] <= 1e-6, (rank, style, result)
        assert styles["column"]["local_shape"] == [3, 4] and styles["row"]["local_shape"] == [6, 2]
        assert styles["column"]["owner"] == [[0.0] * 4] * 3 + [[1.0] * 4] * 3  # rows 0-2 on rank 0
        assert styles["row"]["owner"] == [[0.0, 0.0, 1.0, 1.0]] * 6  # columns 0-1 on rank 0


def test_our_mlp_split_matches_dtensor_colwise_and_rowwise():
    for rank in launch(tensor.check_against_dtensor, GPT, world_size=2, output="none"):
        assert rank["output_diff"] <= 1e-6 and rank["grad_diff"] <= 1e-6 and rank["same_local_shapes"], rank


def _round_trip(ctx, cfg):
    model = tensor.parallelize(build_model(cfg), dist.group.WORLD)
    full = tensor.full_state(model, dict(model.state_dict()))
    whole = build_model(cfg).state_dict()
    back = tensor.local_state(model, full)
    return {"full_equal": all(torch.equal(full[n], whole[n]) for n in whole),
            "back_equal": all(torch.equal(back[n], v) for n, v in model.state_dict().items())}


def test_state_moves_between_the_split_and_the_unsplit_layout_bitwise():
    assert launch(_round_trip, GPT, world_size=2, output="none") == [{"full_equal": True, "back_equal": True}] * 2


def run(world: int, **changes) -> list[dict]:
    return launch(train.run, TrainConfig(world_size=world, **changes), world_size=world, output="none")


TRAIN = dict(model="gpt", dataset_size=512, steps=8, log_every=100)


def test_tp_inside_dp_trains_like_ddp_through_the_cli(tmp_path):
    def summary(name, *args):
        path = tmp_path / f"{name}.json"
        proc = run_cli("train", "--model", "gpt", "--dataset-size", "512", "--steps", "8", "--summary-json", str(path), *args)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(path.read_text())

    ddp = summary("ddp", "--world-size", "2")
    tp = summary("tp", "--world-size", "4", "--tp", "2")
    assert (tp["dp"], tp["tp"], tp["pp"], tp["global_batch_size"]) == (2, 2, 1, ddp["global_batch_size"])
    assert tp["data_sha256"] == ddp["data_sha256"]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(tp["losses"], ddp["losses"])) <= 1e-4
    assert tp["state_bytes_per_rank"]["params"] < ddp["state_bytes_per_rank"]["params"]  # the blocks are split


@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_resume_is_exact_on_the_same_layout_and_continues_on_another(tmp_path, fmt):
    common = dict(checkpoint_format=fmt, **TRAIN)
    whole = run(4, tp=2, **common)[0]
    run(4, tp=2, checkpoint_dir=str(tmp_path / "a"), **{**common, "steps": 4})
    same = run(4, tp=2, checkpoint_dir=str(tmp_path / "a"), resume=True, **common)[0]
    assert same["param_sha256"] == whole["param_sha256"] and same["optimizer_sha256"] == whole["optimizer_sha256"]
    run(4, tp=2, checkpoint_dir=str(tmp_path / "b"), **{**common, "steps": 4})
    moved = run(2, checkpoint_dir=str(tmp_path / "b"), resume=True, **common)[0]  # tp 2 -> data parallel only
    assert moved["tp"] == 1 and moved["data_sha256"] == whole["data_sha256"]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(moved["losses"], whole["losses"][4:])) <= 1e-4


def test_bad_layouts_are_refused_before_any_rank_starts():
    for args, words in [(("--tp", "3", "--world-size", "4", "--model", "gpt"), "multiple of 3"),
                        (("--tp", "3", "--world-size", "3", "--model", "gpt"), "must divide the attention heads"),
                        (("--tp", "2", "--world-size", "2"), "use --model gpt"),
                        (("--tp", "2", "--world-size", "2", "--model", "gpt", "--strategy", "zero1"), "--strategy ddp")]:
        proc = run_cli("train", *args, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
