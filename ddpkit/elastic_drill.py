"""Two torchrun agents as two "nodes" on this machine: lose one, go on with the other, grow back.

:func:`run_elastic` starts agent A (it hosts the c10d rendezvous store) and agent B, each with one
worker (:mod:`ddpkit.elastic` around ``ddpkit train``, checkpointing every few steps); SIGKILLs agent B and
its worker (:func:`ddpkit.notebook.kill_tree`) once the job passed ``kill_at_step``; waits until A's
job, re-formed with one node, has trained ``alone_steps`` steps past the last one done with two; then
(``grow_back``) releases a new agent B, started warm while the job re-formed, which joins: A's agent
stops its worker with SIGTERM to admit it, the worker saves the step it is at (the trainer's preemption
notice), and the job re-forms with two nodes from that step. Every wait has a deadline, and nothing it
started outlives it. Every agent runs with :data:`ddpkit.elastic.AGENT_ENV`, without which a returning
node cannot join (:mod:`ddpkit.elastic` says why). The returning agent has ``--max-restarts 0``: its
worker must resume the job's checkpoint at once, although its agent's restart count is 0.

The summary comes from the trainer's own logs: the rounds (world size, accumulation, torchrun's restart
count, from :data:`ddpkit.elastic.MEMBERSHIP_LOG`), the step each round resumed from, the steps done
twice (lost work: done before a membership change, after the checkpoint the next round resumed from),
the seconds from the death to training again, split into re-rendezvous, worker start and restore, and
the summary's ``data_sha256`` and ``param_sha256``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

from ddpkit.elastic import AGENT_ENV, MEMBERSHIP_LOG, agent_command
from ddpkit.metrics import read_metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_flags(workdir: str, steps: int, checkpoint_every: int, step_s: float) -> list[str]:
    """``ddpkit train`` flags of the drill. ``--fail-mode slow`` on rank 0 from step 0 makes every step last
    at least ``step_s`` (the other rank waits for it in the all-reduce), so the kill lands mid-run. The
    collective timeout is generous: a killed peer is noticed at once (its connections close), while a
    live one can be more than 10 s late to its first collective on a busy machine (seen: a spurious
    restart of the first round)."""
    return ["--steps", str(steps), "--micro-batch-size", "8", "--dataset-size", "2048", "--backend", "gloo",
            "--checkpoint-dir", os.path.join(workdir, "ckpt"), "--checkpoint-every", str(checkpoint_every),
            "--metrics-dir", os.path.join(workdir, "metrics"), "--summary-json", os.path.join(workdir, "summary.json"),
            "--fail-mode", "slow", "--fail-at-step", "0", "--fail-rank", "0", "--slow-step-s", str(step_s),
            "--timeout", "30", "--log-every", "1000"]


def _events(workdir: str) -> list[dict]:
    metrics = os.path.join(workdir, "metrics")
    return read_metrics(metrics, event=None) if os.path.isdir(metrics) else []


def rounds(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics", MEMBERSHIP_LOG)
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.endswith("\n")]


def run_elastic(workdir: str, *, steps: int = 40, kill_at_step: int = 12, checkpoint_every: int = 5,
                global_batch_size: int = 16, step_s: float = 0.06, grow_back: bool = True, alone_steps: int = 3,
                timeout_s: float = 240.0, show=print) -> dict:
    from ddpkit.notebook import kill_tree

    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **AGENT_ENV}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    flags = train_flags(workdir, steps, checkpoint_every, step_s)
    agents: dict[str, subprocess.Popen] = {}

    def start(name: str) -> subprocess.Popen:  # warm: torch imported, the agent not yet started
        out = open(os.path.join(workdir, f"agent-{name}.out"), "w")  # noqa: SIM115 - closed by the child
        cmd = agent_command(port, f"elastic-{port}", global_batch_size, flags, is_host=name == "A")
        if name == "B2":  # the returning node: its worker must resume the job's checkpoint at once, no restart
            cmd[cmd.index("--max-restarts") + 1] = "0"
        cmd[1:3] = ["-m", "ddpkit.elastic_drill", "--release", os.path.join(workdir, f"release-{name}"), "--"]
        agents[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        return agents[name]

    def release(*names: str) -> None:
        for name in names:
            open(os.path.join(workdir, f"release-{name}"), "w").close()

    def reached(step: int, world: int) -> bool:
        return bool(rounds(workdir)) and rounds(workdir)[-1]["world_size"] == world and any(
            e["event"] == "step" and e["step"] >= step and e["time"] > rounds(workdir)[-1]["time"] for e in _events(workdir))

    deadline, marks = time.monotonic() + timeout_s, {}

    def wait(condition, what: str, a_may_end: bool = False) -> None:
        said = time.monotonic()
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"elastic drill: timed out waiting for {what}")
            for name in ("A", "B2") if not a_may_end else ():
                if name in agents and agents[name].poll() is not None:
                    raise RuntimeError(f"elastic drill: agent {name} ended (exit {agents[name].returncode}) "
                                       f"waiting for {what}")
            if time.monotonic() - said > 5:  # never silent for long
                said = time.monotonic()
                show(f"... waiting for {what} (the job is at step {_last_step(workdir)})")
            time.sleep(0.05)
    try:
        # the agents start warm and are released together, so both join the first round (a round closes
        # last_call_timeout after its minimum joined)
        for name in ("A", "B"):
            start(name)
        release("A", "B")
        wait(lambda: reached(kill_at_step, 2), f"step {kill_at_step} with two nodes")
        marks["killed"] = time.time()
        kill_tree(agents["B"].pid)
        agents["B"].wait()
        done = _last_step(workdir)
        show(f"node B (its agent and its worker) SIGKILLed after step {done}")
        if grow_back:
            start("B2")  # warm while the job re-forms: a spare machine standing by
        wait(lambda: reached(0, 1), "the job to go on with one node")
        resumed = _restored(workdir)[-1]
        show(f"one node: the job re-formed (world 1, accumulation {rounds(workdir)[-1]['grad_accum']}) "
             f"and resumed from step {resumed}")
        if grow_back:
            wait(lambda: reached(done + alone_steps, 1), f"{alone_steps} steps past step {done} with one node")
            marks["returned"] = time.time()
            release("B2")
            show(f"node B returns (a new agent) after step {_last_step(workdir)}")
            wait(lambda: reached(0, 2), "the job to grow back to two nodes")
            show(f"two nodes again: the job re-formed (world 2, accumulation {rounds(workdir)[-1]['grad_accum']}) "
                 f"and resumed from step {_restored(workdir)[-1]}")
        ending = [name for name in agents if name != "B"]
        wait(lambda: all(agents[n].poll() is not None for n in ending), f"step {steps}", a_may_end=True)
        codes = {name: agents[name].returncode for name in ending}
        show(f"done: step {_last_step(workdir)} with {rounds(workdir)[-1]['world_size']} node(s)")
    finally:
        for proc in agents.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    if set(codes.values()) != {0}:
        tails = {n: open(os.path.join(workdir, f"agent-{n}.out")).read()[-1500:] for n in codes if codes[n]}
        raise RuntimeError(f"elastic drill: agents exited {codes}: {tails}")
    return summarize(workdir, marks)


def _last_step(workdir: str) -> int:
    return max((e["step"] for e in _events(workdir) if e["event"] == "step"), default=0)


def _restored(workdir: str) -> list[int]:
    return [e["step"] for e in _events(workdir) if e["event"] == "checkpoint_restored" and e["rank"] == 0]


def summarize(workdir: str, marks: dict) -> dict:
    events = sorted(_events(workdir), key=lambda e: e["time"])
    membership = rounds(workdir)
    with open(os.path.join(workdir, "summary.json")) as handle:
        final = json.load(handle)
    killed = marks["killed"]
    done_before = max(e["step"] for e in events if e["event"] == "step" and e["time"] <= killed)
    shrink = next(r for r in membership if r["time"] > killed)
    restored = next(e for e in events if e["event"] == "checkpoint_restored" and e["time"] > killed)
    first = next(e for e in events if e["event"] == "step" and e["time"] > restored["time"])
    return {
        "rounds": [{"world_size": r["world_size"], "grad_accum": r["grad_accum"], "restart_count": r["restart_count"],
                    "global_batch": 8 * r["grad_accum"] * r["world_size"]} for r in membership],
        "resumed_from": _restored(workdir),
        "lost_steps": done_before - restored["step"],  # done before the death, after the newest checkpoint
        "rendezvous_s": shrink["time"] - killed,  # the death noticed, the workers stopped, a round with one node
        "worker_start_s": restored["time"] - shrink["time"] - _restore_s(events, restored),
        "restore_s": _restore_s(events, restored),
        "first_step_s": first["time"] - restored["time"],
        "back_s": first["time"] - killed,  # from the death to the first step after it
        "steps": final["steps"],
        "data_sha256": final["data_sha256"], "param_sha256": final["param_sha256"],
        **(_grown(events, membership, marks["returned"]) if "returned" in marks else {}),
    }


def _grown(events: list[dict], membership: list[dict], returned: float) -> dict:
    """The grow-back: the step A's worker saved when its agent stopped it, the step the two-node round
    resumed from, the steps done twice (0 when the save covered every step done), the seconds it took."""
    grow = next(r for r in membership if r["time"] > returned)
    before = [e for e in events if e["time"] < grow["time"]]
    done_before = max(e["step"] for e in before if e["event"] == "step")
    saved = [e["step"] for e in before if e["event"] == "preempted" and e["time"] > returned and e.get("saved")]
    restored = next(e for e in events if e["event"] == "checkpoint_restored" and e["time"] > grow["time"])
    first = next(e for e in events if e["event"] == "step" and e["time"] > restored["time"])
    return {"grow_saved_step": saved[-1] if saved else None, "grow_resumed_from": restored["step"],
            "grow_lost_steps": done_before - restored["step"], "grow_back_s": first["time"] - returned}


def _restore_s(events: list[dict], restored: dict) -> float:
    started = [e["time"] for e in events if e["event"] == "started" and e["rank"] == 0 and e["time"] <= restored["time"]]
    return restored["time"] - max(started)


def main(argv: list[str] | None = None) -> int:
    """``python -m ddpkit.elastic_drill --release FILE -- <torchrun flags>``: a torchrun agent started warm.

    Importing torch takes seconds on a busy machine; this process does it, waits until ``FILE`` exists,
    then runs torchrun's own entry point (``torch.distributed.run.main``) with the flags. So both agents
    join the first round together, whatever the machine's load."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ddpkit.elastic_drill")
    parser.add_argument("--release", required=True)
    parser.add_argument("--wait-s", type=float, default=240.0)
    parser.add_argument("torchrun", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    from torch.distributed.run import main as torchrun_main

    deadline = time.monotonic() + args.wait_s
    while not os.path.exists(args.release):
        if time.monotonic() > deadline:
            print(f"ddpkit.elastic_drill: not released within {args.wait_s:.0f} s", file=sys.stderr)
            return 1
        time.sleep(0.02)
    torchrun_main(args.torchrun[1:] if args.torchrun[:1] == ["--"] else args.torchrun)
    return 0


if __name__ == "__main__":
    sys.exit(main())
