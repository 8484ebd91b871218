"""What a failure costs, measured from the metrics logs: recovery time, and work lost by save cadence.

**Recovery time** (seed 003's target: under 5 minutes) is the time from a rank's death to the first
step after the restart, in four parts, each read from timestamped events (``--metrics-dir``):

* ``detection_s``: the fault (``fault_injected``) to the launcher noticing it (``failure_detected``,
  written by ``ddpkit train`` when a launch fails; under torchrun, read from the elastic agent's own
  log: its first line about the failed worker group, :func:`agent_detection_time`);
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

:func:`restart_drill` is the whole restart on a small run in the calling process (notebook 21 sets it
beside torchft and elastic torchrun): the seconds above, and the steps done twice.
"""

from __future__ import annotations

import json
import os
import re
import time

from ddpkit.metrics import read_metrics

LAUNCHER_LOG = "launcher.jsonl"


def note_failure_detected(metrics_dir: str | None, attempt: int, at: float | None = None) -> None:
    """Written by ``ddpkit train`` when a launch fails (the moment the failure became known), or for
    torchrun from its agent's log (``at``: that moment, in seconds since the epoch)."""
    if metrics_dir:
        with open(os.path.join(metrics_dir, LAUNCHER_LOG), "a") as handle:
            handle.write(json.dumps({"event": "failure_detected", "rank": -1, "step": -1,
                                     "time": time.time() if at is None else at, "attempt": attempt}) + "\n")


# The elastic agent logs through torch's formatter: "W1128 20:10:14.882000 9806 torch/distributed/elastic/..."
# (level, month and day, local time truncated to the millisecond, pid, file). The file is relative to an entry
# of sys.path, so it can carry a prefix (".venv/lib/python3.11/site-packages/torch/..." when the working
# directory holds the virtual environment). Its first line about a failed
# worker is either the SIGTERM it sends the survivors ("Sending process ... closing signal") or, when every
# worker has already exited, the failure it reports ("failed (exitcode: ...)"): torch's
# elastic/multiprocessing/api.py, SubprocessContext._poll and _close, run every monitor_interval (0.1 s).
AGENT_LINE = re.compile(r"^[IWEF](\d{4}) (\d\d:\d\d:\d\d)\.(\d{6}) \d+ \S*torch/distributed/elastic/\S+\] "
                        r"(?:Sending process \d+ closing signal|failed \(exitcode)")


def agent_detection_time(output: str, after: float) -> float | None:
    """When torchrun's elastic agent noticed a failed worker: the first such line of its log (``output``)
    at or after ``after`` (the fault, seconds since the epoch), as seconds since the epoch, or None.
    The log has millisecond resolution and truncates, so the middle of that millisecond is returned."""
    year = time.localtime(after).tm_year
    for line in output.splitlines():
        found = AGENT_LINE.match(line.strip())
        if not found:
            continue
        month_day, clock, micros = found.groups()
        stamp = time.mktime(time.strptime(f"{year}{month_day} {clock}", "%Y%m%d %H:%M:%S")) + int(micros) / 1e6 + 0.0005
        if stamp >= after - 0.001:  # a line about this fault (the truncated millisecond allowed for)
            return stamp
    return None


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
    if not detected:
        raise ValueError(f"{metrics_dir} has no failure_detected event after the fault: the launcher's detection "
                         f"time is unknown (ddpkit train writes it; measure_recovery reads torchrun's from its log)")
    detection = min(detected) - death
    parts = {"detection_s": detection, "restart_s": started - death - detection,
             "restore_s": restored - started, "first_step_s": first_step - restored}
    return {**parts, "total_s": first_step - death}


def torn_newest(root: str) -> dict:
    """Damage the newest checkpoint under ``root`` after the fact and ask which one a resume would use.

    The second half of its state file is overwritten with zeros, the size unchanged: what a write that
    never reached the disk can read back as after a power cut (a truncation is caught by the manifest's
    byte count alone; this one only by the sha256). Returns the damaged folder's name (``torn``), the one
    :func:`ddpkit.checkpoint.latest_good` chose (``used``), its warnings, and ``skipped``: the torn one was
    passed over, with a warning naming it, for the one before. Notebook 14 asserts ``skipped``; without
    the hash check (a negative control) the torn checkpoint is chosen."""
    import warnings

    from ddpkit import checkpoint

    found = checkpoint.list_checkpoints(root)
    newest = found[0]
    state_file = newest / checkpoint.STATE_FILE
    data = bytearray(state_file.read_bytes())
    half = len(data) // 2
    data[half:] = bytes(len(data) - half)
    state_file.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = checkpoint.latest_good(root)
    said = [str(w.message) for w in caught]
    skipped = chosen is not None and len(found) > 1 and chosen == found[1] and any(newest.name in w for w in said)
    return {"torn": newest.name, "used": chosen.name if chosen else None, "warnings": said, "skipped": skipped}


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


_SOURCE_LOCATION = re.compile(r"\[[^\]]*:\d+\] ")  # gloo's "[.../tcp/pair.cc:534] ": the words are what matter


def peers_after_a_death(cfg, fail_mode: str = "kill", timeout_s: float = 60.0, fail_at_step: int = 3) -> dict:
    """Train ``cfg`` on real ranks with its last rank failing after ``fail_at_step`` steps, under a
    collective timeout of ``timeout_s``, and time how long the job takes to end. ``kill``: the process dies
    (SIGKILL), as when a GPU falls off the bus and takes its process with it; ``hang``: it stops without
    exiting, as a hung GPU does. Returns ``ended_after_s``, the peers' first error lines (``peers``) and
    ``fast``: the job ended in under half the timeout with the peers' errors reported, i.e. nobody waited
    for the timeout. On gloo a death is fast (the peers' sockets close at once: "Connection reset by
    peer"); a hang is not (the peers wait for the collective timeout): notebook 16's gpu-failure
    evidence, and its negative control."""
    from ddpkit import train
    from ddpkit.failures import LaunchError
    from ddpkit.launch import launch

    started = time.monotonic()
    peers: list[str] = []
    try:
        launch(train.run, cfg.replace(fail_mode=fail_mode, fail_at_step=fail_at_step, fail_rank=cfg.world_size - 1,
                                      timeout=timeout_s), world_size=cfg.world_size, output="none")
    except LaunchError as exc:
        peers = [f"rank {o.rank}: {_SOURCE_LOCATION.sub('', o.message.splitlines()[0])[:160]}" for o in exc.others]
    ended = time.monotonic() - started
    return {"ended_after_s": ended, "timeout_s": timeout_s, "peers": peers, "fast": bool(peers) and ended < timeout_s / 2}


COLLECTIVE_TIMEOUT_S = 10  # the runs' --timeout: a launcher that noticed the death only when a collective
# timed out would detect it after this long; one that watches its ranks' exits notices within a fraction of it


def measure_recovery(workdir: str, launcher: str = "ddpkit", world_size: int = 2, steps: int = 20,
                     fail_at_step: int = 12, timeout_s: float = 300) -> dict[str, float]:
    """Run ``ddpkit train`` (or the same under ``torchrun``) with one rank SIGKILLed after ``fail_at_step``
    steps and one restart allowed; return :func:`recovery_times` of that run. Its collectives time out
    after :data:`COLLECTIVE_TIMEOUT_S`, so a detection time well under it says the launcher saw the exit."""
    import sys

    if launcher not in ("ddpkit", "torchrun"):
        raise ValueError(f"launcher must be ddpkit or torchrun, got {launcher!r}")
    metrics_dir, ckpt = os.path.join(workdir, "metrics"), os.path.join(workdir, "ckpt")
    train = ["train", "--steps", str(steps), "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
             "--metrics-dir", metrics_dir, "--fail-mode", "kill", "--fail-at-step", str(fail_at_step),
             "--fail-rank", str(world_size - 1), "--timeout", str(COLLECTIVE_TIMEOUT_S), "--log-every", "1000"]
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
    if launcher == "torchrun":  # torchrun writes no event when it notices the death: its agent's log says when
        death = min(e["time"] for e in read_metrics(metrics_dir, event=None) if e["event"] == "fault_injected")
        detected = agent_detection_time(proc.stdout, death)
        if detected is None:
            raise RuntimeError("torchrun's agent logged no line about the failed worker: its detection time is unknown")
        note_failure_detected(metrics_dir, 0, at=detected)
    return recovery_times(metrics_dir)


def restart_drill(workdir: str, world_size: int = 2, steps: int = 8, fail_at_step: int = 5,
                  checkpoint_every: int = 3) -> dict:
    """The kit's own checkpoint restart, measured: ``ddpkit train --max-restarts 1`` in this process, its
    last rank SIGKILLed after ``fail_at_step`` steps; the launcher restarts every rank (forked from this
    process, which has imported torch) from the newest good checkpoint.

    Returns :func:`recovery_times` (``total_s``: the death to every rank's first step after the restore),
    ``saved_before``: the newest checkpoint saved before the death, ``resumed_from``: the step the restart
    restored, ``steps_done_twice``: steps done before the death after that checkpoint (the work lost),
    ``steps`` and ``restarts`` from the run's summary, and ``said``: the launcher's lines about the restart.
    A run that saves every step loses none (``checkpoint_every=1``, the tests' control)."""
    import contextlib
    import io
    import shutil

    from ddpkit import cli

    if not 0 < checkpoint_every <= fail_at_step < steps:
        raise ValueError(f"the rank must die after a checkpoint and before the end: need 0 < checkpoint_every "
                         f"({checkpoint_every}) <= fail_at_step ({fail_at_step}) < steps ({steps})")
    shutil.rmtree(workdir, ignore_errors=True)  # run again, it starts clean (a folder of another run's checkpoints is refused)
    metrics_dir, summary_json = os.path.join(workdir, "metrics"), os.path.join(workdir, "summary.json")
    argv = ["train", "--world-size", str(world_size), "--steps", str(steps), "--dataset-size", "512",
            "--checkpoint-dir", os.path.join(workdir, "ckpt"), "--checkpoint-every", str(checkpoint_every),
            "--metrics-dir", metrics_dir, "--summary-json", summary_json, "--max-restarts", "1",
            "--fail-mode", "kill", "--fail-at-step", str(fail_at_step), "--fail-rank", str(world_size - 1),
            "--timeout", "10", "--log-every", "1000"]
    out = io.StringIO()  # the ranks' lines and the launcher's root-cause report: kept, a few lines shown
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(argv)
    lines = out.getvalue().splitlines()
    if code != 0:
        raise RuntimeError(f"the restarted run did not finish (exit {code}): {lines[-3:]}")
    with open(summary_json) as handle:
        summary = json.load(handle)
    events = read_metrics(metrics_dir, event=None)
    death = min(e["time"] for e in events if e["event"] == "fault_injected")
    restart = min(e["time"] for e in events if e["event"] == "started" and e.get("attempt", 0) > 0)
    # every rank's steps: the dying rank logged its last step before it died, a peer may log the same step later
    done = [e["step"] for e in events if e["event"] == "step" and e["time"] <= death]
    # a save returns on every rank once it is durable, so the dying rank's own log says what was saved before it died
    saved = [e["step"] for e in events if e["event"] == "checkpoint_saved" and e["time"] <= death]
    resumed = min(e["step"] for e in events if e["event"] == "checkpoint_restored" and e["time"] >= restart)
    return {**recovery_times(metrics_dir), "saved_before": max(saved, default=0), "resumed_from": resumed,
            "steps_done_twice": max(done) - resumed, "steps": summary["steps"], "restarts": summary["restarts"],
            "said": [line for line in lines if "injecting failure" in line or line.startswith("ddpkit: restarting")]}


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
