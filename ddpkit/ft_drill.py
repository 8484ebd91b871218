"""Kill a torchft replica group, watch the others go on, restart it, and check what it got back.

:func:`run_drill` starts a lighthouse (``torchft.coordination.LighthouseServer``, in this process) and two
replica groups (:mod:`ddpkit.ft_replicas`, one process each), lets one of them SIGKILL itself at an exact
point, restarts it once the survivor has trained a few steps alone, and reads both event logs into a
summary: the steps the survivor committed (every step number once, in order: nothing committed is
lost), the attempts it did not commit (their weights unchanged), the steps it trained alone, the time
the failure cost it, the step and weights the restarted replica healed to, and the final weights of
both. Every replica process is forked from one :class:`~ddpkit.ft_zygote.Zygote` that has imported torch
and torchft once, so the replacement for the killed replica joins as a spare machine standing by with
Python and torch loaded would, and a busy machine's seconds of ``import torch`` are paid once for all
the drills, not once per process. :func:`run_drills` runs several drills at once (each with its own
lighthouse), all forked from one zygote.

The lighthouse's ``heartbeat_timeout_ms`` is how long a silent replica group counts as alive: the
survivor's next quorum waits that long before it forms without the dead one (torchft's lighthouse
keeps a quorum from forming with fewer than half of the replica groups it still counts as alive, to
avoid a split brain: ``src/lighthouse.rs``, ``quorum_compute``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

from ddpkit.ft_replicas import MISSING, available
from ddpkit.ft_zygote import Child, Zygote

HEARTBEAT_TIMEOUT_MS = 1500  # a replica group silent this long is dead (torchft's default is 5000)


def _start(zygote: Zygote, workdir: str, replica: int, generation: int, lighthouse: str, args: list[str]) -> Child:
    """``python -m ddpkit.ft_replicas --replica-id REPLICA ...``, forked from the zygote."""
    argv = ["--replica-id", str(replica), "--lighthouse", lighthouse,
            "--log", os.path.join(workdir, f"replica-{replica}.jsonl"), *args]
    return zygote.start(argv, os.path.join(workdir, f"replica-{replica}.{generation}.out"))


@contextlib.contextmanager
def _zygote(zygote: Zygote | None, show=None):
    """The zygote given, or one of our own for the duration."""
    if zygote is not None:
        yield zygote
        return
    own = Zygote(show=show)
    try:
        yield own
    finally:
        own.close()


def read_log(workdir: str, replica: int) -> list[dict]:
    path = os.path.join(workdir, f"replica-{replica}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.endswith("\n")]  # a line being written is skipped


def _alone(events: list[dict]) -> int:
    return sum(1 for e in events if e["event"] == "step" and e["committed"] and e["participants"] == 1)


def run_drill(workdir: str, *, die_mode: str = "between", die_at_step: int = 6, steps: int = 14, heal: bool = True,
              restart: bool = True, alone_steps: int = 4, ignore_commit: bool = False, wrapper: str = "manual",
              timeout_s: float = 300.0, show=print, name: str = "", zygote: Zygote | None = None) -> dict:
    """One drill: replica 1 dies at ``die_at_step`` (``die_mode``), replica 0 goes on; with ``restart`` a new
    replica 1 starts once replica 0 committed ``alone_steps`` steps alone, and both train to ``steps``.

    ``die_mode="none"``: nobody dies, both train to ``steps`` (to compare the wrappers without a failure).
    ``wrapper`` is how every replica averages its gradients (:data:`ddpkit.ft_replicas.WRAPPERS`); with
    torchft's ``ddp`` wrapper the survivor may crash, which the summary reports (``crashed``) instead of raising."""
    if not available():
        raise RuntimeError(MISSING)
    with _zygote(zygote, show) as forks:
        return _drill(forks, workdir, die_mode, die_at_step, steps, heal, restart, alone_steps, ignore_commit,
                      wrapper, timeout_s, show, name)


def _drill(zygote: Zygote, workdir: str, die_mode: str, die_at_step: int, steps: int, heal: bool, restart: bool,
           alone_steps: int, ignore_commit: bool, wrapper: str, timeout_s: float, show, name: str) -> dict:
    from ddpkit.notebook import kill_tree
    from torchft.coordination import LighthouseServer

    shutil.rmtree(workdir, ignore_errors=True)  # a drill run again in the same folder starts clean
    gate = os.path.join(workdir, "gate")
    os.makedirs(gate)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    # without healing a restarted replica never catches up (it stays behind the survivor's step, so it never
    # takes part): then the survivor ends alone and the restarted replica stops after its first quorum
    together = restart and heal
    dies = die_mode != "none"
    ends = ["--steps", str(steps), "--end-replicas", "1" if dies and not together else "2",
            "--run-timeout", str(timeout_s), "--wrapper", wrapper, *(["--ignore-commit"] if ignore_commit else [])]
    prefix = f"[{name}] " if name else ""
    procs: list[Child] = []
    started, restart_launched, said, last_line = time.time(), None, set(), [time.monotonic()]

    def say(line: str) -> None:
        last_line[0] = time.monotonic()
        show(line)

    try:
        procs.append(_start(zygote, workdir, 0, 0, lighthouse.address(), ["--gate", gate, *ends]))
        procs.append(_start(zygote, workdir, 1, 0, lighthouse.address(), ["--gate", gate, *ends, "--die-mode", die_mode,
                                                                         "--die-at-step", str(die_at_step)]))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) or (restart and dies and restart_launched is None):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{prefix}the drill did not end within {timeout_s:.0f} s (logs in {workdir})")
            survivor, other = read_log(workdir, 0), read_log(workdir, 1)
            died = next((e for e in other if e["event"] == "dying"), None)
            if died and "dying" not in said:
                said.add("dying")
                say(f"{prefix}replica 1 SIGKILLed itself at step {died['step']}, {died['where']}")
            if died and _alone(survivor) and "alone" not in said:
                said.add("alone")
                first = next(e for e in survivor if e["event"] == "step" and e["participants"] == 1)
                say(f"{prefix}replica 0 trains alone from step {first['step']}, "
                     f"{first['time'] - died['time']:.1f} s after the death")
            ready = _alone(survivor) >= alone_steps or procs[0].poll() is not None
            if restart and restart_launched is None and procs[1].poll() is not None and ready:
                restart_launched = time.time()
                say(f"{prefix}replica 1's replacement joins ({'it heals from replica 0' if heal else 'healing turned off'})")
                procs.append(_start(zygote, workdir, 1, 1, lighthouse.address(),
                                    [*ends, *([] if heal else ["--no-heal", "--exit-after-join"])]))
            _refuse_a_lone_finish(procs, together or not dies, prefix, workdir)
            crashed = next((e for e in survivor if e["event"] == "crashed"), None)
            if crashed and "crashed" not in said:
                said.add("crashed")
                say(f"{prefix}replica 0 crashed at step {crashed['step']}: {crashed['error']} in {crashed['where']}")
            if time.monotonic() - last_line[0] > 3.5:  # never silent for long: where replica 0 is
                at = max((e["step"] for e in survivor if e["event"] == "step"), default=None)
                say(f"{prefix}... replica 0 " + ("starting" if at is None else f"at step {at}"))
            time.sleep(0.05)
        codes = [p.returncode for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
        lighthouse.shutdown()
    survivor = read_log(workdir, 0)
    crashed = any(e["event"] == "crashed" for e in survivor)  # a crash it logged: exit code 1 is expected
    if codes[0] != (1 if crashed else 0) or codes[1] != (-9 if dies else 0) or (restart and codes[2] != 0):
        tails = {f: open(os.path.join(workdir, f)).read()[-600:] for f in sorted(os.listdir(workdir)) if f.endswith(".out")}
        raise RuntimeError(f"{prefix}unexpected exit codes {codes} (replica 0, replica 1, restarted replica 1): {tails}")
    summary = summarize(survivor, read_log(workdir, 1), restart_launched)
    summary["wall_s"] = time.time() - started
    if crashed:
        show(f"{prefix}done in {summary['wall_s']:.1f} s: replica 0 crashed after committing steps 0..{summary['committed_steps'][-1]}")
    else:
        show(f"{prefix}done in {summary['wall_s']:.1f} s: replica 0 committed steps 0..{summary['final_step'] - 1}"
             + (f", {summary['alone_steps']} of them alone" if dies else "")
             + (f"; the restarted replica 1 joined at step {summary['joined_step']}" if "joined_step" in summary else ""))
    return summary


LONE_FINISH_S = 30.0  # a replica that must end together with another is given this long after the other is done


def _refuse_a_lone_finish(procs: list[Child], end_together: bool, prefix: str, workdir: str) -> None:
    """When the replicas must end training together and one has finished (exit 0) while the other still
    runs after :data:`LONE_FINISH_S`, the other can never finish (it waits for a peer that is gone):
    fail now, with the reason, instead of at the drill's timeout."""
    if not end_together:
        return
    finished = {i: p.finished_at for i, p in enumerate(procs) if p.poll() == 0}
    running = [i for i, p in enumerate(procs) if p.poll() is None]
    if finished and running and time.monotonic() - min(finished.values()) > LONE_FINISH_S:
        raise RuntimeError(f"{prefix}process {min(finished)} finished but process {running[0]} still trains alone "
                           f"{LONE_FINISH_S:.0f} s later: it never trained together with it again (logs in {workdir})")


def summarize(survivor: list[dict], other: list[dict], restart_launched: float | None) -> dict:
    """What the two logs say, as plain values a notebook can assert on and record."""
    steps = [e for e in survivor if e["event"] == "step"]
    committed = [e for e in steps if e["committed"]]
    done = next((e for e in survivor if e["event"] == "done"), None)
    summary = {
        "committed_steps": [e["step"] for e in committed],
        "no_step_lost": [e["step"] for e in committed] == list(range(len(committed))),
        "retried": [{"step": e["step"], "unchanged": e["sha"] == e["sha_before"]} for e in steps if not e["committed"]],
        "alone_steps": _alone(survivor),
        "losses": {str(e["step"]): e["loss"] for e in committed},  # replica 0's
        "survivor_sha": {str(e["step"]): e["sha"] for e in committed},  # the weights after each committed step
        "peer_sha": {str(e["step"]): e["sha"] for e in other if e["event"] == "step" and e["committed"]},
        "final_step": done["step"] if done else None,
        "final_sha": {"0": done["sha"]} if done else {},
    }
    crashed = next((e for e in survivor if e["event"] == "crashed"), None)
    if crashed:
        summary["crashed"] = {k: crashed[k] for k in ("step", "error", "message", "where")}
    others_done = [e for e in other if e["event"] == "done"]
    if others_done:
        summary["final_sha"]["1"] = others_done[-1]["sha"]
    died = next((e for e in other if e["event"] == "dying"), None)
    if died is None:
        return summary
    before_death = [e for e in steps if e["time"] <= died["time"]]
    summary.update({"died_at_step": died["step"], "died_where": died["where"],
                    "survivor_step_s": _median([b["time"] - a["time"] for a, b in zip(before_death, before_death[1:])])})
    first_alone = next((e for e in steps if e["participants"] == 1 and e["committed"]), None)
    if first_alone is not None:
        # from the death to the end of the survivor's first step without it: detection, new quorum, the step
        summary.update({"first_alone_step": first_alone["step"], "survivor_blocked_s": first_alone["time"] - died["time"]})
    joins = [e for e in other if e["event"] == "joined"]
    if restart_launched is not None and len(joins) == 2:
        healed = joins[1]
        at_join = max(e["step"] for e in committed if e["time"] <= healed["time"])
        summary.update({
            "joined_step": healed["step"],
            "survivor_step_at_join": at_join + 1,
            # healed: the weights the survivor had when the restarted replica joined, bit for bit
            "heal_bitwise": healed["sha"] == summary["survivor_sha"][str(at_join)],
            "restart_to_join_s": healed["time"] - restart_launched,
            "back_after_s": healed["time"] - died["time"],
        })
    return summary


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def run_drills(workdir: str, drills: dict[str, dict], show=print) -> dict[str, dict]:
    """Several drills at once, each in its own folder with its own lighthouse; their summaries by name."""
    if not available():
        raise RuntimeError(MISSING)
    with _zygote(None, show) as zygote, ThreadPoolExecutor(max_workers=len(drills)) as pool:
        futures = {name: pool.submit(run_drill, os.path.join(workdir, name), show=show, name=name, zygote=zygote,
                                     **kwargs) for name, kwargs in drills.items()}
        return {name: future.result() for name, future in futures.items()}
