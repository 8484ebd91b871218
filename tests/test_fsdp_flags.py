"""FSDP2 as it is used, through the trainer: ``--strategy hsdp``, ``--reshard-after-forward`` and
``--strategy fsdp2 --tp N``. Each against DDP (same samples, losses within a stated tolerance), its
mechanism measured beside a control without it, exact resume, resume across strategies and layouts,
and its bad input refused in one line before any rank starts."""

import hashlib
import shutil

import pytest
import torch

from ddpkit import cli, train
from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.parallel import fsdp
from ddpkit.parallel.chunks import fill_from_full
from ddpkit.parallel.fsdp_tensor import shard_chunks
from ddpkit.train import Trainer

pytestmark = pytest.mark.skipif(not fsdp.cpu_supported(), reason="FSDP2 runs on the CPU from torch 2.7")

MLP = dict(dataset_size=512, steps=6, log_every=100, checkpoint_format="dcp")  # the CLI's default widths
GPT = dict(model="gpt", dataset_size=512, steps=6, log_every=100, checkpoint_format="dcp")
LOSS_TOL = 1e-5  # to DDP's, step by step, in the same layout of samples (measured: 0 for hsdp, 2.4e-7 for fsdp2 --tp 2)
CROSS_TOL = 1e-4  # a resume under another strategy: its reductions add in another order from then on


def run(world: int, **changes) -> dict:
    return launch(train.run, TrainConfig(world_size=world, **changes), world_size=world, output="none")[0]


def run_cli(tmp_path, *args: str) -> dict:
    """``ddpkit train`` in this process (its ranks are spawned as ever), with MLP's or GPT's settings above."""
    import json

    path = tmp_path / "summary.json"
    assert cli.main(["train", "--world-size", "4", "--steps", "6", "--dataset-size", "512", "--log-every", "100",
                     "--summary-json", str(path), *args]) == 0
    return json.loads(path.read_text())


def max_loss_diff(a: dict, b: dict, skip: int = 0) -> float:
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a["losses"], b["losses"][skip:]))


def _one_step(ctx, cfg) -> dict:
    """One training step with every collective logged by phase: forward (from the root's pre-forward on),
    backward (from the root's post-forward until clipping starts) and after; the parameter bytes held
    whole between forward and backward; this rank's shard bytes and the parameters after the step."""
    from ddpkit.models import build_model
    from ddpkit.parallel.collective_log import CollectiveLog
    from ddpkit.parallel.fsdp_depth import _param_bytes

    trainer = Trainer(ctx, cfg)
    trainer.prepare()
    out: dict = {}
    with CollectiveLog() as log:
        def forward_starts(module, args):
            log.phase = "forward"

        def forward_ends(module, args, output):
            out["held_between"] = _param_bytes(trainer.raw_model)["unsharded"]
            log.phase = "backward"

        clip = trainer.strategy.clip_grad_norm_

        def clip_after_backward(*args, **kwargs):
            log.phase = "after"
            return clip(*args, **kwargs)

        trainer.strategy.clip_grad_norm_ = clip_after_backward
        hooks = [trainer.raw_model.register_forward_pre_hook(forward_starts, prepend=True),  # before FSDP2's gathers
                 trainer.raw_model.register_forward_hook(forward_ends)]
        trainer.run_step()
        for hook in hooks:
            hook.remove()
    out["counts"] = {f"{r['phase']}:{r['op']}:{r['group_size']}": 0 for r in log.records}
    for r in log.records:
        out["counts"][f"{r['phase']}:{r['op']}:{r['group_size']}"] += 1
    out["sharded_bytes"] = _param_bytes(trainer.raw_model)["sharded"]
    model_state, _ = trainer.strategy.state_dicts(trainer.model, trainer.optimizer, rank0_only=False)
    digest = hashlib.sha256()
    for name in sorted(model_state):
        digest.update(model_state[name].detach().cpu().numpy().tobytes())
    out["params"] = digest.hexdigest()
    blocks = build_model(cfg).blocks.parameters() if cfg.model == "gpt" else []
    out["block_bytes"] = sum(p.numel() * p.element_size() for p in blocks)  # whole, unsharded
    trainer.close()
    return out


# --------------------------------------------------------------------------- --reshard-after-forward

@pytest.fixture(scope="module")
def one_step():
    gpt = TrainConfig(world_size=2, strategy="fsdp2", **GPT)
    mlp = TrainConfig(world_size=4, **MLP)
    return {"zero3": launch(_one_step, gpt.replace(reshard_after_forward=True), world_size=2, output="none")[0],
            "zero2": launch(_one_step, gpt.replace(reshard_after_forward=False), world_size=2, output="none")[0],
            "hsdp": launch(_one_step, mlp.replace(strategy="hsdp", replicate=2, shard=2), world_size=4, output="none")[0],
            "fsdp2": launch(_one_step, mlp.replace(strategy="fsdp2"), world_size=4, output="none")[0]}


def test_no_reshard_after_forward_keeps_the_blocks_whole_until_backward_and_gathers_nothing_there(one_step):
    zero3, zero2 = one_step["zero3"], one_step["zero2"]
    blocks = TrainConfig(**GPT).n_layers
    # ZeRO-3: every block gathered again in backward (the root is never resharded after forward)
    assert zero3["counts"].get("backward:all_gather:2", 0) == blocks
    assert zero2["counts"].get("backward:all_gather:2", 0) == 0  # ZeRO-2: nothing to gather again
    assert zero2["counts"]["forward:all_gather:2"] == zero3["counts"]["forward:all_gather:2"] == blocks + 1
    # between forward and backward ZeRO-2 holds every block's whole parameters on top of the root's
    assert zero2["held_between"] - zero3["held_between"] == zero2["block_bytes"] > 0
    assert zero2["params"] == zero3["params"]  # when parameters are gathered changes, not the numbers


# --------------------------------------------------------------------------- --strategy hsdp

@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hsdp")
    hsdp = dict(strategy="hsdp", replicate=2, shard=2, **MLP)
    out = {"ddp": run(4, **MLP),  # and the flags through the CLI:
           "whole": run_cli(folder, "--strategy", "hsdp", "--replicate", "2", "--shard", "2", "--no-reshard-after-forward")}
    run(4, checkpoint_dir=str(folder / "a"), checkpoint_every=3, **{**hsdp, "steps": 3})
    shutil.copytree(folder / "a", folder / "b")
    out["resumed"] = run(4, checkpoint_dir=str(folder / "a"), resume=True, **hsdp)
    # the same global batch (8 x 4) on 2 ranks under plain fsdp2
    out["as_fsdp2"] = run(2, strategy="fsdp2", checkpoint_dir=str(folder / "b"), resume=True,
                          **{**MLP, "micro_batch_size": 16})
    return out


def test_hsdp_sees_ddps_samples_and_losses(hsdp_runs):
    ddp, whole = hsdp_runs["ddp"], hsdp_runs["whole"]
    assert whole["data_sha256"] == ddp["data_sha256"]
    assert max_loss_diff(whole, ddp) <= LOSS_TOL
    assert whole["sharding"]["mesh"] == {"replicate": 2, "shard": 2}
    assert whole["sharding"]["placements"] == ["Replicate()", "Shard(dim=0)"]
    assert whole["sharding"]["reshard_after_forward"] is False and whole["checkpoint_format"] == "dcp"  # the CLI's


def test_hsdp_shards_within_a_group_and_all_reduces_across_groups(one_step):
    hsdp, flat = one_step["hsdp"], one_step["fsdp2"]
    assert hsdp["sharded_bytes"] == 2 * flat["sharded_bytes"]  # a shard of 1/2 of each parameter, not 1/4
    assert hsdp["counts"].get("forward:all_gather:2", 0) > 0 and "forward:all_gather:4" not in hsdp["counts"]
    assert hsdp["counts"].get("backward:reduce_scatter:2", 0) > 0
    assert hsdp["counts"].get("backward:all_reduce:2", 0) == hsdp["counts"]["backward:reduce_scatter:2"]  # across replicas
    # the control, one flat shard group of 4: gathers over all 4, no all-reduce of gradients at all
    assert flat["counts"].get("forward:all_gather:4", 0) > 0
    assert not any(k.startswith("backward:all_reduce") for k in flat["counts"])


def test_hsdp_resumes_exactly_and_as_fsdp2_on_another_world(hsdp_runs):
    whole, resumed, other = hsdp_runs["whole"], hsdp_runs["resumed"], hsdp_runs["as_fsdp2"]
    assert resumed["resumed_from_step"] == 3
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["optimizer_sha256"] == whole["optimizer_sha256"]
    assert resumed["data_sha256"] == whole["data_sha256"]
    assert other["resumed_from_step"] == 3 and other["world_size"] == 2
    assert other["data_sha256"] == whole["data_sha256"]
    assert max_loss_diff(other, whole, skip=3) <= CROSS_TOL


# --------------------------------------------------------------------------- --strategy fsdp2 --tp N

@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    two_d = dict(strategy="fsdp2", tp=2, **GPT)
    out = {"ddp": run(2, **GPT),  # and the flags through the CLI:
           "whole": run_cli(folder, "--strategy", "fsdp2", "--tp", "2", "--model", "gpt", "--reshard-after-forward")}
    run(4, checkpoint_dir=str(folder / "a"), checkpoint_every=3, **{**two_d, "steps": 3})
    shutil.copytree(folder / "a", folder / "b")
    # resumed with the blocks kept whole from forward to backward: the numbers must not notice
    out["resumed"] = run(4, checkpoint_dir=str(folder / "a"), resume=True, reshard_after_forward=False, **two_d)
    out["as_ddp"] = run(2, checkpoint_dir=str(folder / "b"), resume=True, **GPT)
    return out


def test_fsdp2_with_tp_sees_ddps_samples_and_losses(tp_runs):
    ddp, whole = tp_runs["ddp"], tp_runs["whole"]
    assert whole["dp"] == 2 and whole["tp"] == 2 and whole["data_sha256"] == ddp["data_sha256"]
    assert max_loss_diff(whole, ddp) <= LOSS_TOL
    assert whole["sharding"]["mesh"] == {"dp": 2} and whole["sharding"]["placements"] == ["Shard(dim=0)"]
    assert whole["sharding"]["reshard_after_forward"] is True and whole["checkpoint_format"] == "dcp"


def test_fsdp2_with_tp_holds_a_dp_share_of_each_tp_slice():
    """What a rank holds: 1/dp of its 1/tp slice of each split matrix, 1/dp of each replicated tensor;
    the control is tp inside DDP (the slices whole on every replica), which holds dp = 2 times as much."""
    from ddpkit.models import build_model

    cfg = TrainConfig(world_size=4, tp=2, **GPT)
    split = {f"blocks.{i}.{n}" for i in range(cfg.n_layers)
             for n in ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight")}
    sizes = {n: p.numel() for n, p in build_model(cfg).named_parameters()}
    slice_bytes = 4 * sum(n // 2 if name in split else n for name, n in sizes.items())  # fp32, tp = 2
    sharded = launch(_held_bytes, cfg.replace(strategy="fsdp2"), world_size=4, output="none")
    replicated = launch(_held_bytes, cfg, world_size=4, output="none")
    assert sum(r for r in replicated) == 4 * slice_bytes  # every rank its whole slice
    assert sum(r for r in sharded) == 2 * slice_bytes  # the two dp ranks of a tp index share one slice
    assert all(r * 2 == slice_bytes for r in sharded)  # every size here divides evenly over dp = 2


def _held_bytes(ctx, cfg) -> int:
    """The parameter bytes this rank holds once the trainer has wrapped the model (no step taken)."""
    trainer = Trainer(ctx, cfg)
    held = trainer.strategy.state_bytes(trainer.model, trainer.optimizer)["params"]
    trainer.close()
    return held


def test_fsdp2_with_tp_resumes_exactly_even_with_other_resharding(tp_runs):
    whole, resumed = tp_runs["whole"], tp_runs["resumed"]
    assert resumed["resumed_from_step"] == 3
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["optimizer_sha256"] == whole["optimizer_sha256"]
    assert resumed["data_sha256"] == whole["data_sha256"]


def test_fsdp2_with_tp_checkpoints_resume_under_ddp_without_tp(tp_runs):
    resumed, whole = tp_runs["as_ddp"], tp_runs["whole"]
    assert resumed["resumed_from_step"] == 3 and resumed["tp"] == 1
    assert resumed["data_sha256"] == whole["data_sha256"]
    assert max_loss_diff(resumed, whole, skip=3) <= CROSS_TOL


def test_a_row_shard_of_a_fused_tp_slice_is_described_where_it_sits_in_the_whole():
    """The q/k/v weight (3 parts of 4 rows) split over tp 2, then its slice's rows over dp 2: every
    (dp, tp) rank's chunks, filled from the whole tensor, are exactly its rows; treating the fused
    weight as one part (blocks=1, the control) puts them in the wrong place."""
    whole = torch.arange(12 * 3, dtype=torch.float32).view(12, 3)
    for blocks, expect_right in ((3, True), (1, False)):
        right = True
        for tp_rank in range(2):
            tp_slice = torch.cat([part.chunk(2, 0)[tp_rank] for part in whole.chunk(3, 0)])  # what tensor.py keeps
            for dp_rank in range(2):
                start = dp_rank * 3
                local = torch.zeros(3, 3)
                fill_from_full({"w": shard_chunks(local, start, (6, 3), 0, 2, tp_rank, blocks)}, {"w": whole})
                right &= torch.equal(local, tp_slice[start:start + 3])
        assert right == expect_right, blocks
    row = torch.zeros(2, 2)  # a row-parallel weight (4 x 4): tp rank 1's columns, dp rank 1's rows
    whole = torch.arange(16, dtype=torch.float32).view(4, 4)
    fill_from_full({"w": shard_chunks(row, 2, (4, 2), 1, 2, 1)}, {"w": whole})
    assert torch.equal(row, whole[2:, 2:])


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, words", [
    (("--strategy", "hsdp", "--world-size", "4", "--replicate", "2", "--shard", "4"), "does not match the world size 4"),
    (("--strategy", "hsdp", "--world-size", "4", "--replicate", "3"), "does not divide the world size 4"),
    (("--strategy", "hsdp", "--world-size", "4", "--tp", "2", "--model", "gpt"), "not hsdp: use --strategy ddp or fsdp2"),
    (("--strategy", "ddp", "--no-reshard-after-forward"), "means nothing with strategy ddp"),
    (("--strategy", "zero1", "--shard", "2"), "use --strategy hsdp"),
    (("--strategy", "fsdp2", "--world-size", "4", "--tp", "3", "--model", "gpt"), "not divisible by tp x pp"),
    (("--strategy", "fsdp2", "--world-size", "4", "--tp", "2"), "use --model gpt"),
    (("--strategy", "hsdp", "--checkpoint-format", "full", "--checkpoint-dir", "ckpt"), "use --checkpoint-format dcp"),
], ids=["hsdp-mismatch", "hsdp-divisor", "hsdp-tp", "reshard-ddp", "shard-zero1", "tp-world", "tp-mlp", "hsdp-full"])
def test_bad_flags_are_refused_in_one_line_before_any_rank_starts(tmp_path, monkeypatch, capsys, args, words):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *args]) == 2
    out = capsys.readouterr()
    assert words in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert "rank" not in out.out and not (tmp_path / "ckpt").exists()


def test_hsdp_fills_in_the_size_left_out():
    from ddpkit.parallel.fsdp_flags import hsdp_mesh

    assert hsdp_mesh(4, 0, 0) == (1, 4) and hsdp_mesh(4, 2, 0) == (2, 2) and hsdp_mesh(8, 0, 2) == (4, 2)
    assert TrainConfig(world_size=4, strategy="hsdp", shard=2).hsdp_mesh == (2, 2)


def test_a_tp_degree_that_does_not_split_the_heads_is_refused():
    with pytest.raises(ValueError, match="must divide the attention heads"):
        TrainConfig(model="gpt", strategy="fsdp2", world_size=8, tp=8, n_heads=4)
