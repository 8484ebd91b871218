"""What a failure costs, measured from the metrics logs: recovery time, and work lost by save cadence.

**Recovery time** (seed 003's target: under 5 minutes) is the time from a rank's death to the first
step after the restart, in four parts, each read from timestamped events (``--metrics-dir``):

* ``detection_s``: the fault (``fault_injected``) to the launcher noticing it (``failure_detected``,
  written by ``ddpkit train`` when a launch fails; torchrun writes no such event, so there detection
  is counted in the restart);
* ``restart_s``: to the restarted trainer being up (``started``: processes spawned, rendezvous done,
  model built);
* ``restore_s``: to every rank having loaded and checked the checkpoint (``checkpoint_restored``);
* ``first_step_s``: to every rank having finished its first step after the restore.

**Lost work** by cadence: a failure at a random instant loses the time since the last save. Over a
run whose saves end at times s_1 < s_2 < ... (and the run ends at T), the expected loss is the mean
of (t - last save) over t uniform in [0, T], i.e. sum(gap^2) / (2 T), and the worst is the longest
gap. Saving every K steps bounds the gap in steps, not in seconds: when steps slow down (a straggler,
longer sequences), the gap in seconds grows. Saving every S seconds bounds it in seconds. The cost is
the time spent saving.
"""

from __future__ import annotations

import json
import os
import time

from ddpkit.metrics import read_metrics

LAUNCHER_LOG = "launcher.jsonl"


def note_failure_detected(metrics_dir: str | None, attempt: int) -> None:
    """Written by ``ddpkit train`` when a launch fails (the moment the failure became known)."""
    if metrics_dir:
        with open(os.path.join(metrics_dir, LAUNCHER_LOG), "a") as handle:
            handle.write(json.dumps({"event": "failure_detected", "rank": -1, "step": -1,
                                     "time": time.time(), "attempt": attempt}) + "\n")


def recovery_times(metrics_dir: str) -> dict[str, float]:
    """The four parts of the recovery from the (first) injected fault, in seconds, and their total."""
    events = read_metrics(metrics_dir, event=None)
    death = min(e["time"] for e in events if e["event"] == "fault_injected")
    detected = [e["time"] for e in events if e["event"] == "failure_detected" and e["time"] >= death]
    started = min(e["time"] for e in events if e["event"] == "started" and e.get("attempt", 0) > 0)
    restored = max(e["time"] for e in events if e["event"] == "checkpoint_restored" and e["time"] >= started)
    first_steps: dict[int, float] = {}
    for e in events:
        if e["event"] == "step" and e["time"] >= restored:
            first_steps[e["rank"]] = min(first_steps.get(e["rank"], e["time"]), e["time"])
    first_step = max(first_steps.values())
    detection = (min(detected) - death) if detected else 0.0
    parts = {"detection_s": detection, "restart_s": started - death - detection,
             "restore_s": restored - started, "first_step_s": first_step - restored}
    return {**parts, "total_s": first_step - death}


def lost_work(save_times: list[float], start: float, end: float) -> dict[str, float]:
    """Expected and worst seconds of training lost to a failure at a uniformly random instant, for saves
    that completed at ``save_times`` during a run from ``start`` to ``end``."""
    marks = [start, *sorted(t for t in save_times if start < t < end), end]
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    return {"expected_lost_s": sum(g * g for g in gaps) / (2 * (end - start)), "worst_lost_s": max(gaps)}


def cadence_cost(metrics_dir: str) -> dict[str, float]:
    """Lost work (above) and time spent saving, for a run's rank 0 metrics."""
    events = [e for e in read_metrics(metrics_dir, event=None) if e["rank"] == 0]
    steps = [e for e in events if e["event"] == "step"]
    start = min(e["time"] for e in events if e["event"] == "started")
    end = max(e["time"] for e in steps)
    saves = [e for e in events if e["event"] == "checkpoint_saved"]
    return {**lost_work([e["time"] for e in saves], start, end), "saves": len(saves),
            "save_s": sum(e["seconds"] for e in saves), "run_s": end - start}


def measure_recovery(workdir: str, launcher: str = "ddpkit", world_size: int = 2, steps: int = 20,
                     fail_at_step: int = 12, timeout_s: float = 300) -> dict[str, float]:
    """Run ``ddpkit train`` (or the same under ``torchrun``) with one rank SIGKILLed after ``fail_at_step``
    steps and one restart allowed; return :func:`recovery_times` of that run."""
    import sys

    if launcher not in ("ddpkit", "torchrun"):
        raise ValueError(f"launcher must be ddpkit or torchrun, got {launcher!r}")
    metrics_dir, ckpt = os.path.join(workdir, "metrics"), os.path.join(workdir, "ckpt")
    train = ["train", "--steps", str(steps), "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
             "--metrics-dir", metrics_dir, "--fail-mode", "kill", "--fail-at-step", str(fail_at_step),
             "--fail-rank", str(world_size - 1), "--timeout", "10", "--log-every", "1000"]
    if launcher == "ddpkit":
        cmd = [sys.executable, "-m", "ddpkit", *train, "--world-size", str(world_size), "--max-restarts", "1"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size),
               "--max-restarts", "1", "-m", "ddpkit", *train]
    from ddpkit.notebook import run_command

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # streamed: the restart and the end are shown as they happen, and a quiet stretch prints "still running"
    proc = run_command(cmd, env={**env, "OMP_NUM_THREADS": "1"}, timeout=timeout_s,
                       show=lambda line: "restarting" in line or "done: step" in line)
    if proc.returncode != 0:
        raise RuntimeError(f"the {launcher} run did not recover: {proc.stdout.strip().splitlines()[-1:]}")
    return recovery_times(metrics_dir)


def compare_cadences(cfg, workdir: str, every_steps: int = 10) -> dict[str, dict[str, float]]:
    """Train ``cfg`` (a run with uneven step times: give it ``fail_mode="slow"``) twice on real ranks:
    saving every ``every_steps`` steps, then every S seconds with S chosen for the same number of saves;
    returns :func:`cadence_cost` of each."""
    from ddpkit import train
    from ddpkit.launch import launch

    costs = {}
    for name in ("steps", "seconds"):
        folders = dict(checkpoint_dir=os.path.join(workdir, name, "ckpt"), metrics_dir=os.path.join(workdir, name, "metrics"),
                       overwrite_checkpoints=True)
        if name == "steps":
            run_cfg = cfg.replace(checkpoint_every=every_steps, checkpoint_every_s=0.0, **folders)
        else:
            budget = costs["steps"]
            run_cfg = cfg.replace(checkpoint_every=0, checkpoint_every_s=max(0.01, budget["run_s"] / budget["saves"]), **folders)
        launch(train.run, run_cfg, world_size=run_cfg.world_size, output="none")
        costs[name] = {**cadence_cost(run_cfg.metrics_dir), "every": every_steps if name == "steps" else run_cfg.checkpoint_every_s}
    return costs


def cadences_on_one_timeline(metrics_dir: str, every_steps: int, split_step: int | None = None) -> dict:
    """Both save rules applied to the *same* measured timeline (rank 0's step-end times of one run), so
    that run-to-run noise on a busy machine cannot decide the comparison: saves after every
    ``every_steps`` steps, and saves at the first step boundary at least S seconds after the previous
    save, S = run time / (the step rule's number of saves + 1), the same budget (k saves, k + 1 gaps). Returns :func:`lost_work`
    and the number of saves for each rule, and (given ``split_step``, where the steps slow down) how much
    slower the median step became: the premise of the comparison."""
    events = [e for e in read_metrics(metrics_dir, event=None) if e["rank"] == 0]
    start = min(e["time"] for e in events if e["event"] == "started")
    steps = sorted((e["step"], e["time"]) for e in events if e["event"] == "step")
    end = steps[-1][1]
    by_steps = [t for step, t in steps if step % every_steps == 0 and t < end]
    every_s = (end - start) / (len(by_steps) + 1)  # k saves cut the run into k + 1 gaps
    by_time, last = [], start
    for _, t in steps:
        if t - last >= every_s and t < end:
            by_time.append(t)
            last = t
    out = {"steps": {**lost_work(by_steps, start, end), "saves": len(by_steps), "every": every_steps},
           "seconds": {**lost_work(by_time, start, end), "saves": len(by_time), "every": every_s}}
    if split_step is not None:
        ends = [start] + [t for _, t in steps]
        durations = [b - a for a, b in zip(ends, ends[1:])]
        early, late = sorted(durations[1:split_step]), sorted(durations[split_step + 1:])
        out["slowdown"] = late[len(late) // 2] / early[len(early) // 2]
    return out
