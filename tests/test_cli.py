"""The command line as users type it: real subprocesses, real torchrun."""

import json
import subprocess
import sys
import time

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
    (["--lr", "inf"], "lr must be a finite number"),
    (["--timeout", "inf"], "timeout must be a finite number"),
    (["--timeout", "1e30"], "timeout must be in (0, 86400]"),
    (["--seed", "18446744073709551615"], "seed must be in 0 .. 4294967295"),
    (["--dataset-size", "1000000000000"], "lower --dataset-size"),
    (["--checkpoint-every", "1"], "--checkpoint-every needs --checkpoint-dir"),
    (["--world-size", "100"], "world-size must be at most 64"),
    (["--num-workers", "1000"], "num-workers must be <= 32"),
    (["--slow-step-s", "-1"], "slow-step-s must be in [0, 60]"),
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
                      "--fail-mode", mode, "--max-restarts", "1",
                      # a hang is found only by the timeout; the other failures end the step at once, and a
                      # short timeout would only bound every collective of a busy machine
                      "--timeout", "3" if mode == "hang" else "60")
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


def test_paths_that_cannot_work_are_refused_before_training(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for args, message in ((["--summary-json", str(tmp_path)], "is a folder: give a file name"),
                          (["--checkpoint-dir", str(a_file)], "is a file, not a folder")):
        proc = run_cli("train", *args, timeout=30)
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert "[rank" not in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no .tmp left behind


def test_a_fresh_run_refuses_a_folder_of_checkpoints_or_starts_clean_when_asked(tmp_path, summary):
    ck = str(tmp_path / "ck")
    summary("first", "--steps", "12", "--checkpoint-dir", ck, "--checkpoint-every", "4")
    proc = run_cli("train", "--steps", "6", "--checkpoint-dir", ck, "--checkpoint-every", "2", timeout=60)
    assert proc.returncode == 2 and "[rank" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "--resume" in proc.stderr
    assert "already holds checkpoints (step-00000012" in proc.stderr and "--overwrite-checkpoints" in proc.stderr
    clean = summary("clean", "--steps", "6")
    again = summary("again", "--steps", "6", "--checkpoint-dir", ck, "--checkpoint-every", "2", "--overwrite-checkpoints")
    assert again["param_sha256"] == clean["param_sha256"] and again["resumed_from_step"] == 0
    assert [p.name for p in sorted((tmp_path / "ck").iterdir())] == ["step-00000002", "step-00000004", "step-00000006"]


def test_a_resume_that_would_change_training_is_one_line_before_any_rank_starts(tmp_path, summary):
    ck = str(tmp_path / "ck")
    summary("first", "--steps", "4", "--checkpoint-dir", ck)
    proc = run_cli("train", "--steps", "8", "--checkpoint-dir", ck, "--resume", "--lr", "0.01", timeout=60)
    assert proc.returncode == 2 and "[rank" not in proc.stdout
    assert proc.stderr.strip() == "ddpkit: error: resuming would change training (lr: 0.001 -> 0.01): use the " \
                                  "checkpoint's values or start a new --checkpoint-dir"


def test_an_error_only_the_ranks_can_see_is_still_one_line(tmp_path, summary):
    """A checkpoint whose weights were swapped (valid manifest, same config): found by the probe loss, inside the ranks."""
    from ddpkit import checkpoint
    from ddpkit.config import TrainConfig
    from ddpkit.models import build_model

    ck = tmp_path / "ck"
    summary("first", "--steps", "4", "--checkpoint-dir", str(ck))
    saved = checkpoint.load(ck / "step-00000004")
    saved["model"] = build_model(TrainConfig(seed=99)).state_dict()
    checkpoint.save(ck, 4, saved, meta=saved["meta"])
    proc = run_cli("train", "--steps", "8", "--checkpoint-dir", str(ck), "--resume", "--max-restarts", "2", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "attempt" not in proc.stderr  # not retried
    assert proc.stderr.strip().startswith("ddpkit: error: loss is not continuous") and len(proc.stderr.strip().splitlines()) == 1


def test_a_checkpoint_from_another_torch_version_warns_in_one_line(tmp_path, summary):
    from ddpkit import checkpoint

    ck = tmp_path / "ck"
    straight = summary("straight", "--steps", "8")
    summary("first", "--steps", "4", "--checkpoint-dir", str(ck))
    saved = checkpoint.load(ck / "step-00000004")
    saved["meta"]["torch_version"] = "2.4.1"
    checkpoint.save(ck, 4, saved, meta=saved["meta"])
    path = tmp_path / "resumed.json"
    proc = run_cli("train", "--steps", "8", "--checkpoint-dir", str(ck), "--resume", "--summary-json", str(path))
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stdout.splitlines() if "torch 2.4.1" in line]
    assert len(warned) == 1 and "warning" in warned[0]
    assert json.loads(path.read_text())["param_sha256"] == straight["param_sha256"]


def test_a_hang_on_a_world_of_one_is_bounded(tmp_path):
    started = time.monotonic()
    plain = run_cli("train", "--world-size", "1", "--micro-batch-size", "16", "--steps", "2", timeout=90)
    assert plain.returncode == 0, plain.stderr[-2000:]
    baseline = time.monotonic() - started  # what starting and training costs on this machine, now
    started = time.monotonic()
    proc = run_cli("train", "--world-size", "1", "--micro-batch-size", "16", "--steps", "6", "--fail-at-step", "2",
                   "--fail-mode", "hang", "--timeout", "2", timeout=90)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1 and "rank 0 stalled" in proc.stderr, proc.stderr[-2000:]
    assert "injected" in proc.stderr or "_inject" in proc.stderr or "before_step" in proc.stderr  # its own stack
    assert elapsed < baseline + 2 + 15, f"took {elapsed:.0f}s (a plain run took {baseline:.0f}s)"


def test_torchrun_restarts_without_a_checkpoint_dir_are_one_line_before_training(tmp_path):
    proc = torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m", "ddpkit", "train", "--steps", "4")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "ddpkit: error: torchrun --max-restarts needs --checkpoint-dir" in out
    assert "ValueError" not in out and "ddpkit train:" not in out  # no rank's traceback, no training started


def test_torchrun_restarts_never_resume_another_runs_checkpoints(tmp_path, summary):
    ck = tmp_path / "ck"
    summary("earlier", "--steps", "8", "--checkpoint-dir", str(ck), "--checkpoint-every", "4")
    before = sorted(p.name for p in ck.iterdir())
    proc = torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m", "ddpkit", "train",
                    "--steps", "4", "--checkpoint-dir", str(ck))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "ddpkit train:" not in out  # refused at the start and again at the restart
    assert out.count("already holds checkpoints") >= 2
    assert sorted(p.name for p in ck.iterdir()) == before


def test_resume_refuses_a_folder_of_unreadable_checkpoints_and_skips_one_without_meta(tmp_path, summary):
    """Never silently from step 0: unreadable checkpoints are one line and exit 2; a manifest without its
    meta is a skipped checkpoint, not a KeyError."""
    ck = tmp_path / "ck"
    summary("first", "--steps", "8", "--checkpoint-dir", str(ck), "--checkpoint-every", "4")
    newest = ck / "step-00000008" / "manifest.json"
    manifest = json.loads(newest.read_text())
    newest.write_text(json.dumps({k: v for k, v in manifest.items() if k != "meta"}))
    resumed = summary("resumed", "--steps", "8", "--checkpoint-dir", str(ck), "--resume")
    assert resumed["resumed_from_step"] == 4  # step 8 skipped, and set aside for the run to save it again
    assert (ck / "unreadable" / "step-00000008").is_dir()
    for path in ck.glob("step-*/manifest.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "format": 9}))
    proc = run_cli("train", "--steps", "12", "--checkpoint-dir", str(ck), "--resume", timeout=60)
    assert proc.returncode == 2 and "[rank" not in proc.stdout, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "none of them verifies" in proc.stderr, proc.stderr
