"""The command line as users type it: real subprocesses, real torchrun."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, cli_env, run_cli
from ddpkit.launch import free_port


@pytest.mark.parametrize("args, message", [
    (["--world-size", "0"], "world-size must be >= 1"),
    (["--steps", "-3"], "steps must be >= 0"),
    (["--micro-batch-size", "5000"], "larger than the dataset"),
    (["--backend", "nccl"], "--backend gloo"),
    (["--model", "resnet"], "invalid choice"),
    (["--checkpoint-dir", "/proc/forbidden"], "not writable"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--max-restarts", "1"], "--max-restarts needs --checkpoint-dir"),
    (["--lr", "fast"], "invalid float value"),
])
def test_bad_input_is_one_line_and_no_traceback(args, message):
    proc = run_cli("train", *args, timeout=30)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "[rank" not in proc.stdout  # nothing was spawned


def test_train_prints_a_loss_table_and_writes_the_summary(summary):
    s = summary("run", "--steps", "40")
    for key in ("world_size", "backend", "global_batch_size", "steps", "losses", "param_sha256",
                "param_l2", "data_sha256", "resumed_from_step", "restarts"):
        assert key in s, key
    assert (s["world_size"], s["backend"], s["steps"], s["global_batch_size"]) == (2, "gloo", 40, 16)
    losses = [x["loss"] for x in s["losses"]]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.1  # it learns


@pytest.mark.parametrize("mode", ["raise", "exit", "kill", "hang"])
def test_a_crash_restarts_from_the_last_checkpoint_and_ends_the_same(summary, tmp_path, mode):
    clean = summary("clean", "--steps", "12")
    crashed = summary(f"crash-{mode}", "--steps", "12", "--checkpoint-dir", str(tmp_path / "ck"),
                      "--checkpoint-every", "5", "--fail-at-step", "7", "--fail-rank", "1",
                      "--fail-mode", mode, "--max-restarts", "1", "--timeout", "3")
    assert crashed["restarts"] == 1 and crashed["resumed_from_step"] == 5
    assert crashed["param_sha256"] == clean["param_sha256"]
    assert crashed["data_sha256"] == clean["data_sha256"]


def test_without_restarts_the_failure_names_the_rank(tmp_path):
    proc = run_cli("train", "--steps", "12", "--fail-at-step", "3", "--fail-rank", "1", timeout=60)
    assert proc.returncode == 1
    assert "rank 1 raised: InjectedFailure: injected failure after step 3 on rank 1" in proc.stderr


def torchrun(*args: str, timeout: float = 120) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], cwd=REPO,
                            env=cli_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_torchrun_single_and_two_node_match_the_launcher(tmp_path):
    common = ["--steps", "10"]
    launcher = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--world-size", "2", *common,
                               "--summary-json", str(tmp_path / "l.json")], cwd=REPO, timeout=120,
                              env=cli_env(OMP_NUM_THREADS="1"), capture_output=True, text=True)
    assert launcher.returncode == 0, launcher.stderr
    single = torchrun("--standalone", "--nproc-per-node", "2", "-m", "ddpkit", "train", *common,
                      "--summary-json", str(tmp_path / "s.json"))
    out, _ = single.communicate(timeout=120)
    assert single.returncode == 0, out
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", endpoint, "--rdzv-id", "ddpkit-test", "-m", "ddpkit", "train",
                      *common, "--summary-json", str(tmp_path / "m.json")) for _ in range(2)]
    for node in nodes:
        out, _ = node.communicate(timeout=120)
        assert node.returncode == 0, out
    hashes = {json.loads((tmp_path / f"{n}.json").read_text())["param_sha256"] for n in "lsm"}
    assert len(hashes) == 1


def test_torchrun_restarts_a_killed_rank_and_ends_the_same(tmp_path, summary):
    """torchrun keeps its store across --max-restarts; each restart must use its own keys (twice, as it was flaky)."""
    clean = summary("clean", "--steps", "14")
    for attempt in range(2):
        ck, out_json = tmp_path / f"ck{attempt}", tmp_path / f"tr{attempt}.json"
        proc = torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m", "ddpkit", "train",
                        "--steps", "14", "--checkpoint-dir", str(ck), "--checkpoint-every", "5", "--fail-at-step", "7",
                        "--fail-rank", "1", "--fail-mode", "kill", "--timeout", "10", "--summary-json", str(out_json))
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]
        restarted = json.loads(out_json.read_text())
        assert restarted["restarts"] == 1 and restarted["resumed_from_step"] == 5
        assert restarted["param_sha256"] == clean["param_sha256"]
