"""Preemption: a SIGTERM to the train process (twice), or to one rank under torchrun, saves at one step
agreed by all ranks and exits 75; the resume is bitwise an uninterrupted run. A decision taken per rank
deadlocks, bounded by the collective timeout."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from ddpkit import checkpoint, cli, preemption
from ddpkit.config import TrainConfig
from ddpkit.hooks import Hook
from ddpkit.failures import LaunchError
from ddpkit.launch import launch
from ddpkit.metrics import read_metrics
from ddpkit.train import Trainer
from ddpkit.preemption import Preemption
from tests.conftest import REPO, cli_env, run_cli
from tests.test_cli import torchrun


def test_sigterm_twice_to_the_train_process_saves_one_step_and_the_resume_is_exact(tmp_path, summary):
    clean = summary("clean", "--steps", "300")
    ck, metrics = tmp_path / "ck", tmp_path / "metrics"
    args = ["train", "--steps", "300", "--checkpoint-dir", str(ck), "--metrics-dir", str(metrics)]
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", *args], cwd=REPO, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (metrics.exists() and len(read_metrics(str(metrics))) >= 10):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # a second notice, while the ranks agree and save: changes nothing
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == preemption.PREEMPTED_EXIT, err[-3000:]
    line = err.strip().splitlines()[-1]
    saved = sorted(p.name for p in ck.iterdir() if p.name != preemption.MARKER)
    assert len(saved) == 1 and saved[0] in line and "--resume" in line and line.startswith("ddpkit: preempted")
    step = int(saved[0].split("-")[1])
    assert 0 < step < 300 and f"after step {step} " in line
    ranks = {r["rank"]: r["step"] for r in read_metrics(str(metrics), "preempted")}
    assert ranks == {0: step, 1: step}, "every rank stopped after the same step"
    resumed = json.loads(json.dumps(summary("resumed", *args[1:], "--resume")))
    assert resumed["resumed_from_step"] == step and resumed["param_sha256"] == clean["param_sha256"]


def test_notice_to_one_worker_under_torchrun_stops_every_rank_and_prints_the_torchrun_that_resumes(tmp_path, summary):
    """torchrun exits 1 whatever code a worker ended with (75 here): the marker file says it was a
    preemption, and the printed command (torchrun's own, without the fault flags) resumes bitwise."""
    clean = summary("clean", "--steps", "10")
    ck, out_json = tmp_path / "ck", tmp_path / "tr.json"
    common = ["-m", "ddpkit", "train", "--steps", "10", "--checkpoint-dir", str(ck), "--summary-json", str(out_json)]
    proc = torchrun("--standalone", "--nproc-per-node", "2", *common, "--fail-mode", "sigterm",
                    "--fail-at-step", "3", "--fail-rank", "1")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "preempted: every rank stopped after step 4" in out, out[-3000:]
    assert "exitcode  : 75" in out, out[-3000:]
    assert [p.name for p in checkpoint.list_checkpoints(ck)] == ["step-00000004"]
    marker = json.loads((ck / preemption.MARKER).read_text())
    command = shlex.split(marker["resume_command"])
    assert marker["preempted_after_step"] == 4 and marker["resume_command"] in out
    assert command[0] == "torchrun" and command[-1] == "--resume" and not any(a.startswith("--fail") for a in command)
    proc = torchrun(*command[1:])  # the printed command, as typed (torchrun is ``python -m torch.distributed.run``)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    resumed = json.loads(out_json.read_text())
    assert resumed["resumed_from_step"] == 4 and resumed["param_sha256"] == clean["param_sha256"]
    assert not (ck / preemption.MARKER).exists()


def test_a_decision_taken_per_rank_hangs_until_the_timeout_and_the_agreed_one_saves(tmp_path):
    cfg = TrainConfig(steps=20, checkpoint_dir=str(tmp_path / "ck"), log_every=100, timeout=3)
    started = time.monotonic()
    with pytest.raises(LaunchError):
        launch(preemption.per_rank_decision_demo, Trainer, cfg, kwargs={"agree": False}, world_size=2, timeout=3, output="none")
    assert time.monotonic() - started < 3 + 10 + 15, "bounded by the collective timeout, or the stall limit after it"
    agreed = launch(preemption.per_rank_decision_demo, Trainer, cfg.replace(checkpoint_dir=str(tmp_path / "ok")),
                    kwargs={"agree": True}, world_size=2, timeout=10, output="none")
    assert [r["stopped_at"] for r in agreed] == [2, 2] and [r["emergency_checkpoint_step"] for r in agreed] == [2, 2]
    assert os.listdir(tmp_path / "ok") == ["step-00000002"]


def test_resume_command_drops_what_a_resume_refuses_and_the_injected_faults():
    assert preemption.resume_command(["train", "--overwrite-checkpoints", "--checkpoint-dir", "a b"]) == \
        "ddpkit train --checkpoint-dir 'a b' --resume"
    argv = ["train", "--fail-mode", "sigterm", "--fail-at-step=3", "--steps", "9", "--fail-rank", "1", "--resume"]
    assert preemption.resume_command(argv, ["torchrun", "--standalone"]) == "torchrun --standalone train --steps 9 --resume"


class NoticeBefore(Hook):
    """SIGTERM to this rank before step ``step`` runs (a notice that lands on a chosen step)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def before_step(self, trainer) -> None:
        if trainer.ctx.rank == self.rank and trainer.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def noticed(ctx, cfg, rank, step):
    return Trainer(ctx, cfg, hooks=[NoticeBefore(rank, step)]).fit()


def test_a_notice_at_a_rejected_step_saves_nothing_and_names_the_newest_good_checkpoint(tmp_path, capsys):
    """The weights are damaged before step 13 (a spike the guard rejects) and the notice comes during it."""
    ck = tmp_path / "ck"
    cfg = TrainConfig(steps=30, dataset_size=1024, log_every=100, nan_guard=True, checkpoint_dir=str(ck),
                      checkpoint_every=5, fail_mode="spike", fail_at_step=12)
    out = launch(noticed, cfg, 1, 12, world_size=2, output="none")[0]
    assert out["guard_events"][0] == {"step": 13, "reason": "spike", "action": "skip"}
    assert (out["preempted_at_step"], out["emergency_checkpoint_step"], out["steps"]) == (13, None, 13)
    assert [p.name for p in checkpoint.list_checkpoints(ck)] == ["step-00000010", "step-00000005"]
    assert cli._preempted(cfg, out, ["train", "--checkpoint-dir", str(ck)]) == preemption.PREEMPTED_EXIT
    line = capsys.readouterr().err.strip()
    assert "after step 13, which the loss guard rejected, so nothing was saved" in line and "step-00000010" in line
    marker = json.loads((ck / preemption.MARKER).read_text())
    assert (marker["preempted_after_step"], marker["saved"], marker["checkpoint"]) == (13, False, "step-00000010")


def test_a_notice_at_the_last_step_of_a_finished_run_exits_0(tmp_path):
    proc = run_cli("train", "--steps", "6", "--checkpoint-dir", str(tmp_path / "ck"), "--fail-mode", "sigterm",
                   "--fail-at-step", "5", "--fail-rank", "1", timeout=90)
    assert proc.returncode == 0 and "preempted" not in proc.stderr, proc.stderr[-2000:]
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step-00000006"]


def _group_is_gone(pgid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_to_the_process_group_with_dataloader_workers_saves_and_resumes(tmp_path, summary):
    """``kill -- -PGID``: the command, its ranks and their DataLoader workers all get SIGTERM. The workers
    leave it to their rank (they would die with "worker killed by signal: Terminated"), and die with it."""
    clean = summary("clean", "--steps", "300", "--num-workers", "1")
    ck, metrics = tmp_path / "ck", tmp_path / "metrics"
    args = ["train", "--steps", "300", "--num-workers", "1", "--checkpoint-dir", str(ck), "--metrics-dir", str(metrics)]
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", *args], cwd=REPO, env=cli_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (metrics.exists() and len(read_metrics(str(metrics))) >= 10):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == preemption.PREEMPTED_EXIT, err[-3000:]
    assert _group_is_gone(proc.pid), "a DataLoader worker outlived its rank"
    step = int(json.loads((ck / preemption.MARKER).read_text())["preempted_after_step"])
    resumed = summary("resumed", *args[1:], "--resume")
    assert resumed["resumed_from_step"] == step and resumed["param_sha256"] == clean["param_sha256"]
    assert not (ck / preemption.MARKER).exists(), "a resumed run is no longer waiting to be resumed"


def handlers_in_a_rank(ctx, cfg, early_notice):
    """What a rank started under the forwarding command sees: its SIGTERM handler at start, and after a
    trainer ran (and gave the signal back); with ``early_notice`` rank 1 gets SIGTERM before any trainer."""
    at_start = signal.getsignal(signal.SIGTERM)
    if early_notice and ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    Trainer(ctx, cfg).fit()
    return {"at_start": repr(at_start), "after": repr(signal.getsignal(signal.SIGTERM))}


def test_ranks_start_with_the_default_sigterm_and_an_early_notice_is_not_swallowed(tmp_path):
    cfg = TrainConfig(steps=3, dataset_size=256, log_every=100, checkpoint_dir=str(tmp_path / "a"))
    with preemption.passed_on_to_ranks():
        out = launch(handlers_in_a_rank, cfg, False, world_size=2, output="none")
        assert {r["at_start"] for r in out} == {r["after"] for r in out} == {repr(signal.SIG_DFL)}, out
        with pytest.raises(LaunchError) as info:  # before: the forwarder swallowed it and the run went on
            launch(handlers_in_a_rank, cfg.replace(checkpoint_dir=str(tmp_path / "b")), True, world_size=2,
                   output="none")
    assert (info.value.root_cause.rank, info.value.root_cause.exc_type) == (1, "SIGTERM")
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        Preemption().install().uninstall()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # uninstall restores what was there
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_without_a_checkpoint_dir_sigterm_stops_the_command_promptly_with_143(tmp_path):
    metrics = tmp_path / "metrics"
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "--steps", "100000", "--dataset-size", "512",
                             "--metrics-dir", str(metrics)], cwd=REPO, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (metrics.exists() and len(read_metrics(str(metrics))) >= 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("SIGTERM was ignored: the run went on")
    assert proc.returncode == preemption.TERMINATED_EXIT, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("ddpkit: stopped by SIGTERM (no --checkpoint-dir")
