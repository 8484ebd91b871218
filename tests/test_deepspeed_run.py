"""DeepSpeed's ZeRO on the kit's job: DDP's losses exactly, and the comparison can fail (default clipping).
Nothing is left behind: no /dev/shm file and no process (DeepSpeed's own launcher leaves two 66 MB files in
/dev/shm per run; the kit's launcher and the CPU backend's op must not)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from ddpkit import train
from ddpkit.config import TrainConfig
from ddpkit.engines import missing
from ddpkit.launch import launch

CFG = TrainConfig(steps=3, world_size=2, warmup_steps=0, grad_clip=0.0)


def _job(ctx, cfg):
    from ddpkit.engines import deepspeed_run

    kit = train.run(ctx, cfg)
    return {"ddp": [x["loss"] for x in kit["losses"]], "ddp_sha": kit["param_sha256"],
            1: deepspeed_run.train_engine(ctx, cfg, deepspeed_run.cpu_config(cfg, ctx.world_size, 1)),
            3: deepspeed_run.train_engine(ctx, cfg, deepspeed_run.cpu_config(cfg, ctx.world_size, 3)),
            "default": deepspeed_run.train_engine(ctx, cfg, deepspeed_run.cpu_config(cfg, ctx.world_size, 1, None)),
            "seed": deepspeed_run.train_seed_config(ctx, cfg, 3) if deepspeed_run.ops_built(("cpu_adam",)) else None}


def leftovers() -> tuple[set, set]:
    """Files in /dev/shm, and every live process descended from this one (from /proc)."""
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":  # a zombie has exited: only its parent's wait() is missing
                    parents[int(name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    mine, grew = {os.getpid()}, True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in mine} - mine
        mine |= new
        grew = bool(new)
    return shm, mine - {os.getpid()}


@pytest.fixture(scope="module")
def runs():
    reason = missing("deepspeed")
    if reason:
        pytest.skip(reason)
    from ddpkit.engines import deepspeed_run

    deepspeed_run.import_deepspeed()
    before = leftovers()
    out = launch(_job, CFG, world_size=2, output="none", progress="off")[0]
    out["leftovers"] = [after - earlier for after, earlier in zip(leftovers(), before)]
    return out


def test_nothing_is_left_in_dev_shm_or_running(runs):
    shm, procs = runs["leftovers"]
    assert not shm and not procs, (shm, procs)


def test_the_leftover_check_can_fail(tmp_path):
    # negative control: a file in /dev/shm and a child still running are both seen
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    before = leftovers()
    path = os.path.join("/dev/shm", f"ddpkit-test-{uuid.uuid4().hex}")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        open(path, "w").close()
        shm, procs = (after - earlier for after, earlier in zip(leftovers(), before))
        assert os.path.basename(path) in shm and child.pid in procs
    finally:
        child.kill()
        child.wait()
        os.remove(path)


def test_zero_stages_equal_ddp_exactly(runs):
    for stage in (1, 3):
        assert runs[stage]["losses"] == runs["ddp"], stage
        assert runs[stage]["param_sha256"] == runs["ddp_sha"], stage


def test_default_clipping_is_the_negative_control(runs):
    # the same engine with gradient_clipping left out: DeepSpeed clips at 1.0, and the comparison sees it
    assert runs["default"]["clipping"] == 1.0
    assert runs["default"]["param_sha256"] != runs["ddp_sha"]


def test_the_seeds_config_with_its_batch_fixed_trains_on_the_cpu_as_written(runs):
    seed = runs["seed"]  # bf16, ZeRO-3 with the optimizer offloaded (DeepSpeedCPUAdam, compiled), clipping 1.0
    if seed is None:
        pytest.skip("DeepSpeedCPUAdam is not compiled here: deepspeed_run.build_ops() compiles it (about 2.5 CPU minutes)")
    assert seed["global_batch"] == 8 * 4 * 2 and seed["weights_dtype"] == "bfloat16" and seed["stage"] == 3
    assert seed["optimizer"] == "DeepSpeedCPUAdam" and seed["offload"] == "cpu" and seed["clipping"] == 1.0
    assert len(seed["losses"]) == 3 and all(0 < x < 10 for x in seed["losses"])
    # WarmupDecayLR's log warm-up over 2000 steps: two steps at lr 0 (iterations -1 and 0), then log(2)/log(2000)
    assert seed["lrs"][:2] == [0.0, 0.0] and seed["lrs"][2] == pytest.approx(1e-4 * 0.6931 / 7.6009, rel=1e-3)


def test_stage3_holds_half_the_weights(runs):
    assert 2 * runs[3]["bytes"]["params"] == pytest.approx(runs[1]["bytes"]["params"], abs=64)
