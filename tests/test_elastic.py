"""Elastic torchrun: the accumulation that keeps the global batch when the world changes, the resume of a
later round, and the refusals without them.

The two-agent drill itself (a node killed, the job on one node, grown back, ``data_sha256`` equal to an
uninterrupted run's, no step lost on the grow-back) runs in notebook 21, checked by
``tests/test_notebooks.py``; these tests are the cheap parts, and the negative controls: without the
adjustment the resumed job's global batch differs, and the trainer refuses to resume; without the
later-round resume, the worker of a node that joins (its agent's restart count is 0) refuses the
job's own checkpoints.
"""

import pytest

from ddpkit import checkpoint, cli, elastic, preemption, state
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


def checkpoint_of(job: str, folder, monkeypatch, step: int = 21) -> TrainConfig:
    """A checkpoint that job ``job`` wrote at ``step`` (its meta says so) in ``folder``; the config it was written with."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
    cfg = config(2, elastic.worker_argv([], 16, 2))
    checkpoint.save(folder, step, {"step": step}, meta=state.meta(cfg))
    return cfg


def joining_worker(folder, resume: bool) -> TrainConfig:
    """The config of the worker a joining agent starts: world 2, torchrun's restart count 0."""
    argv = elastic.worker_argv(["--micro-batch-size", "8", "--checkpoint-dir", str(folder)], 16, 2, resume=resume)
    return cli.config_from_args(cli.build_parser().parse_args(argv))


def test_a_later_round_is_told_by_the_jobs_own_checkpoint(tmp_path, monkeypatch):
    assert not elastic.later_round(str(tmp_path), "job-1")  # no checkpoint: the first round
    checkpoint_of("job-1", tmp_path, monkeypatch)
    (tmp_path / "step-00000025").mkdir()  # a save that never finished (no manifest): not the job's newest
    assert elastic.later_round(str(tmp_path), "job-1")
    assert not elastic.later_round(str(tmp_path), "job-2") and not elastic.later_round(str(tmp_path), None)


def test_the_worker_of_a_joining_node_resumes_the_jobs_checkpoint(tmp_path, monkeypatch):
    checkpoint_of("job-1", tmp_path, monkeypatch)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    cfg = joining_worker(tmp_path, resume=elastic.later_round(str(tmp_path), "job-1"))
    assert cfg.resume
    cli.check_before_launch(cfg, attempt=0)  # accepted: same job, same global batch


def test_negative_control_without_the_later_round_resume_a_joining_node_refuses_its_jobs_checkpoint(tmp_path,
                                                                                                     monkeypatch):
    checkpoint_of("job-1", tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        cli.check_before_launch(joining_worker(tmp_path, resume=False), attempt=0)


def test_every_agent_of_a_job_that_may_grow_opts_out_of_the_shared_store():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    # the property torchrun's agent reads to decide whether workers use its store (and so whether the
    # bootstrap store info is built once, or every round)
    with pytest.MonkeyPatch.context() as env:
        for name, value in elastic.AGENT_ENV.items():
            env.setenv(name, value)
        assert DynamicRendezvousHandler.use_agent_store.fget(None) is False
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
        assert DynamicRendezvousHandler.use_agent_store.fget(None) is True


def test_under_torchrun_the_preempted_line_says_a_scale_up_needs_nothing():
    plain = preemption.preempted_line(21, True, "ck/step-00000021", "ddpkit train --resume")
    under = preemption.preempted_line(21, True, "ck/step-00000021", "torchrun -m ddpkit train --resume",
                                      under_torchrun=True)
    assert "membership change" not in plain and plain.endswith("resume with: ddpkit train --resume")
    assert "membership change" in under and under.endswith("resume with: torchrun -m ddpkit train --resume")


def test_a_worker_knows_when_its_process_began():
    import time

    started = elastic.process_start_time()
    assert started is not None and time.time() - 24 * 3600 < started <= time.time()


def test_an_agent_forked_from_this_process_writes_only_to_its_own_file_and_ends_with_torchruns_code(tmp_path, capfd):
    import os

    from ddpkit import elastic_drill

    helped, refused = tmp_path / "help.out", tmp_path / "refused.out"
    assert elastic_drill.fork_agent(["--help"], dict(os.environ), str(helped)).wait(120) == 0
    assert elastic_drill.fork_agent(["--nnodes"], dict(os.environ), str(refused)).wait(120) == 2  # argparse's code
    assert "--nproc-per-node" in helped.read_text() and "error: argument --nnodes" in refused.read_text()
    seen = capfd.readouterr()
    assert "--nproc-per-node" not in seen.out + seen.err and "error:" not in seen.out + seen.err
