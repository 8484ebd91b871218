"""Preemption: a SIGTERM to the train process (twice), or to one rank under torchrun, saves at one step
agreed by all ranks and exits 75; the resume is bitwise an uninterrupted run. A decision taken per rank
deadlocks, bounded by the collective timeout."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ddpkit import preemption
from ddpkit.config import TrainConfig
from ddpkit.failures import LaunchError
from ddpkit.launch import launch
from ddpkit.metrics import read_metrics
from tests.conftest import REPO, cli_env
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
    saved = sorted(p.name for p in ck.iterdir())
    assert len(saved) == 1 and saved[0] in line and "--resume" in line and line.startswith("ddpkit: preempted")
    step = int(saved[0].split("-")[1])
    assert 0 < step < 300 and f"after step {step} " in line
    ranks = {r["rank"]: r["step"] for r in read_metrics(str(metrics), "preempted")}
    assert ranks == {0: step, 1: step}, "every rank stopped after the same step"
    resumed = json.loads(json.dumps(summary("resumed", *args[1:], "--resume")))
    assert resumed["resumed_from_step"] == step and resumed["param_sha256"] == clean["param_sha256"]


def test_notice_to_one_worker_under_torchrun_stops_every_rank_at_one_step(tmp_path, summary):
    clean = summary("clean", "--steps", "10")
    ck, out_json = tmp_path / "ck", tmp_path / "tr.json"
    common = ["-m", "ddpkit", "train", "--steps", "10", "--checkpoint-dir", str(ck), "--summary-json", str(out_json)]
    proc = torchrun("--standalone", "--nproc-per-node", "2", *common, "--fail-mode", "sigterm",
                    "--fail-at-step", "3", "--fail-rank", "1")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "preempted: every rank stopped after step 4" in out, out[-3000:]
    assert "exitcode  : 75" in out or "exit code 75" in out.lower() or ": 75" in out, out[-3000:]
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000004"]
    proc = torchrun("--standalone", "--nproc-per-node", "2", *common, "--resume")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    resumed = json.loads(out_json.read_text())
    assert resumed["resumed_from_step"] == 4 and resumed["param_sha256"] == clean["param_sha256"]


def test_a_decision_taken_per_rank_hangs_until_the_timeout_and_the_agreed_one_saves(tmp_path):
    cfg = TrainConfig(steps=20, checkpoint_dir=str(tmp_path / "ck"), log_every=100, timeout=3)
    started = time.monotonic()
    with pytest.raises(LaunchError):
        launch(preemption.per_rank_decision_demo, cfg, kwargs={"agree": False}, world_size=2, timeout=3, output="none")
    assert time.monotonic() - started < 3 + 10 + 15, "bounded by the collective timeout, or the stall limit after it"
    agreed = launch(preemption.per_rank_decision_demo, cfg.replace(checkpoint_dir=str(tmp_path / "ok")),
                    kwargs={"agree": True}, world_size=2, timeout=10, output="none")
    assert [r["stopped_at"] for r in agreed] == [2, 2] and [r["emergency_checkpoint_step"] for r in agreed] == [2, 2]
    assert os.listdir(tmp_path / "ok") == ["step-00000002"]


def test_resume_command_drops_what_a_resume_refuses():
    assert preemption.resume_command(["train", "--overwrite-checkpoints", "--checkpoint-dir", "a b"]) == \
        "ddpkit train --checkpoint-dir 'a b' --resume"
