"""The loss guard: a NaN step is skipped, a damaged state is rolled back, and a clean run is unchanged."""

import math

import pytest

from ddpkit import train
from ddpkit.config import TrainConfig
from ddpkit.failures import LaunchError
from ddpkit.guard import MAX_ROLLBACKS, MIN_HISTORY, LossGuard
from ddpkit.hooks import Hook
from ddpkit.launch import launch
from ddpkit.train import Trainer

RUN = dict(steps=30, dataset_size=1024, log_every=100)


def run(**changes) -> dict:
    cfg = TrainConfig(**{**RUN, **changes})
    return launch(train.run, cfg, world_size=cfg.world_size, output="none")[0]


def test_verdicts_and_the_skip_then_rollback_rule():
    guard = LossGuard(spike_factor=3.0)
    assert guard.verdict(float("nan"), 1.0) == "nonfinite" and guard.verdict(1.0, math.inf) == "nonfinite"
    assert guard.verdict(100.0, 1.0) == "ok"  # no history yet: the first losses move fast
    for _ in range(MIN_HISTORY):
        guard.accept(1.0)
    assert guard.verdict(2.9, 1.0) == "ok" and guard.verdict(3.1, 1.0) == "spike"
    assert guard.reject(7, "spike", [1, 2]) == "skip"
    assert guard.reject(8, "spike", [3, 4]) == "rollback"
    guard.rolled_back(8, 5)
    assert (guard.rollbacks, guard.rejected_in_a_row, guard.skipped_batches) == (1, 0, [1, 2, 3, 4])


def test_a_clean_run_is_bitwise_the_same_with_the_guard():
    assert run(nan_guard=True)["param_sha256"] == run()["param_sha256"]


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_an_injected_nan_ends_the_run_in_nan_without_the_guard_and_is_skipped_with_it(strategy):
    clean = run(strategy=strategy)
    poisoned = dict(strategy=strategy, fail_mode="nan", fail_at_step=10, fail_rank=1)
    unguarded = run(**poisoned)
    guarded = run(nan_guard=True, **poisoned)
    assert math.isnan(unguarded["losses"][-1]["loss"]), "one NaN gradient poisons every later step"
    assert math.isnan(guarded["losses"][10]["loss"]) and guarded["rollbacks"] == 0
    assert len(guarded["skipped_batches"]) == clean["global_batch_size"]  # that one step's samples, recorded
    final, reference = guarded["losses"][-1]["loss"], clean["losses"][-1]["loss"]
    assert math.isfinite(final) and abs(final - reference) <= 0.25 * reference, (final, reference)


def test_damaged_weights_are_rolled_back_to_the_newest_checkpoint(tmp_path):
    damaged = dict(fail_mode="spike", fail_at_step=12, checkpoint_every=5)
    unguarded = run(checkpoint_dir=str(tmp_path / "a"), **damaged)
    guarded = run(checkpoint_dir=str(tmp_path / "b"), nan_guard=True, **damaged)
    assert guarded["rollbacks"] == 1 and [e["action"] for e in guarded["guard_events"]] == ["skip", "rollback", "to step 10"]
    assert len(guarded["skipped_batches"]) == 2 * guarded["global_batch_size"]  # the spike and the one after
    assert guarded["losses"][-1]["loss"] < 0.5 * unguarded["losses"][-1]["loss"]


def test_with_nothing_to_roll_back_to_the_guard_stops_the_run_with_the_fix(tmp_path):
    with pytest.raises(LaunchError, match="no checkpoint to roll back to: add --checkpoint-dir"):
        run(fail_mode="spike", fail_at_step=8, nan_guard=True)


@pytest.mark.parametrize("fault", [dict(fail_mode="nan", fail_at_step=7, fail_rank=1),  # a skipped step before the save
                                   dict(fail_mode="spike", fail_at_step=14)])  # a spike 4 steps after the resume
def test_a_guarded_run_resumes_bitwise_with_its_history(tmp_path, fault):
    """The resume check counts applied optimizer steps (a rejected step applies none), and the guard's
    history travels with the checkpoint: a spike right after a resume is caught as it would be without one."""
    guarded = dict(nan_guard=True, checkpoint_every=5, steps=20, **fault)
    straight = run(checkpoint_dir=str(tmp_path / "a"), **guarded)
    run(checkpoint_dir=str(tmp_path / "b"), **{**guarded, "steps": 10})
    resumed = run(checkpoint_dir=str(tmp_path / "b"), resume=True, **guarded)
    assert resumed["resumed_from_step"] == 10 and straight["guard_events"], straight["guard_events"]
    for key in ("param_sha256", "optimizer_sha256", "data_sha256", "skipped_batches", "guard_events", "applied_steps"):
        assert resumed[key] == straight[key], key
    assert resumed["applied_steps"] < resumed["steps"]  # the rejected steps applied nothing


class NaNFrom(Hook):
    """Every forward gives NaN from ``step`` on: a fault no rollback can get past."""

    def __init__(self, step: int) -> None:
        self.step, self.handle = step, None

    def before_step(self, trainer) -> None:
        if trainer.step == self.step and self.handle is None:
            self.handle = trainer.model.module.register_forward_hook(lambda m, i, out: out * float("nan"))


def nan_for_good(ctx, cfg, step):
    return Trainer(ctx, cfg, hooks=[NaNFrom(step)]).fit()


def test_a_fault_that_persists_gives_up_after_a_bounded_number_of_rollbacks(tmp_path):
    cfg = TrainConfig(**{**RUN, "steps": 60}, nan_guard=True, checkpoint_dir=str(tmp_path), checkpoint_every=4)
    with pytest.raises(LaunchError) as info:
        launch(nan_for_good, cfg, 6, world_size=2, output="none")
    message = info.value.root_cause.message
    assert info.value.is_user_error and f"rolled back {MAX_ROLLBACKS} times" in message, message
    step = 6 + 2 * (MAX_ROLLBACKS + 1)  # skip, roll back; MAX_ROLLBACKS times; then the next rollback is refused
    assert f"step {step} was rejected again" in message and "\n" not in message, message
