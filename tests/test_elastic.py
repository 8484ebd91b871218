"""Elastic torchrun: the accumulation that keeps the global batch when the world changes, and the refusal without it.

The two-agent drill itself (a node killed, the job on one node, grown back, ``data_sha256`` equal to an
uninterrupted run's) runs in notebook 21, checked by ``tests/test_notebooks.py``; these tests are the cheap
parts, and the negative control: without the adjustment the resumed job's global batch differs, and the
trainer refuses to resume.
"""

import pytest

from ddpkit import elastic, state
from ddpkit.config import TrainConfig
from ddpkit.checkpoint import CheckpointError


def config(world: int, train_argv: list[str]) -> TrainConfig:
    accum = elastic._flag(train_argv, "--grad-accum", "1")
    return TrainConfig(world_size=world, micro_batch_size=8, grad_accum=int(accum))


@pytest.mark.parametrize("world,accum", [(1, 2), (2, 1)])
def test_accumulation_keeps_micro_x_accum_x_world(world, accum):
    assert elastic.accumulation(16, 8, world) == accum
    argv = elastic.worker_argv(["--micro-batch-size", "8"], 16, world)
    assert config(world, argv).global_batch_size == 16


def test_a_global_batch_a_world_size_does_not_divide_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="every world size in --nnodes divides"):
        elastic.accumulation(16, 8, 3)
    with pytest.raises(ValueError, match="--global-batch-size instead"):
        elastic.worker_argv(["--grad-accum", "2"], 16, 2)


def test_resuming_on_one_node_is_accepted_with_the_adjustment():
    saved = state.meta(config(2, elastic.worker_argv([], 16, 2)))
    state.check_compatible(saved, config(1, elastic.worker_argv([], 16, 1)))  # no error: same global batch


def test_negative_control_without_the_adjustment_the_global_batch_changes_and_the_resume_is_refused():
    saved = state.meta(config(2, elastic.worker_argv([], 16, 2)))
    shrunk = config(1, elastic.worker_argv([], 16, 1, adjust=False))
    assert shrunk.global_batch_size == 8
    with pytest.raises(CheckpointError, match="keep micro x accum x world = 16"):
        state.check_compatible(saved, shrunk)


def test_the_worker_refuses_outside_torchrun(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert elastic.main(["--global-batch-size", "16", "--", "--steps", "2"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_each_agent_says_whether_it_hosts_the_rendezvous_store():
    host = elastic.agent_command(29400, "job", 16, ["--steps", "2"], is_host=True)
    other = elastic.agent_command(29400, "job", 16, ["--steps", "2"], is_host=False)
    conf = lambda cmd: cmd[cmd.index("--rdzv-conf") + 1]  # noqa: E731
    assert "is_host=true" in conf(host) and "is_host=false" in conf(other)
    assert host[host.index("--nnodes") + 1] == "1:2" and host[-2:] == ["--steps", "2"]
