"""Every strategy through the same trainer: the same data, the same losses as DDP, exact resume, measured
bytes that match the calculator; dcp checkpoints that reshard across world sizes and strategies."""

import io
import os
import pickle

import numpy as np
import pytest

from ddpkit import checkpoint, sharded_checkpoint, train
from ddpkit.checkpoint import CheckpointError
from ddpkit.config import STRATEGIES, TrainConfig
from ddpkit.launch import launch
from ddpkit.parallel import fsdp, memory
from ddpkit.train import Trainer
from tests.conftest import run_cli

# FSDP2 runs on CPU tensors from torch 2.7; before, it is refused (test_fsdp2_is_refused_where_torch_cannot_run_it)
RUNNABLE = [s for s in STRATEGIES if s != "fsdp2" or fsdp.cpu_supported()]
NEEDS_FSDP2 = pytest.mark.skipif(not fsdp.cpu_supported(), reason="FSDP2 runs on the CPU from torch 2.7")
MLP = dict(dataset_size=512, input_width=32, hidden_width=64, steps=8, log_every=100)
GPT = dict(model="gpt", dataset_size=512, steps=8, log_every=100)


def run(world: int, **changes) -> list[dict]:
    return launch(train.run, TrainConfig(world_size=world, **changes), world_size=world, output="none")


def _final_params(ctx, cfg):
    trainer = Trainer(ctx, cfg)
    trainer.fit()
    model_state, _ = trainer.strategy.state_dicts(trainer.model, trainer.optimizer, rank0_only=False)
    return {k: v.numpy().copy() for k, v in model_state.items()}


@pytest.fixture(scope="module")
def mlp_runs():
    return {s: run(2, strategy=s, **MLP) for s in RUNNABLE}


def test_every_strategy_sees_the_same_data_and_losses_as_ddp(mlp_runs):
    ddp = mlp_runs["ddp"][0]
    for name, ranks in mlp_runs.items():
        assert len({r["param_sha256"] for r in ranks}) == 1, f"{name}: ranks disagree on the model"
        s = ranks[0]
        assert s["strategy"] == name and s["data_sha256"] == ddp["data_sha256"]
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(s["losses"], ddp["losses"])) <= 1e-5


@pytest.mark.parametrize("changes", [{}, {"grad_accum": 2, "micro_batch_size": 4}, {"amp": "bf16"}],
                         ids=["plain", "accumulation", "bf16"])
def test_zero1_is_bitwise_ddp_at_two_ranks(changes):
    ddp, zero = (run(2, strategy=s, grad_clip=0.0, **{**MLP, **changes})[0] for s in ("ddp", "zero1"))
    assert zero["param_sha256"] == ddp["param_sha256"]
    assert zero["losses"] == ddp["losses"]


@NEEDS_FSDP2
def test_fsdp2_accumulates_without_syncing_like_ddp():
    changes = {"grad_accum": 2, "micro_batch_size": 4}
    ddp, sharded = (run(2, strategy=s, **{**MLP, **changes})[0] for s in ("ddp", "fsdp2"))
    assert sharded["data_sha256"] == ddp["data_sha256"]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(sharded["losses"], ddp["losses"])) <= 1e-5


def test_zero1_stays_within_1e6_of_ddp_at_four_ranks():
    ddp, zero = (launch(_final_params, TrainConfig(world_size=4, strategy=s, **GPT), world_size=4, output="none")[0]
                 for s in ("ddp", "zero1"))
    # at 4 ranks reduce-scatter and all-reduce may add the four gradients in another order (last bits)
    diff = np.sqrt(sum(((zero[n] - ddp[n]).astype(np.float64) ** 2).sum() for n in ddp))
    norm = np.sqrt(sum((ddp[n].astype(np.float64) ** 2).sum() for n in ddp))
    assert diff / norm <= 1e-6


def test_measured_state_bytes_match_the_calculator(mlp_runs):
    sizes = [32 * 64, 64, 64 * 64, 64, 64 * 8, 8]  # the MLP's tensors, in order
    params = sum(sizes)
    for name, ranks in mlp_runs.items():
        for rank, s in enumerate(ranks):
            measured = s["state_bytes_per_rank"]
            expected = memory.bytes_per_rank(params, name, 2, "fp32", param_sizes=sizes, rank=rank)
            for kind in ("params", "grads", "optimizer"):
                assert measured[kind] == pytest.approx(expected[kind], rel=0.05), (name, rank, kind)
    ddp_optimizer = mlp_runs["ddp"][0]["state_bytes_per_rank"]["optimizer"]
    if "fsdp2" in mlp_runs:
        assert mlp_runs["fsdp2"][0]["state_bytes_per_rank"]["optimizer"] <= ddp_optimizer * (1 / 2 + 0.05)
    zero = mlp_runs["zero1"][0]["state_bytes_per_rank"]["optimizer"]
    assert zero == 12 * -(-params // 2)  # master + two moments of ceil(P/N) parameters: seed 004's 12 bytes


@pytest.mark.parametrize("strategy", [pytest.param(s, marks=NEEDS_FSDP2) if s == "fsdp2" else s for s in STRATEGIES])
def test_dcp_resume_is_exact_for_every_strategy(tmp_path, strategy):
    common = dict(strategy=strategy, checkpoint_format="dcp", **{**MLP, "steps": 6})
    whole = run(2, **common)[0]
    run(2, checkpoint_dir=str(tmp_path), checkpoint_every=3, **{**common, "steps": 3})
    resumed = run(2, checkpoint_dir=str(tmp_path), resume=True, **common)[0]
    assert resumed["resumed_from_step"] == 3
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["optimizer_sha256"] == whole["optimizer_sha256"]
    assert resumed["data_sha256"] == whole["data_sha256"]


def test_full_resume_is_exact_for_zero1(tmp_path):
    common = dict(strategy="zero1", **{**MLP, "steps": 6})
    whole = run(2, **common)[0]
    run(2, checkpoint_dir=str(tmp_path), **{**common, "steps": 3})
    resumed = run(2, checkpoint_dir=str(tmp_path), resume=True, **common)[0]
    assert resumed["param_sha256"] == whole["param_sha256"]


@pytest.mark.parametrize("saved, loaded", [pytest.param((4, "ddp"), (2, "fsdp2"), marks=NEEDS_FSDP2),
                                           pytest.param((2, "fsdp2"), (4, "ddp"), marks=NEEDS_FSDP2),
                                           ((4, "zero1"), (2, "zero1-torch")), ((2, "zero1-torch"), (4, "ddp"))])
def test_dcp_checkpoint_reshards_across_world_sizes_and_strategies(tmp_path, saved, loaded):
    def cfg(world, strategy, **changes):
        micro = 16 // world  # the same global batch on any world size
        return {**GPT, "steps": 8, "strategy": strategy, "micro_batch_size": micro, "checkpoint_format": "dcp", **changes}

    whole = run(saved[0], **cfg(*saved))[0]
    run(saved[0], **cfg(*saved, checkpoint_dir=str(tmp_path), steps=4))
    resumed = run(loaded[0], **cfg(*loaded, checkpoint_dir=str(tmp_path), resume=True))[0]
    assert resumed["resumed_from_step"] == 4 and resumed["world_size"] == loaded[0]
    assert resumed["data_sha256"] == whole["data_sha256"]  # the identical global sample stream
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed["losses"], whole["losses"][4:])) <= 1e-4


def test_a_torn_dcp_checkpoint_is_skipped(tmp_path):
    run(2, checkpoint_dir=str(tmp_path), checkpoint_every=2, checkpoint_format="dcp", **{**MLP, "steps": 4})
    newest = checkpoint.list_checkpoints(tmp_path)[0]
    next(newest.glob("*.distcp")).unlink()  # a shard lost
    with pytest.warns(checkpoint.CheckpointWarning, match="missing"):
        assert checkpoint.latest_good(tmp_path).name == "step-00000002"
    resumed = run(2, checkpoint_dir=str(tmp_path), resume=True, checkpoint_format="dcp", **{**MLP, "steps": 4})[0]
    assert resumed["resumed_from_step"] == 2


def test_dcp_metadata_is_read_without_running_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return os.system, ("echo pwned",)

    with pytest.raises(pickle.UnpicklingError, match="os.system|posix.system"):
        sharded_checkpoint._MetadataUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="data, not code"):
        sharded_checkpoint.SafeReader(str(tmp_path)).read_metadata()


def test_activation_checkpointing_changes_memory_not_results():
    plain, recomputed = (run(2, activation_checkpointing=flag, **GPT)[0] for flag in (False, True))
    assert recomputed["param_sha256"] == plain["param_sha256"]
    import torch

    from ddpkit.models import build_model

    cfg = TrainConfig(**GPT)
    tokens = torch.zeros(8, cfg.seq_len, dtype=torch.long)
    model = build_model(cfg)
    full = memory.activation_bytes(model, tokens)
    model.activation_checkpointing = True
    kept = memory.activation_bytes(model, tokens)
    assert kept < full / 2


def test_calculator_reproduces_seed_003_and_the_byte_counts():
    table = {row["stage"]: row for row in memory.zero_stage_table(7e9, 8, "seed003")}
    assert [round(table[s]["total_gb"], 2) for s in ("0 (DDP)", "1", "2", "3")] == [98.0, 49.0, 36.75, 12.25]
    fp32 = memory.bytes_per_rank(1000, "zero1", 1, "fp32")
    assert fp32["optimizer"] == 12 * 1000  # seed 004: master weights + two moments
    mixed = memory.bytes_per_rank(1000, "ddp", 1, "bf16-mixed")
    assert mixed["params"] + mixed["grads"] + mixed["optimizer"] == 16 * 1000  # the ZeRO paper's 16
    assert memory.torch_zero_partition([10, 6, 5, 1], 2) == [11, 11]
    assert memory.smallest_world(7e9, "ddp", 80e9) is None and memory.smallest_world(7e9, "fsdp2", 80e9) == 2


def test_fsdp2_is_refused_where_torch_cannot_run_it(tmp_path):
    assert not fsdp.cpu_supported("2.6.0+cu124") and fsdp.cpu_supported("2.7.1") and fsdp.cpu_supported("3.0.0")
    proc = run_cli("train", "--strategy", "fsdp2", "--steps", "2", "--dataset-size", "256", timeout=120)
    if fsdp.cpu_supported():
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 2 and "needs torch >= 2.7" in proc.stderr and "rank" not in proc.stdout, proc.stderr


def test_bad_strategy_input_is_refused_before_any_rank_starts(tmp_path):
    for args, words in [(("--strategy", "fsdp2", "--checkpoint-format", "full", "--checkpoint-dir", str(tmp_path)), "dcp"),
                        (("--strategy", "zero9"), "invalid choice")]:
        proc = run_cli("train", *args, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    with pytest.raises(ValueError, match="checkpoint-format dcp"):
        TrainConfig(strategy="fsdp2", checkpoint_dir=str(tmp_path), checkpoint_format="full")


def test_a_checkpoint_of_the_other_format_is_refused_before_spawning(tmp_path):
    full, dcp = tmp_path / "full", tmp_path / "dcp"
    small = ("--steps", "2", "--dataset-size", "256", "--world-size", "2")
    assert run_cli("train", *small, "--checkpoint-dir", str(full)).returncode == 0
    assert run_cli("train", *small, "--checkpoint-dir", str(dcp), "--checkpoint-format", "dcp").returncode == 0
    for folder, wrong in ((full, "dcp"), (dcp, "full")):
        proc = run_cli("train", *small, "--steps", "4", "--checkpoint-dir", str(folder), "--resume",
                       "--checkpoint-format", wrong, timeout=60)
        assert proc.returncode == 2 and "resume with that format" in proc.stderr, proc.stderr
        assert "rank" not in proc.stdout
    # without --checkpoint-format a resume keeps the checkpoint's own format
    proc = run_cli("train", *small, "--steps", "4", "--checkpoint-dir", str(dcp), "--resume")
    assert proc.returncode == 0, proc.stderr


def _optimizer_state(ctx, cfg):
    trainer = Trainer(ctx, cfg)
    trainer.fit()
    _, optimizer_state = trainer.strategy.state_dicts(trainer.model, trainer.optimizer, rank0_only=False)
    return {"param_groups": optimizer_state["param_groups"],
            "state": {name: {k: v.numpy().copy() for k, v in entry.items()} for name, entry in optimizer_state["state"].items()}}


def test_zero_optimizers_keep_torch_adamws_state_dict_contract():
    """ZeroAdamW.state_dict() (and the consolidated ZeroRedundancyOptimizer's) is what torch.optim.AdamW
    under DDP returns: the same parameter groups, and at 2 ranks the same moments, bit for bit."""
    cfg = TrainConfig(world_size=2, grad_clip=0.0, **MLP)
    ddp = launch(_optimizer_state, cfg, world_size=2, output="none")[0]
    for strategy in ("zero1", "zero1-torch"):
        other = launch(_optimizer_state, cfg.replace(strategy=strategy), world_size=2, output="none")[0]
        assert other["param_groups"] == ddp["param_groups"], strategy
        assert set(other["state"]) == set(ddp["state"])
        for name, entry in ddp["state"].items():
            for key, value in entry.items():
                assert np.array_equal(other["state"][name][key], value), (strategy, name, key)


def test_a_full_ddp_checkpoint_resumes_under_zero1_bitwise(tmp_path):
    """load_state_dict takes torch AdamW's whole state and keeps this rank's shard."""
    common = dict(grad_clip=0.0, **{**MLP, "steps": 6})
    whole = run(2, **common)[0]
    run(2, checkpoint_dir=str(tmp_path), **{**common, "steps": 3})
    resumed = run(2, strategy="zero1", checkpoint_dir=str(tmp_path), resume=True, **common)[0]
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["optimizer_sha256"] == whole["optimizer_sha256"]


# --------------------------------------------------------------------------- fp16: ranks that hold parts of the gradients agree

def _fp16_with_an_inf_on_one_rank(ctx, cfg, agree: bool):
    """Three fp16 steps; in the second, rank 1 alone finds an inf in a replicated weight's gradient."""
    import torch

    from ddpkit.parallel.tensor_strategy import TensorParallelStrategy

    if not agree:  # the rule switched off: each rank's scaler decides alone
        TensorParallelStrategy.overflow_group = property(lambda self: None)
    trainer = Trainer(ctx, cfg)
    trainer.prepare()
    weight = trainer.raw_model.tok_emb.weight  # replicated on every tp rank
    for step in range(3):
        handle = weight.register_hook(lambda g: torch.full_like(g, float("inf"))) if step == 1 and ctx.rank == 1 else None
        trainer.run_step()
        if handle is not None:
            handle.remove()
    trainer.close()
    return {"weight": weight.detach().clone(), "scale": float(trainer.scaler.get_scale())}


def test_fp16_tensor_parallel_ranks_skip_an_overflowing_step_together():
    cfg = TrainConfig(world_size=2, tp=2, amp="fp16", **{**GPT, "steps": 3})
    agreed = launch(_fp16_with_an_inf_on_one_rank, cfg, True, world_size=2, output="none")
    assert agreed[0]["weight"].equal(agreed[1]["weight"]) and agreed[0]["scale"] == agreed[1]["scale"]
    alone = launch(_fp16_with_an_inf_on_one_rank, cfg, False, world_size=2, output="none")
    assert not alone[0]["weight"].equal(alone[1]["weight"])  # rank 0 stepped, rank 1 skipped: the copies part
    assert alone[0]["scale"] != alone[1]["scale"]


@pytest.mark.parametrize("layout", [dict(strategy="zero1"), pytest.param(dict(strategy="fsdp2"), marks=NEEDS_FSDP2),
                                    dict(pp=2), dict(tp=2)], ids=["zero1", "fsdp2", "pp", "tp"])
def test_fp16_runs_with_sharded_and_model_parallel_layouts_and_resumes_exactly(tmp_path, layout):
    common = dict(amp="fp16", checkpoint_format="dcp", **{**GPT, "steps": 6})
    reference = run(2 // (layout.get("pp", 1) * layout.get("tp", 1)), **common)[0]  # DDP over the same dp ranks
    whole = run(2, **common, **layout)[0]
    run(2, checkpoint_dir=str(tmp_path), checkpoint_every=3, **{**common, "steps": 3}, **layout)
    resumed = run(2, checkpoint_dir=str(tmp_path), resume=True, **common, **layout)[0]
    assert resumed["resumed_from_step"] == 3 and resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["optimizer_sha256"] == whole["optimizer_sha256"]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(whole["losses"], reference["losses"])) <= 1e-3


def _zero_torch_beside_tensor_parallel(ctx, name):
    """One AdamW step of an MLP replicated over the dp group of a dp 2 x tp 2 layout (each tp index is a
    data-parallel group of its own, {0, 2} and {1, 3}), then the whole optimizer state on rank 0."""
    import torch

    from ddpkit.models import MLP
    from ddpkit.parallel.ddp import DDPStrategy
    from ddpkit.parallel.dims import ParallelDims
    from ddpkit.parallel.zero import TorchZeroStrategy

    ctx = ctx.with_dims(ParallelDims(dp=2, tp=2))
    strategy = (TorchZeroStrategy if name == "zero1-torch" else DDPStrategy)(ctx)
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    wrapped = strategy.wrap(model)
    optimizer = strategy.build_optimizer(model, 1e-2, 0.01)
    torch.manual_seed(1 + ctx.dp_rank)
    wrapped(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    _, optimizer_state = strategy.state_dicts(wrapped, optimizer)
    return {n: {k: v.clone() for k, v in entry.items()} for n, entry in optimizer_state.get("state", {}).items()}


def test_zero_redundancy_state_is_gathered_where_the_data_parallel_group_is_not_the_world():
    """The dp group's rank 0 is not global rank 0 in every group: the gather must not mix the two."""
    ddp, zero = (launch(_zero_torch_beside_tensor_parallel, name, world_size=4, output="none")
                 for name in ("ddp", "zero1-torch"))
    assert set(zero[0]) == set(ddp[0]) and len(ddp[0]) == 6 and all(not r for r in zero[1:])
    for name, entry in ddp[0].items():
        for key, value in entry.items():
            assert zero[0][name][key].equal(value), (name, key)
