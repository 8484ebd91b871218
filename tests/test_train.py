"""Trainer invariants, proved by comparison on real gloo ranks."""

import statistics
import time

import pytest
import torch

import ddpkit
from ddpkit import checkpoint, metrics, train
from ddpkit.hooks import CheckpointEvery, Hook
from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.models import build_model, loss_fn
from ddpkit.parallel.ddp import wrap_ddp
from ddpkit.step import PhaseTimer, train_step
from ddpkit.train import Trainer

SMALL = dict(dataset_size=512, input_width=32, hidden_width=64, steps=12, log_every=100)


def run(world_size: int, **changes) -> list[dict]:
    cfg = TrainConfig(world_size=world_size, **{**SMALL, **changes})
    return launch(train.run, cfg, world_size=world_size, output="none")


def test_all_ranks_hold_identical_parameters_and_runs_repeat_bitwise():
    first, second = run(2), run(2)
    hashes = {s["param_sha256"] for s in first + second}
    assert len(hashes) == 1
    assert len({s["optimizer_sha256"] for s in first + second}) == 1  # Adam moments in lock-step too
    assert first[0]["losses"] == second[0]["losses"]


def test_topology_does_not_change_training():
    a = run(2, micro_batch_size=8)[0]
    b = run(1, micro_batch_size=8, grad_accum=2)[0]
    c = run(1, micro_batch_size=16)[0]
    assert a["global_batch_size"] == b["global_batch_size"] == c["global_batch_size"] == 16
    assert a["data_sha256"] == b["data_sha256"] == c["data_sha256"]
    for other in (b, c):
        torch.testing.assert_close([x["loss"] for x in other["losses"]], [x["loss"] for x in a["losses"]],
                                   rtol=1e-5, atol=1e-6)


class GradRecorder(torch.optim.SGD):
    """An optimizer that only records the gradient it was given."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.grads = None

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]


def accumulated_grads(ctx, cfg, batch):
    model = wrap_ddp(build_model(cfg), ctx)
    opt = GradRecorder(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    per_rank = len(batch["index"]) // ctx.world_size
    mine = {k: v[ctx.rank * per_rank:(ctx.rank + 1) * per_rank] for k, v in batch.items()}
    b = per_rank // cfg.grad_accum
    micro = [{k: v[i * b:(i + 1) * b] for k, v in mine.items()} for i in range(cfg.grad_accum)]
    train_step(model, opt, scaler, micro, cfg, ctx.device)
    return opt.grads


def test_accumulated_gradient_equals_big_batch_gradient():
    cfg = TrainConfig(**SMALL, grad_clip=0.0, world_size=2, micro_batch_size=4, grad_accum=2)
    data = train.build_dataset(cfg)
    batch = {"index": torch.arange(16), "inputs": data.features[:16], "targets": data.labels[:16]}
    got = launch(accumulated_grads, cfg, batch, world_size=2, output="none")
    model = build_model(cfg)
    loss_fn(model(batch["inputs"]), batch["targets"]).backward()
    for rank_grads in got:
        worst = max(float((g - p.grad).abs().max()) for g, p in zip(rank_grads, model.parameters()))
        assert worst < 1e-6, worst


def count_allreduces(ctx, cfg, forward_inside):
    model = wrap_ddp(build_model(cfg), ctx)
    comm = metrics.CommTimer().register(model)
    x, y = torch.randn(4, cfg.input_width), torch.randint(0, cfg.num_classes, (4,))
    counts = {}
    for label, accum in (("one_step_no_accum", 1), ("accum_4", 4)):
        comm.reset()
        for k in range(accum):
            last = k == accum - 1
            if forward_inside or last:
                ctx_mgr = model.no_sync() if not last else torch.enable_grad()
                with ctx_mgr:
                    loss_fn(model(x), y).backward()
            else:  # the mistake: forward outside no_sync, only backward inside
                loss = loss_fn(model(x), y)
                with model.no_sync():
                    loss.backward()
        counts[label] = comm.calls
    model.zero_grad()
    return counts


def test_no_sync_skips_communication_only_with_forward_inside():
    cfg = TrainConfig(**SMALL)
    right = launch(count_allreduces, cfg, True, world_size=2, output="none")[0]
    wrong = launch(count_allreduces, cfg, False, world_size=2, output="none")[0]
    per_sync = right["one_step_no_accum"]
    assert per_sync >= 1
    assert right["accum_4"] == per_sync  # one all-reduce round per optimizer step
    assert wrong["accum_4"] == 4 * per_sync  # every micro-batch communicated anyway


def test_a_real_run_with_accumulation_communicates_once_per_step(tmp_path):
    one_round = launch(count_allreduces, TrainConfig(**SMALL), True, world_size=2,
                       output="none")[0]["one_step_no_accum"]
    run(2, grad_accum=4, micro_batch_size=2, steps=3, metrics_dir=str(tmp_path))
    steps = [r for r in metrics.read_metrics(str(tmp_path)) if r["rank"] == 0]
    assert [r["comm_calls"] for r in steps] == [one_round] * 3  # not 4 rounds per step


@pytest.mark.parametrize("world_size, variant", [
    (2, dict()),
    (2, dict(num_workers=2, dataset_size=160)),  # 10 steps an epoch: the resume is mid-epoch 1 and crosses epochs
    (2, dict(amp="fp16")),
    (2, dict(model="gpt", amp="bf16")),
    (3, dict()),  # with 3 or more replicas the order of additions matters: DDP's bucket layout must not change
    (4, dict(micro_batch_size=4)),
    (4, dict(model="gpt", micro_batch_size=4)),
])
def test_exact_resume(tmp_path, world_size, variant):
    straight = run(world_size, steps=20, **variant)[0]
    run(world_size, steps=15, checkpoint_dir=str(tmp_path), **variant)
    resumed = run(world_size, steps=20, checkpoint_dir=str(tmp_path), resume=True, **variant)[0]
    assert resumed["resumed_from_step"] == 15 and resumed["steps"] == 20
    assert resumed["param_sha256"] == straight["param_sha256"]
    assert resumed["data_sha256"] == straight["data_sha256"]
    assert resumed["losses"] == straight["losses"][15:]


def test_resume_on_another_world_size_sees_the_same_data(tmp_path):
    straight = run(2, steps=16, micro_batch_size=8)[0]
    run(2, steps=8, micro_batch_size=8, checkpoint_dir=str(tmp_path))
    resumed = run(1, steps=16, micro_batch_size=16, checkpoint_dir=str(tmp_path), resume=True)[0]
    assert resumed["world_size"] == 1 and resumed["resumed_from_step"] == 8
    assert resumed["data_sha256"] == straight["data_sha256"]
    torch.testing.assert_close([x["loss"] for x in resumed["losses"]],
                               [x["loss"] for x in straight["losses"][8:]], rtol=1e-4, atol=1e-5)


def _zero_moments(state):
    for entry in state["optimizer"]["state"].values():  # what a fresh AdamW would hold: no history
        entry["step"].zero_(), entry["exp_avg"].zero_(), entry["exp_avg_sq"].zero_()


def _other_weights(state):
    fresh = build_model(TrainConfig(**SMALL, seed=99)).state_dict()
    state["model"] = fresh


BAD_RESUMES = {  # what goes wrong -> (how to craft it, what the refusal says)
    "optimizer state dropped": (lambda s: s["optimizer"].update(state={}), "optimizer state is missing"),
    "optimizer state reset": (_zero_moments, "optimizer state has taken"),
    "sampler position": (lambda s: s["train"].update(consumed_samples=s["train"]["consumed_samples"] - 8),
                         "sampler position"),
    "lr jump": (lambda s: s["optimizer"]["param_groups"][0].update(lr=1.0), "learning rate jumps"),
    "step": (lambda s: s["train"].update(step=7, consumed_samples=7 * 16), "folder says step 8"),
    "weights swapped": (_other_weights, "loss is not continuous"),
}


@pytest.mark.parametrize("bad", sorted(BAD_RESUMES))
def test_each_resume_check_refuses_its_crafted_bad_checkpoint(tmp_path, bad):
    run(1, steps=8, micro_batch_size=16, checkpoint_dir=str(tmp_path))
    state = checkpoint.load(checkpoint.latest_good(tmp_path))
    craft, message = BAD_RESUMES[bad]
    craft(state)
    checkpoint.save(tmp_path, 8, state)  # a valid manifest: the files are intact, the content is wrong
    with pytest.raises(Exception, match=message):
        run(1, steps=16, micro_batch_size=16, checkpoint_dir=str(tmp_path), resume=True)


def test_fp16_resume_without_scaler_state_is_refused(tmp_path):
    run(1, steps=4, micro_batch_size=16, amp="fp16", checkpoint_dir=str(tmp_path))
    state = checkpoint.load(checkpoint.latest_good(tmp_path))
    state["scaler"] = {}
    checkpoint.save(tmp_path, 4, state)
    with pytest.raises(Exception, match="GradScaler state"):
        run(1, steps=8, micro_batch_size=16, amp="fp16", checkpoint_dir=str(tmp_path), resume=True)


def test_weights_only_resume_sees_the_same_data_but_departs(tmp_path):
    """Weights alone are not a recovery plan: same data, same lr, and still another trajectory."""
    straight = run(2, steps=16)[0]
    run(2, steps=8, checkpoint_dir=str(tmp_path))
    cfg = TrainConfig(**{**SMALL, "steps": 16, "checkpoint_dir": str(tmp_path), "resume": True})
    weights = launch(train.run, cfg, 0, "weights", world_size=2, output="none")[0]
    assert weights["resumed_from_step"] == 8 and weights["data_sha256"] == straight["data_sha256"]
    assert weights["param_sha256"] != straight["param_sha256"]
    assert weights["losses"][0]["loss"] == straight["losses"][8]["loss"]  # same weights, same batch
    assert weights["losses"][1:] != straight["losses"][9:]  # then the fresh Adam moments take over


def test_a_straggler_slows_every_rank(tmp_path):
    slow = 0.5  # large next to a step here, even on a busy machine (its own steps are the baseline)
    run(2, steps=6, metrics_dir=str(tmp_path), fail_mode="slow", fail_at_step=3, fail_rank=1, slow_step_s=slow)
    steps = metrics.read_metrics(str(tmp_path))
    fast_rank = [r for r in steps if r["rank"] == 0]
    before = statistics.median(r["step_time_s"] for r in fast_rank if 1 < r["step"] <= 3)  # after the first step's warm-up
    after = min(r["step_time_s"] for r in fast_rank if r["step"] > 3)
    assert after > slow * 0.8 and after > before + slow / 2, (before, after)  # rank 0 never slept: it waited in the all-reduce


def test_metrics_have_the_documented_fields(tmp_path):
    run(2, steps=4, metrics_dir=str(tmp_path))
    steps = metrics.read_metrics(str(tmp_path))
    assert sorted({r["rank"] for r in steps}) == [0, 1] and len(steps) == 8
    for record in steps:
        for key in ("event", "rank", "step", "loss", "lr", "step_time_s", "samples_per_s", *metrics.PHASES):
            assert key in record, key
        assert record["comm_s"] > 0 and record["comm_calls"] >= 1  # measured by the hook, not inferred


def test_phase_timer_accumulates():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(3):
        with timer("forward_s"):
            sum(range(1000))
    assert set(timer.seconds) == {"forward_s"} and timer.seconds["forward_s"] > 0


def test_phase_timer_times_each_nested_block_from_its_own_start():
    """The loss guard's sync_s runs inside optimizer_s, a hook's data_s inside the step: each block
    keeps its own start (a timer with one shared start would give the outer block only the inner's time)."""
    timer = PhaseTimer(torch.device("cpu"))
    with timer("optimizer_s"):
        time.sleep(0.02)
        with timer("sync_s"):
            time.sleep(0.02)
    assert timer.seconds["optimizer_s"] >= timer.seconds["sync_s"] + 0.02
    with pytest.raises(ZeroDivisionError), timer("data_s"):  # a failing block is still timed, and still fails
        time.sleep(0.01)
        1 / 0
    assert timer.seconds["data_s"] >= 0.01


def _both_loss_sums(ctx):
    from ddpkit.step import GlobalLossSum, global_loss_sum

    reduce = GlobalLossSum(ctx)  # one buffer for every call, as the trainer uses it
    return [(reduce(v), global_loss_sum(ctx, v)) for v in (0.1 * (ctx.rank + 1), 2.0 / 3.0 + ctx.rank, 1e-9)]


def test_the_trainers_loss_all_reduce_equals_global_loss_sum_call_after_call():
    """GlobalLossSum reuses its buffer: each call must give the fresh sum, not carry the last one over."""
    expected = [0.1 + 0.2, (2.0 / 3.0) + (2.0 / 3.0 + 1), 2e-9]
    for rank in launch(_both_loss_sums, world_size=2, output="none"):
        assert [ours for ours, _ in rank] == [reference for _, reference in rank] == expected


def test_the_log_is_skipped_only_when_it_would_write_and_print_nothing(tmp_path, capsys):
    """run_step builds the log's fields only when ``wants_step``: it must be True exactly when ``step``
    prints a row (step 1, every log_every, the last) or has a file to write."""
    ctx = type("Ctx", (), {"rank": 0, "is_main": True})()
    fields = dict(loss=1.0, lr=1e-3, samples_per_s=1.0, step_time_s=0.01)
    console = metrics.MetricsLogger(ctx, None, log_every=5)
    for step in range(1, 13):
        last = step == 12
        wanted = console.wants_step(step, last)
        console.step(step, last=last, **fields)
        assert wanted == bool(capsys.readouterr().out), step
    with_file = metrics.MetricsLogger(ctx, str(tmp_path), log_every=5, console=False)
    assert all(with_file.wants_step(step) for step in range(1, 13))
    with_file.close()


class LossWitness(Hook):
    """Records, at every step boundary, what this rank believes the step and the global loss are."""

    def __init__(self):
        self.seen = []

    def after_step(self, trainer, result):
        self.seen.append((trainer.step, result.step, result.loss))


def witnessed(ctx, cfg):
    witness = LossWitness()
    summary = Trainer(ctx, cfg, hooks=[witness]).fit()
    return {"seen": witness.seen, "losses": summary["losses"]}


def test_hooks_see_the_same_step_and_global_loss_on_every_rank():
    cfg = TrainConfig(world_size=2, **{**SMALL, "steps": 5})
    out = launch(witnessed, cfg, world_size=2, output="none")
    assert out[0]["seen"] == out[1]["seen"] and [s[0] for s in out[0]["seen"]] == [1, 2, 3, 4, 5]
    assert [s[2] for s in out[0]["seen"]] == [x["loss"] for x in out[0]["losses"]]


def test_rerunning_into_a_folder_of_newer_checkpoints_is_refused_not_corrupted(tmp_path):
    """Re-running a cell: the folder holds steps 10..40 of the first run; a fresh 10-step run must not
    save step 10 and prune it away (it used to die with FileNotFoundError)."""
    run(2, steps=40, checkpoint_dir=str(tmp_path), checkpoint_every=10)
    with pytest.raises(ddpkit.LaunchError) as info:
        run(2, steps=10, checkpoint_dir=str(tmp_path), checkpoint_every=5)
    assert info.value.is_user_error and "already holds checkpoints" in info.value.root_cause.message
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [40, 30, 20]  # untouched
    fresh = run(2, steps=10, checkpoint_dir=str(tmp_path), checkpoint_every=5, overwrite_checkpoints=True)[0]
    assert fresh["param_sha256"] == run(2, steps=10)[0]["param_sha256"]
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [10, 5]


def clocks_disagree(ctx, cfg):
    """Each rank's own clock says something else about the time since the last save; rank 0's wins."""
    trainer = Trainer(ctx, cfg)
    hook = next(h for h in trainer.hooks if isinstance(h, CheckpointEvery))
    hook.last_save = time.monotonic() - (0.0 if ctx.rank == 0 else 3600.0)  # rank 1 thinks a save is long due
    return hook.time_is_due(trainer)


def test_a_time_based_save_is_decided_by_rank_0_for_every_rank(tmp_path):
    cfg = TrainConfig(world_size=2, checkpoint_dir=str(tmp_path), checkpoint_every_s=60.0, **SMALL)
    assert launch(clocks_disagree, cfg, world_size=2, output="none") == [False, False]


def test_a_time_based_cadence_saves_by_the_clock_on_every_rank_together(tmp_path):
    """Steps get slower half-way (a straggler): a step cadence spreads its saves out in time, a time
    cadence saves more often; every rank logs the same saves and the run ends without a hang."""
    cfg = TrainConfig(world_size=2, checkpoint_dir=str(tmp_path / "ck"), metrics_dir=str(tmp_path / "m"),
                      checkpoint_every_s=0.15, fail_mode="slow", fail_rank=1, fail_at_step=6, slow_step_s=0.08,
                      **SMALL)
    launch(train.run, cfg, world_size=2, output="none")
    saves = metrics.read_metrics(str(tmp_path / "m"), event="checkpoint_saved")
    by_rank = [[e["step"] for e in saves if e["rank"] == r] for r in range(2)]
    assert by_rank[0] == by_rank[1], "the same saves on every rank"
    slow_steps = [s for s in by_rank[0] if s > 6]
    assert len(slow_steps) >= 3 and by_rank[0][-1] == cfg.steps, by_rank[0]  # 0.08 s steps: a save every ~2 steps


def test_the_default_task_visibly_learns_in_40_steps():
    losses = [x["loss"] for x in launch(train.run, TrainConfig(world_size=1), world_size=1, output="none")[0]["losses"]]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert len(losses) == 40 and last < 0.5 * first, (first, last)
