"""Two torchrun agents as two "nodes" on this machine: lose one, go on with the other, grow back.

:func:`run_elastic` starts agent A (it hosts the c10d rendezvous store) and agent B, each with one
worker (:mod:`ddpkit.elastic` around ``ddpkit train``, checkpointing every few steps); SIGKILLs agent B and
its worker (:func:`ddpkit.notebook.kill_tree`) once the job passed ``kill_at_step``; waits until A's
job, re-formed with one node, has trained ``alone_steps`` steps past the last one done with two; then
(``grow_back``) starts a new agent B, which joins: A's agent stops its worker with SIGTERM to admit it,
the worker saves the step it is at (the trainer's preemption notice), and the job re-forms with two
nodes from that step. Every wait has a deadline, and nothing it started outlives it. Every agent runs
with :data:`ddpkit.elastic.AGENT_ENV`, without which a returning node cannot join (:mod:`ddpkit.elastic`
says why). The returning agent has ``--max-restarts 0``: its worker must resume the job's checkpoint at
once, although its agent's restart count is 0.

**Where the time goes.** Each agent is torchrun's own entry point (``torch.distributed.run.main``) in a
process *forked* from the caller, which has imported torch already: a node's agent is up in
milliseconds, not the seconds of CPU a cold ``import torch`` costs (on a busy 2-core machine that is
tens of seconds of wall time, three times over). What cannot be saved is the workers: torchrun starts
each one as a new program, so each of the five (two, then one, then two) imports torch and builds its
trainer, and that is most of what the drill costs. The rendezvous adds its own waits: a dead node is
noticed when its heartbeats are ``keep_alive_interval x keep_alive_max_attempt`` old, a round closes
``last_call_timeout`` after its minimum joined, and torchrun polls the store once a second while it
waits (``_DistributedRendezvousOpExecutor.run``).

The summary comes from the trainer's own logs: the rounds (world size, accumulation, torchrun's restart
count, from :data:`ddpkit.elastic.MEMBERSHIP_LOG`), the step each round resumed from, the steps done
twice (lost work: done before a membership change, after the checkpoint the next round resumed from),
the seconds from the death to training again, split into re-rendezvous, the new worker's imports, its
process group, building its trainer and restoring the checkpoint, and the summary's ``data_sha256`` and
``param_sha256``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import time
import traceback
import warnings

from ddpkit.elastic import AGENT_ENV, MEMBERSHIP_LOG, agent_command
from ddpkit.metrics import read_metrics
from ddpkit.rank import FORK_WARNING
from ddpkit.runtime import die_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_flags(workdir: str, steps: int, checkpoint_every: int, step_s: float) -> list[str]:
    """``ddpkit train`` flags of the drill. ``--fail-mode slow`` on rank 0 from step 0 makes every step last
    at least ``step_s`` (the other rank waits for it in the all-reduce), so the kill lands mid-run, and the
    job is still training when a returning node has been admitted (1-2 s on a busy machine). The
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


class Agent:
    """A torchrun agent forked by :func:`fork_agent`: ``pid``, ``poll()``, ``wait()`` and ``returncode`` as
    :class:`subprocess.Popen` has them."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout_s: float = 30.0) -> int:
        end = time.monotonic() + timeout_s
        while self.poll() is None:
            if time.monotonic() > end:
                raise TimeoutError(f"torchrun agent {self.pid} did not exit within {timeout_s:.0f} s")
            time.sleep(0.02)
        return self.returncode


def fork_agent(argv: list[str], env: dict[str, str], out: str) -> Agent:
    """``torchrun ARGV`` (torch's own entry point, ``torch.distributed.run.main``) in a child forked from
    this process, in a session of its own (a node of its own: a signal to the caller's process group
    does not reach it), its output in ``out``, its environment ``env``.

    Forking skips the cold start: this process imported torch once, and every agent inherits it. The
    agent starts no thread before it runs (torchrun starts its own, after the fork), and the caller's
    threads (a notebook kernel's) do not exist in the child; its output streams, and the logging
    handlers that hold them, are replaced first, so nothing in the child writes to the caller's."""
    from torch.distributed.run import main as torchrun_main  # imported once, here, before any fork

    sys.stdout.flush()
    sys.stderr.flush()  # a forked child must not inherit (and print again) unflushed output
    with warnings.catch_warnings():  # Python 3.12 warns about forking a threaded process: see ddpkit.launch
        warnings.filterwarnings("ignore", message=FORK_WARNING, category=DeprecationWarning)
        pid = os.fork()
    if pid:
        return Agent(pid)
    code = 1
    try:
        os.setsid()
        die_with_parent()  # an agent never outlives the drill, however it ended
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the child ends with os._exit
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                          if isinstance(lg, logging.Logger))]
        for handler in {h for lg in loggers for h in lg.handlers}:  # torch's own log handler holds the caller's stderr
            if type(handler) is logging.StreamHandler:
                handler.setStream(sys.stderr)
        os.environ.clear()
        os.environ.update(env)
        torchrun_main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a forked child must never return into the caller
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no teardown of the caller's state (atexit hooks, a kernel's threads)


def run_elastic(workdir: str, *, steps: int = 40, kill_at_step: int = 8, checkpoint_every: int = 5,
                global_batch_size: int = 16, step_s: float = 0.1, grow_back: bool = True, alone_steps: int = 3,
                timeout_s: float = 240.0, show=print) -> dict:
    from ddpkit.notebook import kill_tree

    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **AGENT_ENV}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    flags = train_flags(workdir, steps, checkpoint_every, step_s)
    agents: dict[str, Agent] = {}
    deadline, marks = time.monotonic() + timeout_s, {}

    def start(name: str) -> None:
        # the returning node has --max-restarts 0: its worker must resume the job's checkpoint at once
        cmd = agent_command(port, f"elastic-{port}", global_batch_size, flags, is_host=name == "A",
                            max_restarts=0 if name == "B2" else 3)
        agents[name] = fork_agent(cmd[3:], env, os.path.join(workdir, f"agent-{name}.out"))  # cmd[3:]: torchrun's argv

    def wait(condition, what: str, a_may_end: bool = False) -> None:
        said = time.monotonic()
        while not condition(*_progress(workdir)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"elastic drill: timed out waiting for {what}")
            for name in ("A", "B2") if not a_may_end else ():
                if name in agents and agents[name].poll() is not None:
                    hint = " (the job ended first: more --steps give a returning node time to be admitted)" \
                        if agents[name].returncode == 0 else ""
                    raise RuntimeError(f"elastic drill: agent {name} ended (exit {agents[name].returncode}) "
                                       f"waiting for {what}{hint}")
            if time.monotonic() - said > 3:  # never silent for long
                said = time.monotonic()
                show(f"... waiting for {what} (the job is at step {_last_step(_progress(workdir)[1])})")
            time.sleep(0.1)

    def reached(step: int, world: int):
        return lambda membership, events: bool(membership) and membership[-1]["world_size"] == world and any(
            e["event"] == "step" and e["step"] >= step and e["time"] > membership[-1]["time"] for e in events)

    try:
        marks["agents"] = time.time()
        for name in ("A", "B"):  # both join the first round (it closes last_call_timeout after the first joined)
            start(name)
        wait(reached(kill_at_step, 2), f"step {kill_at_step} with two nodes")
        marks["killed"] = time.time()
        kill_tree(agents["B"].pid)
        agents["B"].wait()
        done = _last_step(_events(workdir))
        show(f"node B (its agent and its worker) SIGKILLed after step {done}")
        wait(reached(0, 1), "the job to go on with one node")
        show(f"one node: the job re-formed (world 1, accumulation {rounds(workdir)[-1]['grad_accum']}) "
             f"and resumed from step {_restored(_events(workdir))[-1]}")
        if grow_back:
            wait(reached(done + alone_steps, 1), f"{alone_steps} steps past step {done} with one node")
            marks["returned"], marks["returned_after_step"] = time.time(), _last_step(_events(workdir))
            start("B2")
            show(f"node B returns (a new agent) after step {_last_step(_events(workdir))}")
            wait(reached(0, 2), "the job to grow back to two nodes")
            show(f"two nodes again: the job re-formed (world 2, accumulation {rounds(workdir)[-1]['grad_accum']}) "
                 f"and resumed from step {_restored(_events(workdir))[-1]}")
        ending = [name for name in agents if name != "B"]
        wait(lambda *_: all(agents[n].poll() is not None for n in ending), f"step {steps}", a_may_end=True)
        codes = {name: agents[name].returncode for name in ending}
        show(f"done: step {_last_step(_events(workdir))} with {rounds(workdir)[-1]['world_size']} node(s)")
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                kill_tree(agent.pid)
                agent.wait()
    if set(codes.values()) != {0}:
        tails = {n: open(os.path.join(workdir, f"agent-{n}.out")).read()[-1500:] for n in codes if codes[n]}
        raise RuntimeError(f"elastic drill: agents exited {codes}: {tails}")
    return summarize(workdir, marks)


def _progress(workdir: str) -> tuple[list[dict], list[dict]]:
    return rounds(workdir), _events(workdir)


def _last_step(events: list[dict]) -> int:
    return max((e["step"] for e in events if e["event"] == "step"), default=0)


def _restored(events: list[dict]) -> list[int]:
    return [e["step"] for e in events if e["event"] == "checkpoint_restored" and e["rank"] == 0]


def summarize(workdir: str, marks: dict) -> dict:
    """The drill from its logs. ``rounds`` start with the first round of two nodes: a round that closed
    before the second agent joined (``formation_rounds``, 0 unless the machine delayed that agent past
    ``last_call_timeout``) is the job forming, not a membership change."""
    events = sorted(_events(workdir), key=lambda e: e["time"])
    membership = rounds(workdir)
    formed = next(i for i, r in enumerate(membership) if r["world_size"] == 2)
    formation, membership = membership[:formed], membership[formed:]
    with open(os.path.join(workdir, "summary.json")) as handle:
        final = json.load(handle)
    killed = marks["killed"]
    done_before = max(e["step"] for e in events if e["event"] == "step" and e["time"] <= killed)
    shrink = next(r for r in membership if r["time"] > killed)
    restored = next(e for e in events if e["event"] == "checkpoint_restored" and e["time"] > killed)
    first = next(e for e in events if e["event"] == "step" and e["time"] > restored["time"])
    first_ever = next(e for e in events if e["event"] == "step" and e["time"] > membership[0]["time"])
    spawned = shrink.get("process_start") or shrink["time"]  # the worker's process began: the round was complete
    return {
        "rounds": [{"world_size": r["world_size"], "grad_accum": r["grad_accum"], "restart_count": r["restart_count"],
                    "global_batch": 8 * r["grad_accum"] * r["world_size"]} for r in membership],
        "formation_rounds": len(formation),
        "resumed_from": _restored(events), "shrink_resumed_from": restored["step"],
        "lost_steps": done_before - restored["step"],  # done before the death, after the newest checkpoint
        "first_step_after_start_s": first_ever["time"] - marks["agents"],  # two agents up, a round, two workers
        "rendezvous_s": spawned - killed,  # the death noticed, the workers stopped, a round with one node
        "worker_import_s": shrink["time"] - spawned,  # a new Python imports torch (the ddpkit package does, first)
        # then the trainer's own modules and a process group; then the trainer built (its optimizer imports
        # torch._dynamo) and the checkpoint read
        "worker_start_s": restored["time"] - shrink["time"] - _restore_s(events, restored),
        "restore_s": _restore_s(events, restored),
        "first_step_s": first["time"] - restored["time"],
        "back_s": first["time"] - killed,  # from the death to the first step after it
        "steps": final["steps"],
        "data_sha256": final["data_sha256"], "param_sha256": final["param_sha256"],
        **(_grown(events, membership, marks["returned"]) | {"returned_after_step": marks["returned_after_step"]}
           if "returned" in marks else {}),
    }


def _grown(events: list[dict], membership: list[dict], returned: float) -> dict:
    """The grow-back: the step A's worker saved when its agent stopped it, the step the two-node round
    resumed from, the steps done twice (0 when the save covered every step done), the seconds it took."""
    grow = next(r for r in membership if r["time"] > returned)
    before = [e for e in events if e["time"] < grow["time"]]
    done_before = max(e["step"] for e in before if e["event"] == "step")
    saved = [e for e in before if e["event"] == "preempted" and e["time"] > returned and e.get("saved")]
    restored = next(e for e in events if e["event"] == "checkpoint_restored" and e["time"] > grow["time"])
    first = next(e for e in events if e["event"] == "step" and e["time"] > restored["time"])
    return {"grow_saved_step": saved[-1]["step"] if saved else None, "grow_resumed_from": restored["step"],
            "grow_lost_steps": done_before - restored["step"], "grow_back_s": first["time"] - returned,
            "grow_admitted_s": saved[-1]["time"] - returned if saved else None}  # the new agent seen, A's worker saved


def _restore_s(events: list[dict], restored: dict) -> float:
    started = [e["time"] for e in events if e["event"] == "started" and e["rank"] == 0 and e["time"] <= restored["time"]]
    return restored["time"] - max(started)
