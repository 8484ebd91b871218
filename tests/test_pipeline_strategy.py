"""Pipeline parallelism in the trainer: the same samples and losses as DDP and as one process, alone and
with tensor parallelism, less memory per rank, exact resume, and resume onto another layout."""

import pytest

from ddpkit import train
from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from tests.conftest import run_cli, train_summary

TRAIN = dict(model="gpt", dataset_size=512, steps=8, log_every=100)


def run(world: int, **changes) -> dict:
    return launch(train.run, TrainConfig(world_size=world, **{**TRAIN, **changes}), world_size=world, output="none")[0]


def close(a: dict, b: dict, tol: float = 1e-4) -> bool:
    """Same steps, losses within ``tol``."""
    steps = [x["step"] for x in a["losses"]] == [x["step"] for x in b["losses"]]
    return steps and max(abs(x["loss"] - y["loss"]) for x, y in zip(a["losses"], b["losses"])) <= tol


def test_pp_inside_dp_trains_like_ddp_through_the_cli(tmp_path):
    def summary(name, *args):
        return train_summary(tmp_path, name, "--model", "gpt", "--dataset-size", "512", "--steps", "8", *args)

    ddp = summary("ddp", "--world-size", "2")
    pp = summary("pp", "--world-size", "4", "--pp", "2")
    assert (pp["dp"], pp["tp"], pp["pp"], pp["global_batch_size"]) == (2, 1, 2, ddp["global_batch_size"])
    assert pp["data_sha256"] == ddp["data_sha256"] and close(pp, ddp)
    # each stage runs the whole model's operations in its order, and with 2 replicas (a + b == b + a)
    # the gradient average is DDP's to the bit: so are the weights
    assert pp["param_sha256"] == ddp["param_sha256"]
    for kind in ("params", "grads", "optimizer"):  # each rank holds one stage: about half
        assert pp["state_bytes_per_rank"][kind] < 0.6 * ddp["state_bytes_per_rank"][kind], kind
    both = summary("tp-pp", "--world-size", "4", "--tp", "2", "--pp", "2", "--grad-accum", "2")  # dp 1: 2 micro-batches
    assert (both["dp"], both["tp"], both["pp"], both["global_batch_size"]) == (1, 2, 2, ddp["global_batch_size"])
    assert both["data_sha256"] == ddp["data_sha256"] and close(both, ddp)


def test_four_stages_equal_one_process_with_activation_checkpointing_changing_nothing():
    common = dict(n_layers=4, grad_accum=4, micro_batch_size=4)
    one = run(1, **common)
    four = run(4, pp=4, **common)
    assert (four["dp"], four["pp"]) == (1, 4) and four["data_sha256"] == one["data_sha256"] and close(four, one, 1e-5)
    recomputed = run(4, pp=4, activation_checkpointing=True, **common)
    assert recomputed["param_sha256"] == four["param_sha256"]  # recomputing a forward gives the same numbers


@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_resume_is_exact_on_the_same_layout_and_moves_between_pp_and_dp(tmp_path, fmt):
    whole = run(4, pp=2, checkpoint_format=fmt)
    run(4, pp=2, checkpoint_dir=str(tmp_path / "a"), checkpoint_format=fmt, steps=4)
    same = run(4, pp=2, checkpoint_dir=str(tmp_path / "a"), checkpoint_format=fmt, resume=True)
    assert (same["resumed_from_step"], same["param_sha256"], same["optimizer_sha256"], same["data_sha256"]) == \
        (4, whole["param_sha256"], whole["optimizer_sha256"], whole["data_sha256"])
    run(4, pp=2, checkpoint_dir=str(tmp_path / "b"), checkpoint_format=fmt, steps=4)
    moved = run(2, checkpoint_dir=str(tmp_path / "b"), checkpoint_format=fmt, resume=True)  # pp 2 -> dp only
    assert (moved["pp"], moved["resumed_from_step"]) == (1, 4) and moved["data_sha256"] == whole["data_sha256"]
    assert close(moved, {"losses": whole["losses"][4:]})
    back = run(4, pp=2, checkpoint_dir=str(tmp_path / "b"), checkpoint_format=fmt, resume=True, steps=10)  # dp -> pp 2
    assert (back["pp"], back["resumed_from_step"]) == (2, 8) and [x["step"] for x in back["losses"]] == [9, 10]


def test_bad_pipeline_layouts_are_refused_before_any_rank_starts():
    for args, words in [(("--pp", "3", "--world-size", "3", "--model", "gpt"), "more stages than the model's 2 blocks"),
                        (("--pp", "2", "--world-size", "3", "--model", "gpt"), "multiple of 2"),
                        (("--pp", "2", "--world-size", "2"), "use --model gpt"),
                        (("--pp", "2", "--world-size", "2", "--model", "gpt", "--pp-schedule", "interleaved"),
                         "holds several stages per rank")]:
        proc = run_cli("train", *args, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)


def test_zero_bubble_in_the_trainer_is_1f1bs_step_to_the_bit_and_resumes_exactly(tmp_path):
    common = dict(pp=2, grad_accum=4, micro_batch_size=2)
    one_f_one_b = run(2, **common, steps=6)
    run(2, **common, pp_schedule="zero-bubble", checkpoint_dir=str(tmp_path), steps=3)
    resumed = run(2, **common, pp_schedule="zero-bubble", checkpoint_dir=str(tmp_path), resume=True, steps=6)
    # the weight gradients deferred to W are the same numbers as a whole backward's: nothing moves a bit
    assert (resumed["resumed_from_step"], resumed["param_sha256"], resumed["optimizer_sha256"], resumed["data_sha256"]) == \
        (3, one_f_one_b["param_sha256"], one_f_one_b["optimizer_sha256"], one_f_one_b["data_sha256"])


def test_the_zero_bubble_message_plans_are_deadlock_free_batched():
    from ddpkit.parallel.pipeline_schedules import zero_bubble
    from ddpkit.parallel.pipeline_strategy import exchange_plan
    from ddpkit.parallel.rendezvous import Op, replay

    for p in range(2, 7):
        for m in range(1, 9):
            ranks = tuple(range(p))
            plans = [[[Op(x.kind, ranks, x.peer, 1) for x in batch] for batch in exchange_plan(order, s, p) if batch]
                     for s, order in enumerate(zero_bubble(p, m))]
            assert replay(plans) == 2 * 2 * (p - 1) * m  # every activation and gradient sent and received once


def test_pp_schedules_the_trainer_cannot_run_are_refused_in_the_config():
    with pytest.raises(ValueError, match="unknown pp-schedule 'looped'"):
        TrainConfig(model="gpt", pp=2, pp_schedule="looped")
    with pytest.raises(ValueError, match="see notebook 13"):
        TrainConfig(model="gpt", pp=2, pp_schedule="zbv")
    with pytest.raises(ValueError, match="use --pp >= 2"):  # a schedule with no pipeline to schedule
        TrainConfig(model="gpt", pp_schedule="zero-bubble")


def _orders_run(ctx, cfg) -> list:
    """Train with ``cfg`` and return each step's order of actions on this rank, as the executor got them."""
    from ddpkit.parallel import pipeline_strategy

    seen, generate = [], pipeline_strategy.generate

    def spy(name, p, m, v):
        orders = generate(name, p, m, v)
        seen.append([[str(a) for a in order] for order in orders])
        return orders

    pipeline_strategy.generate = spy  # this rank's process only: launch starts fresh ones
    trainer = train.Trainer(ctx, cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return [orders[trainer.ctx.pp_rank] for orders in seen]  # the trainer's layout places the stages


def _most_in_flight(order: list[str]) -> int:
    """Micro-batches whose forward ran and whose backward has not: the activations a stage holds."""
    held = most = 0
    for action in order:
        held += {"F": 1, "B": -1}.get(action[0], 0)
        most = max(most, held)
    return most


def test_gpipe_in_the_trainer_runs_every_forward_first_and_holds_every_micro_batch():
    cfgs = {name: TrainConfig(world_size=2, **{**TRAIN, "steps": 1}, pp=2, grad_accum=4, micro_batch_size=2, pp_schedule=name)
            for name in ("gpipe", "1f1b")}
    seen = {name: launch(_orders_run, cfg, world_size=2, output="none") for name, cfg in cfgs.items()}
    first_stage = seen["gpipe"][0][0]
    assert first_stage == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert [_most_in_flight(rank[0]) for rank in seen["gpipe"]] == [4, 4]  # all m micro-batches held
    # control: 1F1B's stage s holds p - s of them
    assert [_most_in_flight(rank[0]) for rank in seen["1f1b"]] == [2, 1]


def test_gpipe_in_the_trainer_is_1f1bs_step_to_the_bit_and_resumes_exactly(tmp_path):
    """``--pp-schedule gpipe``: every forward, then every backward. The backwards run in the same order as
    1F1B's, so the gradients add up in the same order: the same step to the bit, only the memory differs."""
    common = dict(pp=2, grad_accum=4, micro_batch_size=2)
    one_f_one_b = run(2, **common, steps=6)
    gpipe = run(2, **common, pp_schedule="gpipe", steps=6)
    assert gpipe["data_sha256"] == one_f_one_b["data_sha256"] and close(gpipe, one_f_one_b, 0.0)
    assert (gpipe["param_sha256"], gpipe["optimizer_sha256"]) == (one_f_one_b["param_sha256"], one_f_one_b["optimizer_sha256"])
    run(2, **common, pp_schedule="gpipe", checkpoint_dir=str(tmp_path), steps=3)
    resumed = run(2, **common, pp_schedule="gpipe", checkpoint_dir=str(tmp_path), resume=True, steps=6)
    assert (resumed["resumed_from_step"], resumed["param_sha256"], resumed["optimizer_sha256"], resumed["data_sha256"]) == \
        (3, gpipe["param_sha256"], gpipe["optimizer_sha256"], gpipe["data_sha256"])
    # control: the same pipeline with 2 micro-batches of 4 sees the same samples and ends on other bits
    halves = run(2, pp=2, grad_accum=2, micro_batch_size=4, pp_schedule="gpipe", steps=6)
    assert halves["data_sha256"] == gpipe["data_sha256"] and halves["param_sha256"] != gpipe["param_sha256"]
