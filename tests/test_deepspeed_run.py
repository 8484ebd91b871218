"""DeepSpeed's ZeRO on the kit's job: DDP's losses exactly at stages 1, 2 and 3, the stage-by-stage tables
against the kit's strategies and the memory calculator, DeepSpeedCPUAdam within a stated bound of torch's
AdamW, and each comparison able to fail. Nothing is left behind: no /dev/shm file and no process
(DeepSpeed's own launcher leaves two 66 MB files in /dev/shm per run; the kit's launcher and the CPU
backend's op must not). Without DeepSpeed, one line before any rank starts."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import uuid

import pytest

from conftest import REPO, cli_env
from ddpkit.config import TrainConfig
from ddpkit.engines import compare, missing, seed_rows

CFG = TrainConfig(steps=3, world_size=2, warmup_steps=0, grad_clip=0.0)
BUILD = "python -c \"from ddpkit.engines.deepspeed_run import build_ops; build_ops()\" compiles it (about 2.5 CPU minutes)"


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
    """One launch of notebook 22's comparison (side_by_side.run_all) on CFG; seed 003's config and
    DeepSpeedCPUAdam only where that op is compiled."""
    reason = missing("deepspeed")
    if reason:
        pytest.skip(reason)
    from ddpkit.engines import deepspeed_run, side_by_side

    built = deepspeed_run.ops_built(("cpu_adam",))
    before = leftovers()
    out = side_by_side.compare(CFG, 2, seed_config=built, cpu_adam=built, output="none", progress="off")
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
    ddp = runs["kit"]["ddp"]
    for stage in (1, 2, 3):
        assert runs["deepspeed"][stage]["stage"] == stage
        assert runs["deepspeed"][stage]["losses"] == ddp["losses"], stage
        assert runs["deepspeed"][stage]["param_sha256"] == ddp["param_sha256"], stage


def test_the_kits_sharded_strategies_equal_its_ddp_exactly(runs):
    ddp = runs["kit"]["ddp"]
    for strategy in ("zero1", "zero1-torch", "fsdp2"):
        assert runs["kit"][strategy]["losses"] == ddp["losses"], strategy
        assert runs["kit"][strategy]["param_sha256"] == ddp["param_sha256"], strategy


def test_default_clipping_is_the_negative_control(runs):
    # the same engine with gradient_clipping left out: DeepSpeed clips at 1.0, and the comparison sees it
    assert runs["default_clipping"]["clipping"] == 1.0
    assert runs["default_clipping"]["param_sha256"] != runs["kit"]["ddp"]["param_sha256"]
    assert runs["default_clipping"]["losses"] != runs["kit"]["ddp"]["losses"]


def test_every_stage_table_comparison_holds(runs):
    failed = {name: a["evidence"] for name, a in compare.agreements(runs, CFG, 2).items() if not a["holds"]}
    assert not failed, failed
    tables = compare.stage_tables(runs, CFG, 2)
    assert [r["run"] for r in tables[3]] == ["DeepSpeed ZeRO-3", "kit fsdp2", "calculator zero3", "calculator fsdp2"]


def _failing(report) -> set[str]:
    return {name for name, a in compare.agreements(report, CFG, 2).items() if not a["holds"]}


def test_the_stage_comparisons_can_fail(runs):
    # negative controls: put the unsharded DDP where a sharded run belongs, and the checks that compare it fail
    report = copy.deepcopy(runs)
    report["kit"]["zero1"] = report["kit"]["ddp"]
    failing = _failing(report)
    assert any(n.startswith("stage 1: DeepSpeed and zero1 hold the same optimizer bytes") for n in failing), failing
    assert any(n.startswith("stage 1: DeepSpeed and zero1 end the step with one all-gather") for n in failing), failing
    report = copy.deepcopy(runs)
    report["kit"]["fsdp2"] = report["kit"]["ddp"]  # whole weights, DDP's all-reduce instead of a reduce-scatter
    failing = _failing(report)
    assert {"stage 3: DeepSpeed and fsdp2 hold the same shard of the weights",
            "stage 3: both reduce-scatter the whole gradient once per step"} <= failing, failing
    report = copy.deepcopy(runs)
    report["deepspeed"][2] = report["deepspeed"][3]  # ZeRO-3's collectives where ZeRO-2's were
    assert "stage 2: the collectives of stage 1, call for call (its saving is the gradient buffer, not traffic)" in _failing(report)


def test_the_flight_recorder_counts_what_deepspeeds_logger_counts(runs):
    for stage in (1, 2, 3):
        assert compare.logger_agrees(runs["deepspeed"][stage]), runs["deepspeed"][stage]["deepspeed_logged_per_step"]
    # negative control: the kit's zero1 counted by the Flight Recorder is not what DeepSpeed's ZeRO-1 logged
    other = {**runs["deepspeed"][1], "collectives_per_step": runs["kit"]["zero1"]["collectives_per_step"]}
    assert not compare.logger_agrees(other)


def test_the_seed_tables_runs_hold(runs):
    verdicts = seed_rows.verdicts(runs["seed_rows"], 2)
    assert set(verdicts) == {"Tensor parallelism", "Pipeline parallelism", "CPU offloading", "Mixed precision"}
    assert all(v["holds"] for v in verdicts.values()), verdicts


def test_the_seed_table_verdicts_can_fail(runs):
    # negative controls: losses moved by 10x the tolerance, offload's losses moved, fp32 where bf16 ran
    bad = copy.deepcopy(runs["seed_rows"])
    bad["tp"]["losses"] = [x + 10 * seed_rows.LOSS_TOL for x in bad["tp"]["losses"]]
    bad["pp"]["data_sha256"] = "another sample stream"
    bad["fsdp2 offload"]["losses"] = [x + 1e-7 for x in bad["fsdp2 offload"]["losses"]]
    bad["fsdp2 bf16"]["forward_dtype"] = "float32"
    assert not any(v["holds"] for v in seed_rows.verdicts(bad, 2).values())


def test_deepspeeds_cpu_adam_matches_torchs_adamw_within_its_bound(runs):
    from ddpkit.engines.side_by_side import CPU_ADAM_LOSS_TOL

    if "cpu_adam" not in runs:
        pytest.skip(f"DeepSpeedCPUAdam is not compiled here: {BUILD}")
    cpu_adam, ddp = runs["cpu_adam"], runs["kit"]["ddp"]["losses"]
    assert cpu_adam["optimizer"] == "DeepSpeedCPUAdam" and cpu_adam["clipping"] == 0.0
    gap = max(abs(a - b) for a, b in zip(cpu_adam["losses"], ddp))
    assert gap <= CPU_ADAM_LOSS_TOL, gap
    # negative control: the bound tells a real difference apart (DeepSpeed's default clipping, torch's AdamW)
    clipped = max(abs(a - b) for a, b in zip(runs["default_clipping"]["losses"], ddp))
    assert clipped > CPU_ADAM_LOSS_TOL, clipped


def test_the_seeds_config_with_its_batch_fixed_trains_on_the_cpu_as_written(runs):
    seed = runs.get("seed_config_fixed")  # bf16, ZeRO-3 with the optimizer offloaded (DeepSpeedCPUAdam, compiled), clipping 1.0
    if seed is None:
        pytest.skip(f"DeepSpeedCPUAdam is not compiled here: {BUILD}")
    assert seed["global_batch"] == 8 * 4 * 2 and seed["weights_dtype"] == "bfloat16" and seed["stage"] == 3
    assert seed["optimizer"] == "DeepSpeedCPUAdam" and seed["offload"] == "cpu" and seed["clipping"] == 1.0
    assert len(seed["losses"]) == 3 and all(0 < x < 10 for x in seed["losses"])
    # WarmupDecayLR's log warm-up over 2000 steps: two steps at lr 0 (iterations -1 and 0), then log(2)/log(2000)
    assert seed["lrs"][:2] == [0.0, 0.0] and seed["lrs"][2] == pytest.approx(1e-4 * 0.6931 / 7.6009, rel=1e-3)


def test_stage3_holds_half_the_weights(runs):
    assert 2 * runs["deepspeed"][3]["bytes"]["params"] == pytest.approx(runs["deepspeed"][1]["bytes"]["params"], abs=64)


# --------------------------------------------------------------------------- without DeepSpeed: one line, before any rank

HIDDEN = "import sys; sys.modules['deepspeed'] = None\n"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDDEN + code], capture_output=True, text=True, timeout=120,
                          env=cli_env(), cwd=REPO)


def test_without_deepspeed_the_extra_is_named_in_one_line_before_any_rank_starts():
    code = ("from ddpkit.config import TrainConfig\n"
            "from ddpkit.engines import MissingExtra, deepspeed_run, side_by_side\n"
            "for call in (deepspeed_run.import_deepspeed, lambda: side_by_side.compare(TrainConfig(steps=1))):\n"
            "    try:\n"
            "        call()\n"
            "    except MissingExtra as exc:\n"
            "        print(type(exc).__name__, exc)\n")
    proc = _python(code)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout + proc.stderr
    assert all(line.startswith("MissingExtra ") and "pip install 'ddpkit[deepspeed]'" in line for line in lines), lines


def test_the_missing_extra_seen_from_inside_a_rank_is_a_launch_error():
    # negative control: the same missing module, met by a rank the launcher already started
    code = ("from ddpkit.config import TrainConfig\n"
            "from ddpkit.engines import side_by_side\n"
            "from ddpkit.launch import launch\n"
            "try:\n"
            "    launch(side_by_side.run_all, TrainConfig(steps=1), False, world_size=2, output='none', progress='off')\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__, 'deepspeed' in str(exc))\n")
    proc = _python(code)
    assert proc.stdout.split() == ["LaunchError", "True"], proc.stdout + proc.stderr


def test_the_command_refuses_without_deepspeed_or_a_launcher_in_one_line():
    proc = _python("from ddpkit.engines.deepspeed_job import main; sys.exit(main(['--steps', '1']))")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "pip install 'ddpkit[deepspeed]'" in lines[0], proc.stderr
    if missing("deepspeed"):
        return
    env = {k: v for k, v in cli_env().items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "ddpkit.engines.deepspeed_job", "--steps", "1"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=REPO)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "start this under torchrun or deepspeed" in lines[0], proc.stderr


def test_deepspeeds_shared_memory_workspaces_are_found_and_removed():
    from ddpkit.engines import deepspeed_job

    if not os.path.isdir(deepspeed_job.SHM_DIR):
        pytest.skip("no /dev/shm here")
    name = f"{deepspeed_job.SHM_PREFIX}test_{uuid.uuid4().hex}"
    with open(os.path.join(deepspeed_job.SHM_DIR, name), "wb") as handle:
        handle.write(b"x" * 10)
    try:
        assert deepspeed_job.shm_files().get(name) == 10
        deepspeed_job.remove([name])
        assert name not in deepspeed_job.shm_files()
    finally:
        if os.path.exists(os.path.join(deepspeed_job.SHM_DIR, name)):
            os.remove(os.path.join(deepspeed_job.SHM_DIR, name))
    with pytest.raises(ValueError, match="not one of DeepSpeed's workspaces"):
        deepspeed_job.remove(["someone-elses-file"])
