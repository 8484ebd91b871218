"""Torture tests, bounded in time: SIGKILL at random instants of a save (full and dcp) never leaves a
torn checkpoint that a resume would load; SIGTERM at random steps (to one rank, or to every rank and
DataLoader worker at once) always resumes bitwise; a disk that fills during a save gives one clear error
and leaves the previous checkpoint intact."""

import errno
import json
import multiprocessing
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from ddpkit import checkpoint, runtime, sharded_checkpoint, train
from ddpkit.config import TrainConfig
from ddpkit.files import write_atomic
from ddpkit.hooks import Hook
from ddpkit.launch import free_port, launch
from tests.conftest import REPO, cli_env, run_cli

NUMEL = 1 << 20  # 4 MiB per tensor: a save takes long enough for a kill to land inside it
INSIDE = 25  # kills that must land inside a save: the test's power, whatever the machine's load
MAX_KILLS = 150  # a bound on the attempts: under load more kills land between saves


def _state(step: int) -> tuple[dict, dict]:
    model = {"w": torch.full((NUMEL,), float(step))}
    optimizer = {"state": {"w": {"exp_avg": torch.full((NUMEL,), float(step))}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    return model, optimizer


def _resume_then_save_forever(root: str, fmt: str, report: str, port: int) -> None:
    """A writer that first resumes (loads the newest good checkpoint and checks it holds its own step's
    values), reports, then saves step after step until it is killed."""
    torch.set_num_threads(1)  # forked from a process whose OpenMP pool may be live: a parallel op would hang
    ctx = None
    if fmt == "dcp":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        ctx = runtime.init_process_group(runtime.RankContext(0, 0, 1, 1, "gloo", torch.device("cpu")), 10)
    newest, step, intact = checkpoint.latest_good(root), 0, True
    if newest is not None:
        step = checkpoint.step_of(newest)
        if fmt == "dcp":
            model, optimizer = _state(-1)
            saved = sharded_checkpoint.load(ctx, newest, model, optimizer)
        else:
            saved = checkpoint.load(newest)
        tensors = [saved["model"]["w"], saved["optimizer"]["state"]["w"]["exp_avg"]]
        intact = all(torch.equal(t, torch.full_like(t, float(step))) for t in tensors) and saved["rng"] == step
    write_atomic(report, json.dumps({"step": step, "intact": intact}).encode())
    while True:
        step += 1
        model, optimizer = _state(step)
        if fmt == "dcp":
            sharded_checkpoint.save(ctx, root, step, model, optimizer, {"rng": step}, {}, keep_last=2)
        else:
            checkpoint.save(root, step, {"model": model, "optimizer": optimizer, "rng": step}, keep_last=2)


@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_sigkill_at_random_instants_of_a_save_never_loads_a_torn_checkpoint(tmp_path, fmt):
    rng, root, report = random.Random(7), str(tmp_path / "ck"), str(tmp_path / "report.json")
    context = multiprocessing.get_context("fork")
    torn, inside_a_save, kill = 0, 0, 0
    while inside_a_save < INSIDE and kill < MAX_KILLS:
        kill += 1
        complete = [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(root)] if os.path.isdir(root) else []
        if os.path.exists(report):
            os.remove(report)
        writer = context.Process(target=_resume_then_save_forever, args=(root, fmt, report, free_port()))
        writer.start()
        deadline = time.monotonic() + 30
        while not os.path.exists(report) and writer.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert os.path.exists(report), f"kill {kill}: the writer did not resume (exit code {writer.exitcode})"
        resumed = json.loads(open(report).read())
        torn += not resumed["intact"]
        assert resumed["step"] == max(complete, default=0), f"kill {kill}: the resume skipped a complete checkpoint"
        time.sleep(rng.uniform(0.02, 0.3))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        left = set(os.listdir(root)) if os.path.isdir(root) else set()  # killed before its first save began
        inside_a_save += any(name.startswith(".tmp-") for name in left)  # killed mid-save (earlier ones are gone)
        for name in left:  # a dead writer's temporary folder is never a candidate, so it can go
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    assert torn == 0
    print(f"{inside_a_save} of {kill} kills landed inside a save")
    assert inside_a_save >= INSIDE, f"only {inside_a_save} of {kill} kills landed inside a save"


class NoticeToEveryProcess(Hook):
    """Before step ``step``, rank 0 sends SIGTERM to every process of the job but the launcher (this test
    process): every rank and every DataLoader worker, what ``kill -- -PGID`` does to them (the launcher's
    own part, passing the notice on, is tested through the command line in test_preemption.py)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def before_step(self, trainer) -> None:
        if trainer.ctx.rank == 0 and trainer.step == self.step:
            for pid in sorted(_descendants(os.getppid())):
                os.kill(pid, signal.SIGTERM)


def _descendants(pid: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parents[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found.add(child)
                todo.append(child)
    return found


def notice_to_every_process(ctx, cfg, step):
    return train.Trainer(ctx, cfg, hooks=[NoticeToEveryProcess(step)]).fit()


def test_sigterm_at_random_steps_always_resumes_bitwise(tmp_path):
    """The notice to one rank, or to every rank and DataLoader worker at once; with and without workers."""
    rng = random.Random(11)
    base = TrainConfig(steps=12, dataset_size=512, log_every=100)
    clean = launch(train.run, base, world_size=2, output="none")[0]["param_sha256"]
    kinds = []
    for trial in range(20):
        step, rank, fmt = rng.randrange(0, 11), rng.randrange(2), rng.choice(["full", "dcp"])
        workers, everyone = rng.choice([0, 1]), trial % 2 == 1
        cfg = base.replace(checkpoint_dir=str(tmp_path / f"t{trial}"), checkpoint_format=fmt,
                           checkpoint_every=rng.choice([0, 4]), num_workers=workers)
        if everyone:
            stopped = launch(notice_to_every_process, cfg, step, world_size=2, output="none")[0]
        else:
            stopped = launch(train.run, cfg.replace(fail_mode="sigterm", fail_at_step=step, fail_rank=rank),
                             world_size=2, output="none")[0]
        kinds.append((everyone, workers))
        assert stopped["emergency_checkpoint_step"] == step + 1, (trial, step, rank, everyone, workers)
        resumed = launch(train.run, cfg.replace(resume=True), world_size=2, output="none")[0]
        assert (resumed["resumed_from_step"], resumed["param_sha256"]) == (step + 1, clean), (trial, step, rank, fmt)
    assert (True, 1) in kinds and (False, 1) in kinds  # every process signalled, workers included


def test_a_full_disk_during_a_save_is_one_clear_error_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    checkpoint.save(root, 1, {"w": torch.ones(4)})

    def no_space(path, obj):
        open(path, "wb").write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(checkpoint, "write_torch", no_space)
    with pytest.raises(checkpoint.CheckpointError, match="No space left on device.*the newest good checkpoint is still step-00000001"):
        checkpoint.save(root, 2, {"w": torch.zeros(4)})
    assert [p.name for p in root.iterdir()] == ["step-00000001"]  # no temporary folder left behind
    assert torch.equal(checkpoint.load(checkpoint.latest_good(root))["w"], torch.ones(4))


@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_a_file_size_limit_hit_by_the_trainer_is_one_line_and_the_resume_still_works(tmp_path, fmt):
    ck = str(tmp_path / "ck")
    first = run_cli("train", "--steps", "4", "--checkpoint-dir", ck, "--checkpoint-format", fmt)
    assert first.returncode == 0, first.stderr[-2000:]

    def small_files():  # a real write failure from the kernel, without root: EFBIG past 300 kB
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    limited = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--steps", "8", "--checkpoint-dir", ck,
                              "--resume", "--timeout", "10"], capture_output=True, text=True, timeout=120,
                             cwd=REPO, env=cli_env(), preexec_fn=small_files)
    assert limited.returncode == 2, limited.stderr[-2000:]
    line = limited.stderr.strip().splitlines()[-1]
    assert "saving checkpoint step 8" in line and "ulimit -f" in line and "still step-00000004" in line, line
    assert sorted(os.listdir(ck)) == ["step-00000004"]
    again = run_cli("train", "--steps", "8", "--checkpoint-dir", ck, "--resume")
    assert again.returncode == 0 and "steps 4 -> 8" in again.stdout, again.stderr[-2000:]
