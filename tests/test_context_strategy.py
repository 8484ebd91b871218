"""``--cp N``: the GPT's sequences split over context-parallel ranks (ring attention), DDP over dp x cp,
alone, with ``--tp`` (heads over tp, positions over cp) and with ``--pp`` (every stage's positions over cp). DDP's samples and losses, the averaging over
cp that makes it so (and what breaks without it), exact resume, a checkpoint that continues without
context parallelism, and bad layouts refused."""

import json
import shutil

import pytest

from ddpkit import cli, train
from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.train import Trainer

GPT = dict(model="gpt", dataset_size=512, steps=6, log_every=100)
LOSS_TOL = 1e-5  # to DDP's on the same samples, step by step (measured: 2.4e-7 at dp 2 x cp 2)
CROSS_TOL = 1e-4  # after a resume without cp: its reductions add in another order from then on


def run(world: int, **changes) -> dict:
    return launch(train.run, TrainConfig(world_size=world, **changes), world_size=world, output="none")[0]


def max_loss_diff(a: dict, b: dict, skip: int = 0) -> float:
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a["losses"], b["losses"][skip:]))


def _trained(ctx, cfg, over_world: bool) -> dict:
    """A cp run's summary; ``over_world=False`` is the control: DDP over the dp group only, so the
    gradients of the cp peers' positions are never averaged together."""
    from ddpkit.parallel.context_strategy import ContextParallelStrategy, ContextTensorParallelStrategy

    if not over_world:  # this process only: launch starts fresh ones
        ContextParallelStrategy.ddp_group = property(lambda self: self.ctx.dp_group)
        ContextTensorParallelStrategy.ddp_group = property(lambda self: self.ctx.dp_group)
    trainer = Trainer(ctx, cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cp")
    path = folder / "summary.json"
    assert cli.main(["train", "--world-size", "4", "--cp", "2", "--model", "gpt", "--steps", "6", "--dataset-size", "512",
                     "--log-every", "100", "--summary-json", str(path)]) == 0
    out = {"ddp": run(2, **GPT), "whole": json.loads(path.read_text())}
    run(4, cp=2, checkpoint_dir=str(folder / "a"), checkpoint_every=3, **{**GPT, "steps": 3})
    shutil.copytree(folder / "a", folder / "b")
    out["resumed"] = run(4, cp=2, checkpoint_dir=str(folder / "a"), resume=True, **GPT)
    out["as_ddp"] = run(2, checkpoint_dir=str(folder / "b"), resume=True, **GPT)
    out["control"] = launch(_trained, TrainConfig(world_size=4, cp=2, **GPT), False, world_size=4, output="none")
    return out


def test_cp_sees_ddps_samples_and_losses(cp_runs):
    ddp, whole = cp_runs["ddp"], cp_runs["whole"]
    assert whole["dp"] == 2 and whole["cp"] == 2 and whole["data_sha256"] == ddp["data_sha256"]
    assert max_loss_diff(whole, ddp) <= LOSS_TOL


def test_without_averaging_over_cp_the_peers_part_and_the_losses_leave_ddps(cp_runs):
    control, ddp = cp_runs["control"], cp_runs["ddp"]
    assert control[0]["param_sha256"] != control[1]["param_sha256"]  # cp peers: rank 0 and rank 1
    assert max_loss_diff(control[0], ddp) > 100 * LOSS_TOL


def test_cp_resumes_exactly_and_continues_without_cp(cp_runs):
    whole, resumed, other = cp_runs["whole"], cp_runs["resumed"], cp_runs["as_ddp"]
    assert resumed["resumed_from_step"] == 3
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["optimizer_sha256"] == whole["optimizer_sha256"]
    assert resumed["data_sha256"] == whole["data_sha256"]
    assert other["resumed_from_step"] == 3 and other["cp"] == 1
    assert other["data_sha256"] == whole["data_sha256"]
    assert max_loss_diff(other, whole, skip=3) <= CROSS_TOL


@pytest.fixture(scope="module")
def cp_tp_runs(tmp_path_factory):
    """dp 1 x cp 2 x tp 2 on 4 ranks against DDP on one rank (the same samples: dp is 1 either way)."""
    folder = tmp_path_factory.mktemp("cptp")
    layout = dict(cp=2, tp=2, **GPT)
    out = {"ddp": run(1, **GPT), "whole": run(4, **layout)}
    run(4, checkpoint_dir=str(folder / "a"), checkpoint_every=3, **{**layout, "steps": 3})
    shutil.copytree(folder / "a", folder / "b")
    out["resumed"] = run(4, checkpoint_dir=str(folder / "a"), resume=True, **layout)
    out["as_ddp"] = run(1, checkpoint_dir=str(folder / "b"), resume=True, **GPT)
    out["control"] = launch(_trained, TrainConfig(world_size=4, **layout), False, world_size=4, output="none")
    return out


def test_cp_with_tp_sees_ddps_samples_and_losses(cp_tp_runs):
    ddp, whole = cp_tp_runs["ddp"], cp_tp_runs["whole"]
    assert (whole["dp"], whole["cp"], whole["tp"]) == (1, 2, 2) and whole["data_sha256"] == ddp["data_sha256"]
    assert max_loss_diff(whole, ddp) <= LOSS_TOL


def test_cp_with_tp_without_averaging_over_cp_parts_the_peers(cp_tp_runs):
    control, ddp = cp_tp_runs["control"], cp_tp_runs["ddp"]  # (the summary's hashes are of the gathered model)
    assert max_loss_diff(control[0], ddp) > 100 * LOSS_TOL


def test_cp_with_tp_resumes_exactly_and_continues_on_one_rank(cp_tp_runs):
    whole, resumed, other = cp_tp_runs["whole"], cp_tp_runs["resumed"], cp_tp_runs["as_ddp"]
    assert resumed["resumed_from_step"] == 3
    assert (resumed["param_sha256"], resumed["optimizer_sha256"]) == (whole["param_sha256"], whole["optimizer_sha256"])
    assert other["resumed_from_step"] == 3 and (other["cp"], other["tp"]) == (1, 1)
    assert other["data_sha256"] == whole["data_sha256"]
    assert max_loss_diff(other, whole, skip=3) <= CROSS_TOL


def _pipeline_without_cp_averaging(ctx, cfg) -> dict:
    """The control for cp inside a pipeline: each stage's gradients left unaveraged (dp is 1 here, so
    averaging over dp alone would be nothing either), so the cp peers of a stage part."""
    from ddpkit.parallel.pipeline_strategy import PipelineStrategy

    PipelineStrategy._average_gradients = lambda self: None  # this process only: launch starts fresh ones
    return train.run(ctx, cfg)


@pytest.fixture(scope="module")
def cp_pp_runs(tmp_path_factory):
    """dp 1 x cp 2 x pp 2 on 4 ranks (3 micro-batches through the pipeline) against DDP on one rank."""
    folder = tmp_path_factory.mktemp("cppp")
    layout = dict(cp=2, pp=2, grad_accum=3, **GPT)
    out = {"ddp": run(1, grad_accum=3, **GPT), "whole": run(4, **layout)}
    run(4, checkpoint_dir=str(folder / "a"), checkpoint_every=3, **{**layout, "steps": 3})
    shutil.copytree(folder / "a", folder / "b")
    out["resumed"] = run(4, checkpoint_dir=str(folder / "a"), resume=True, **layout)
    out["as_ddp"] = run(1, checkpoint_dir=str(folder / "b"), resume=True, grad_accum=3, **GPT)
    out["control"] = launch(_pipeline_without_cp_averaging, TrainConfig(world_size=4, **layout), world_size=4, output="none")
    return out


def test_cp_inside_a_pipeline_sees_ddps_samples_and_losses(cp_pp_runs):
    ddp, whole = cp_pp_runs["ddp"], cp_pp_runs["whole"]
    assert (whole["dp"], whole["cp"], whole["pp"]) == (1, 2, 2) and whole["data_sha256"] == ddp["data_sha256"]
    assert max_loss_diff(whole, ddp) <= LOSS_TOL


def test_cp_inside_a_pipeline_without_averaging_over_cp_leaves_ddps_losses(cp_pp_runs):
    assert max_loss_diff(cp_pp_runs["control"][0], cp_pp_runs["ddp"]) > 100 * LOSS_TOL


def test_cp_inside_a_pipeline_resumes_exactly_and_continues_on_one_rank(cp_pp_runs):
    whole, resumed, other = cp_pp_runs["whole"], cp_pp_runs["resumed"], cp_pp_runs["as_ddp"]
    assert resumed["resumed_from_step"] == 3
    assert (resumed["param_sha256"], resumed["optimizer_sha256"]) == (whole["param_sha256"], whole["optimizer_sha256"])
    assert other["resumed_from_step"] == 3 and (other["cp"], other["pp"]) == (1, 1)
    assert other["data_sha256"] == whole["data_sha256"]
    assert max_loss_diff(other, whole, skip=3) <= CROSS_TOL


@pytest.mark.parametrize("args, words", [
    (("--world-size", "4", "--cp", "3", "--model", "gpt"), "cp 3 (times tp 1 and pp 1) must divide the world size"),
    (("--world-size", "4", "--cp", "2", "--tp", "4", "--model", "gpt"), "cp 2 (times tp 4 and pp 1) must divide"),
    (("--world-size", "4", "--cp", "2"), "use --model gpt"),
    (("--world-size", "8", "--cp", "2", "--pp", "2", "--tp", "4", "--model", "gpt"), "cp 2 (times tp 4 and pp 2) must divide"),
    (("--world-size", "4", "--cp", "2", "--strategy", "fsdp2", "--model", "gpt"), "--strategy ddp"),
], ids=["world", "world-tp", "mlp", "world-tp-pp", "fsdp2"])
def test_bad_cp_layouts_are_refused_in_one_line_before_any_rank_starts(capsys, args, words):
    assert cli.main(["train", *args]) == 2
    out = capsys.readouterr()
    assert words in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert "rank" not in out.out


def test_a_sequence_that_cp_cannot_halve_evenly_is_refused():
    with pytest.raises(ValueError, match="half the sequence length"):
        TrainConfig(model="gpt", world_size=4, cp=4, seq_len=12)
