"""Every point-to-point pattern of the kit, recorded from real ranks and replayed under NCCL's rule that a
send completes only when its receive is posted: the pipeline (ours at every layout, torch's GPipe and
1F1B), the hand ring, the full checkpoint's gather, the ring exercise's solution; and the old orders
that this rule catches."""

import pytest
import torch.distributed as dist

from ddpkit import train
from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.parallel import comm, pipeline
from ddpkit.parallel.pipeline import schedule
from ddpkit.parallel.pipeline_strategy import PipelineStrategy, exchange_plan
from ddpkit.parallel.rendezvous import Deadlock, Op, check, recorded, replay
from ddpkit.train import Trainer
from tests.test_exercises import load

GPT = dict(model="gpt", dataset_size=256, steps=2, log_every=100)
PAIR = (0, 1)


def test_the_pipeline_order_the_nccl_docs_warn_about_deadlocks_and_a_batched_one_does_not():
    def send(peer, n=4096):
        return Op("send", PAIR, peer, n)

    def recv(peer, n=4096):
        return Op("recv", PAIR, peer, n)

    one_at_a_time = [[[send(1)], [send(1)], [recv(1)], [recv(1)]],  # stage 0: S(a0) S(a1) R(g0) R(g1)
                     [[recv(0)], [send(0)], [recv(0)], [send(0)]]]  # stage 1: R(a0) S(g0) R(a1) S(g1)
    with pytest.raises(Deadlock) as caught:
        replay(one_at_a_time)
    assert set(caught.value.stuck) == {0, 1} and "send->1" in str(caught.value) and "send->0" in str(caught.value)
    assert replay(one_at_a_time, eager_bytes=4096) == 8  # small enough for NCCL's buffers: it passes
    batched = [[[send(1)], [send(1), recv(1)], [recv(1)]], [[recv(0)], [send(0), recv(0)], [send(0)]]]
    assert replay(batched) == 8


def _plans(name: str, p: int, m: int, batched: bool) -> list:
    ranks = tuple(range(p))
    out = []
    for s, order in enumerate(schedule(name, p, m)):
        batches = [[Op(x.kind, ranks, x.peer, 1) for x in batch] for batch in exchange_plan(order, s, p)]
        out.append([b for b in batches if b] if batched else [[op] for b in batches for op in b])
    return out


@pytest.mark.parametrize("name", pipeline.SCHEDULES)
def test_every_schedule_plan_is_deadlock_free_when_batched_and_not_one_at_a_time(name):
    for p in range(2, 9):
        for m in range(1, 13):
            replay(_plans(name, p, m, batched=True))
    with pytest.raises(Deadlock):
        replay(_plans("1f1b", 2, 2, batched=False))


def _ops_of_stage(results):
    return [[op for batch in r["ops"] for op in batch if op.kind in ("send", "recv")] for r in results]


@pytest.mark.parametrize("world, layout", [(2, dict(pp=2)), (4, dict(pp=2)), (4, dict(pp=2, tp=2)),
                                           (4, dict(pp=4, n_layers=4)), (2, dict(cp=2)), (4, dict(cp=2, tp=2)),
                                           (4, dict(cp=2, pp=2))],
                         ids=["pp2", "pp2-dp2", "pp2-tp2", "pp4", "cp2", "cp2-tp2", "cp2-pp2"])
def test_the_trainer_pipeline_is_deadlock_free_at_every_layout(world, layout):
    cfg = TrainConfig(world_size=world, grad_accum=3, micro_batch_size=2, **GPT, **layout)
    results = launch(recorded, train.run, cfg, world_size=world, output="none")
    assert check(results) > 0  # every rank's messages, collectives (dp, tp, pp) included


def _unbatched(ctx, cfg):
    PipelineStrategy.batch_messages = False  # this rank only: the order that hangs on NCCL
    return train.run(ctx, cfg)


def test_the_old_one_at_a_time_pipeline_is_caught_and_passed_a_gpu_test_only_by_being_small():
    cfg = TrainConfig(world_size=2, pp=2, grad_accum=2, micro_batch_size=2, **GPT)
    results = launch(recorded, _unbatched, cfg, world_size=2, output="none")
    with pytest.raises(Deadlock, match="rank 0 waits in .*send->1.*rank 1 waits in .*send->0"):
        check(results)
    activation = 2 * cfg.seq_len * cfg.d_model * 4  # one micro-batch's (B, T, C) in fp32
    assert check(results, eager_bytes=activation) > 0  # within NCCL's buffers it completes


def _torch_pipeline(ctx, cfg, name):
    return pipeline.run_pipeline(ctx, cfg, name, 4, 2)


@pytest.mark.parametrize("name", [n for n in pipeline.SCHEDULES if n in pipeline.runnable_schedules()])
@pytest.mark.parametrize("stages", [2, 3])
def test_torch_pipelining_schedules_are_deadlock_free(name, stages):
    results = launch(recorded, _torch_pipeline, TrainConfig(model="gpt", n_layers=4), name, world_size=stages,
                     output="none")
    assert check(results) > 0 and all(any(op.kind == "send" for op in ops) for ops in _ops_of_stage(results)[:-1])


def _ring(ctx, batched):
    comm.BATCHED = batched
    return comm.check_ring(ctx, [5, 4096])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_hand_ring_is_deadlock_free_and_its_old_order_hangs_at_two_ranks(world):
    results = launch(recorded, _ring, True, world_size=world, output="none")
    assert all(row["bitwise"] for r in results for row in r["result"]) and check(results) > 0
    if world == 2:
        with pytest.raises(Deadlock):
            check(launch(recorded, _ring, False, world_size=2, output="none"))


def _full_save(ctx, cfg):
    trainer = Trainer(ctx, cfg)
    trainer.prepare()
    trainer.run_step()
    model_state, _ = trainer.strategy.state_dicts(trainer.model, trainer.optimizer)  # gathered to rank 0
    return len(model_state)


def test_gathering_a_full_checkpoint_to_rank_zero_is_deadlock_free():
    results = launch(recorded, _full_save, TrainConfig(world_size=2, pp=2, **GPT), world_size=2, output="none")
    assert results[0]["result"] > 0 and results[1]["result"] == 0 and check(results) > 0


def test_the_ring_exercise_solution_is_deadlock_free():
    ring_all_reduce = load("09_ring_all_reduce.ipynb", "ring_all_reduce")

    def run(ctx):
        import torch

        t = torch.arange(10, dtype=torch.float32) + ctx.rank
        ring_all_reduce(t)
        expected = torch.arange(10, dtype=torch.float32) * ctx.world_size + sum(range(ctx.world_size))
        assert torch.equal(t, expected) and dist.get_world_size() == ctx.world_size
        return True

    for world in (2, 3):
        assert check(launch(recorded, run, world_size=world, output="none")) > 0
