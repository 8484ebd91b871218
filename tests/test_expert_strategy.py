"""``--experts E --ep N``: the GPT's MLPs as mixtures of experts, the experts split over ep ranks, data
parallel over the world. DDP's samples and (within a tolerance) the losses of the same MoE GPT under plain
DDP; the reduction over the ranks that hold the same experts (and what breaks with the whole world
instead); exact resume, and resume without expert parallelism and back; tokens per expert and drops in the
summary; bad layouts refused before any rank starts."""

import json
import shutil

import pytest

from ddpkit import checkpoint, cli, train
from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.train import Trainer

MOE = dict(model="gpt", experts=4, top_k=2, dataset_size=512, steps=6, log_every=100)
LOSS_TOL = 1e-6  # to DDP's on the same samples, step by step (measured: 0.0 at world 4, ep 2; the control: 1.9e-3)
CROSS_TOL = 1e-5  # after a resume without ep: the reductions add in another order from then on (measured: 1.2e-7)


def run(world: int, **changes) -> dict:
    return launch(train.run, TrainConfig(world_size=world, **changes), world_size=world, output="none")[0]


def max_loss_diff(a: dict, b: dict, skip: int = 0) -> float:
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a["losses"], b["losses"][skip:]))


def _trained(ctx, cfg) -> dict:
    """The negative control: expert gradients reduced over the whole world, not over the ranks that hold
    the same experts (this process only: launch starts fresh ones)."""
    from ddpkit.parallel.expert_strategy import ExpertParallelStrategy

    ExpertParallelStrategy.expert_grad_group = property(lambda self: self.ctx.world_group)
    trainer = Trainer(ctx, cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _idle_rank(ctx) -> dict:
    """Every token routed to expert 1 (rank 1's): rank 0's expert gets no rows, and its backward must still
    join both all-to-alls. Gradients compared with the single-process MoE on every rank's tokens."""
    import torch
    import torch.distributed as dist

    from ddpkit.parallel.expert_parallel import ExpertParallelMoE
    from ddpkit.parallel.experts import MoE

    def layer():
        torch.manual_seed(0)
        moe = MoE(8, num_experts=2, k=1, capacity_factor=None, aux_coef=0.0)
        with torch.no_grad():
            moe.router.weight.copy_(torch.stack([-torch.ones(8), torch.ones(8)]))  # positive tokens: expert 1 wins
        return moe

    x = torch.rand(2, 6, 8, generator=torch.Generator().manual_seed(1)) + 0.1
    full, split = layer(), ExpertParallelMoE(layer(), dist.group.WORLD)
    x_ref, x_mine = x.clone().requires_grad_(True), x[ctx.rank].clone().requires_grad_(True)
    full(x_ref).square().sum().backward()
    split(x_mine).square().sum().backward()
    return {"received": split.stats["received_per_local_expert"],
            "input_grad_diff": float((x_mine.grad - x_ref.grad[ctx.rank]).abs().max())}


def test_a_rank_whose_experts_get_no_tokens_still_joins_the_backward_all_to_alls():
    idle, busy = launch(_idle_rank, world_size=2, output="none")
    assert idle["received"] == [0] and busy["received"] == [12]
    assert idle["input_grad_diff"] <= 1e-6 and busy["input_grad_diff"] <= 1e-6


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ep")
    path = folder / "summary.json"
    assert cli.main(["train", "--world-size", "4", "--ep", "2", "--experts", "4", "--model", "gpt", "--steps", "6",
                     "--dataset-size", "512", "--log-every", "100", "--checkpoint-dir", str(folder / "a"),
                     "--checkpoint-every", "3", "--summary-json", str(path)]) == 0
    out = {"whole": json.loads(path.read_text()),
           "ddp": run(4, checkpoint_dir=str(folder / "d"), checkpoint_every=3, **MOE)}
    for source, copy in (("a", "b"), ("a", "c"), ("d", "e"), ("d", "f")):  # an uninterrupted run's step 3, its step 6 taken away
        shutil.copytree(folder / source, folder / copy)
        shutil.rmtree(checkpoint.step_dir(folder / copy, 6))
    out["resumed"] = run(4, ep=2, checkpoint_dir=str(folder / "b"), resume=True, **MOE)
    out["as_ddp"] = run(4, checkpoint_dir=str(folder / "c"), resume=True, **MOE)
    out["from_ddp"] = run(4, ep=2, checkpoint_dir=str(folder / "e"), resume=True, **MOE)
    out["ddp_resumed"] = run(4, checkpoint_dir=str(folder / "f"), resume=True, **MOE)  # --experts 4, ep 1 as saved
    out["control"] = launch(_trained, TrainConfig(world_size=4, ep=2, **MOE), world_size=4, output="none")
    return out


def test_ep_sees_ddps_samples_and_losses(ep_runs):
    whole, ddp = ep_runs["whole"], ep_runs["ddp"]
    assert (whole["ep"], whole["experts"], whole["dp"], ddp["ep"]) == (2, 4, 4, 1)
    assert whole["data_sha256"] == ddp["data_sha256"]
    assert max_loss_diff(whole, ddp) <= LOSS_TOL


def test_expert_gradients_reduced_over_the_world_mix_experts_and_leave_ddps_losses(ep_runs):
    control, ddp = ep_runs["control"], ep_runs["ddp"]
    assert max_loss_diff(control[0], ddp) > 100 * LOSS_TOL


def test_ep_resumes_exactly_and_continues_without_ep_and_back(ep_runs):
    whole, resumed, other, back = ep_runs["whole"], ep_runs["resumed"], ep_runs["as_ddp"], ep_runs["from_ddp"]
    assert resumed["resumed_from_step"] == 3 and resumed["ep"] == 2
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["optimizer_sha256"] == whole["optimizer_sha256"]
    assert resumed["data_sha256"] == whole["data_sha256"]
    assert other["resumed_from_step"] == 3 and other["ep"] == 1
    assert other["data_sha256"] == whole["data_sha256"]
    assert max_loss_diff(other, whole, skip=3) <= CROSS_TOL
    assert back["resumed_from_step"] == 3 and back["ep"] == 2  # an ep 1 checkpoint sliced into ep 2's experts
    assert back["data_sha256"] == ep_runs["ddp"]["data_sha256"]
    assert max_loss_diff(back, ep_runs["ddp"], skip=3) <= CROSS_TOL


def test_experts_without_ep_resume_exactly_on_the_same_layout(ep_runs):
    ddp, resumed = ep_runs["ddp"], ep_runs["ddp_resumed"]
    assert (resumed["resumed_from_step"], resumed["ep"], resumed["experts"]) == (3, 1, 4)
    assert (resumed["param_sha256"], resumed["optimizer_sha256"], resumed["data_sha256"]) == \
        (ddp["param_sha256"], ddp["optimizer_sha256"], ddp["data_sha256"])
    assert [x["loss"] for x in resumed["losses"]] == [x["loss"] for x in ddp["losses"][3:]]
    # control: equal hashes are a strict test here: the ep 2 run resumed from the same step 3 adds its
    # reductions in another order, lands within 1e-5 and not on the same bits
    assert resumed["param_sha256"] != ep_runs["from_ddp"]["param_sha256"]


def test_the_summary_counts_tokens_per_expert_and_drops(ep_runs):
    whole, ddp = ep_runs["whole"], ep_runs["ddp"]
    cfg = TrainConfig(world_size=4, **MOE)
    assignments = cfg.steps * cfg.global_batch_size * cfg.seq_len * cfg.top_k
    assert len(whole["moe"]) == cfg.n_layers
    for layer, reference in zip(whole["moe"], ddp["moe"]):
        assert len(layer["tokens_per_expert"]) == cfg.experts and layer["assignments"] == assignments
        assert sum(layer["tokens_per_expert"]) + layer["dropped"] == assignments  # every assignment kept or dropped
        assert layer["dropped"] > 0  # capacity 1.25 x an even share binds on an untrained router
        assert layer == reference  # ep routes each rank's tokens exactly as the single-process MoE does
    assert [layer["assignments"] for layer in ep_runs["resumed"]["moe"]] == [assignments // 2] * cfg.n_layers  # its 3 steps


@pytest.mark.parametrize("args, words", [
    (("--world-size", "4", "--experts", "3", "--ep", "2", "--model", "gpt"), "ep 2 must divide the experts (3)"),
    (("--world-size", "2", "--experts", "4", "--ep", "4", "--model", "gpt"), "ep 4 must divide the world size (2)"),
    (("--world-size", "4", "--ep", "2"), "use --model gpt --experts E"),
    (("--world-size", "4", "--ep", "2", "--model", "gpt"), "add --experts E"),
    (("--world-size", "4", "--experts", "4", "--ep", "2", "--tp", "2", "--model", "gpt"), "without --tp, --pp and --cp"),
    (("--world-size", "4", "--experts", "4", "--ep", "2", "--cp", "2", "--model", "gpt"), "without --tp, --pp and --cp"),
    (("--world-size", "4", "--experts", "4", "--ep", "2", "--pp", "2", "--model", "gpt"), "without --tp, --pp and --cp"),
    (("--world-size", "4", "--experts", "4", "--ep", "2", "--strategy", "fsdp2", "--model", "gpt"), "--strategy ddp"),
    (("--world-size", "4", "--experts", "4", "--top-k", "5", "--model", "gpt"), "top-k 5 must be between 1 and"),
    (("--world-size", "4", "--experts", "4", "--capacity-factor", "0", "--model", "gpt"), "capacity-factor must be in (0, 64]"),
    (("--world-size", "4", "--experts", "4", "--capacity-factor", "65", "--model", "gpt"), "capacity-factor must be in (0, 64]"),
    (("--model", "gpt", "--top-k", "1"), "--top-k shapes a mixture of experts: add --experts E, or drop --top-k"),
    (("--model", "gpt", "--capacity-factor", "2", "--top-k", "1"), "--top-k and --capacity-factor shape a mixture of experts"),
    (("--world-size", "4", "--experts", "4", "--model", "mlp"), "use --model gpt"),
    (("--world-size", "4", "--experts", "4", "--amp", "fp16", "--model", "gpt"), "use --amp bf16 or off"),
    (("--world-size", "4", "--experts", "4", "--activation-checkpointing", "--model", "gpt"), "drop --activation-checkpointing"),
], ids=["experts", "world", "mlp", "no-experts", "tp", "cp", "pp", "fsdp2", "top-k", "capacity-0", "capacity-65", "top-k-dense",
        "routing-dense", "moe-mlp",
        "fp16", "recompute"])
def test_bad_ep_layouts_are_refused_in_one_line_before_any_rank_starts(capsys, args, words):
    assert cli.main(["train", *args]) == 2
    out = capsys.readouterr()
    assert words in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert "rank" not in out.out


def test_a_capacity_factor_in_range_is_accepted():  # control for the refusals above
    for factor in (0.5, 1.0, 64.0):
        assert TrainConfig(world_size=4, capacity_factor=factor, **MOE).capacity_factor == factor


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory):
    """--ep 2 with dcp checkpoints: each rank writes its experts' rows, nothing gathered; resumed under
    --ep 2 and under --ep 1 from the same step-3 checkpoint, and an --ep 1 dcp checkpoint under --ep 2."""
    folder = tmp_path_factory.mktemp("ep-dcp")
    dcp = dict(MOE, checkpoint_format="dcp", checkpoint_every=3)
    out = {"whole": run(4, ep=2, checkpoint_dir=str(folder / "a"), **dcp), "ddp": run(4, checkpoint_dir=str(folder / "d"), **dcp)}
    for source, copy in (("a", "b"), ("a", "c"), ("d", "e")):  # the step-3 checkpoints of uninterrupted runs
        shutil.copytree(folder / source, folder / copy)
        shutil.rmtree(checkpoint.step_dir(folder / copy, 6))
    out["resumed"] = run(4, ep=2, checkpoint_dir=str(folder / "b"), resume=True, **dcp)
    out["as_ep1"] = run(4, checkpoint_dir=str(folder / "c"), resume=True, **dcp)
    out["from_ep1"] = run(4, ep=2, checkpoint_dir=str(folder / "e"), resume=True, **dcp)
    out["files"] = sorted(p.name for p in checkpoint.step_dir(folder / "a", 3).iterdir())
    return out


def test_ep_dcp_checkpoints_resume_exactly_and_under_another_ep(dcp_runs):
    whole, resumed = dcp_runs["whole"], dcp_runs["resumed"]
    assert whole["checkpoint_format"] == "dcp" and resumed["resumed_from_step"] == 3
    assert (resumed["param_sha256"], resumed["optimizer_sha256"], resumed["data_sha256"]) == \
        (whole["param_sha256"], whole["optimizer_sha256"], whole["data_sha256"])
    other, back = dcp_runs["as_ep1"], dcp_runs["from_ep1"]
    assert other["ep"] == 1 and other["resumed_from_step"] == 3 and other["data_sha256"] == whole["data_sha256"]
    assert max_loss_diff(other, whole, skip=3) <= CROSS_TOL
    assert back["ep"] == 2 and back["resumed_from_step"] == 3 and back["data_sha256"] == dcp_runs["ddp"]["data_sha256"]
    assert max_loss_diff(back, dcp_runs["ddp"], skip=3) <= CROSS_TOL


def test_an_ep_dcp_checkpoint_holds_every_expert_once():
    """What each rank of --ep 2 tells DCP: its experts as rows [first, first + E/ep) of the whole (E, ...)
    tensors, replicated tensors whole. The two ep positions' rows tile each expert tensor exactly."""
    described = launch(_described_rows, TrainConfig(world_size=4, ep=2, **MOE), world_size=4, output="none")
    for name, whole_rows in described[0].items():
        rows = sorted({tuple(rank[name]) for rank in described})
        assert rows == [(0, 2), (2, 4)] and whole_rows == [0, 2], (name, rows)


def _described_rows(ctx, cfg) -> dict:
    from ddpkit.parallel.chunks import Chunked

    trainer = Trainer(ctx, cfg)
    model_state, _ = trainer.strategy.sharded_state_dicts(trainer.model, trainer.optimizer)
    trainer.close()
    experts = {n: t for n, t in model_state.items() if isinstance(t, Chunked)}
    assert experts and all(".experts." in n for n in experts), sorted(model_state)
    return {n: [t.pieces[0][0][0], t.pieces[0][0][0] + t.pieces[0][1].shape[0]] for n, t in experts.items()}

