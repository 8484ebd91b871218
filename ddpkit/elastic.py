"""Elastic membership with torchrun: a job that goes on with fewer nodes when one is lost, and grows back.

``torchrun --nnodes 1:2`` runs one *agent* per node; the agents meet at a rendezvous (here ``c10d``: a
TCPStore hosted by one of the agents) and agree on the members of each **round**. When a worker fails (its
peer's node died in the middle of an all-reduce), its agent stops its workers and starts a new round
(``--max-restarts`` counts these); a round completes with any number of agents between the minimum and
the maximum, once ``last_call_timeout`` has passed after the minimum joined. When an agent joins a job
that is already running, the running agents see it waiting (``num_nodes_waiting``), stop their workers
and start a new round with it: a scale-up, which does not count as a restart (``torch/distributed/elastic/agent/server/api.py``,
``_invoke_run``). Every round restarts **every** worker, which then resumes from the newest checkpoint.

What a worker sees of a scale-up: its agent stops it the way it stops it on its own shutdown. Both go
through ``LocalElasticAgent._shutdown``, which closes the workers with ``os.killpg(worker, SIGTERM)``
and SIGKILLs what is left after a grace period (``torch/distributed/elastic/multiprocessing/api.py``,
``SubprocessContext._close``; each worker leads its own process group). On a membership change the
grace period is 30 s (``_stop_workers`` calls ``_shutdown()`` with its defaults); on the agent's own
SIGTERM it is ``--shutdown-timeout`` (default 30 s) and the signal is the one the agent received (SIGINT
for a Ctrl-C). So the worker cannot tell the two apart, and need not: the trainer treats the SIGTERM as
a preemption notice (every rank stops after the same step and saves it), which in both cases loses no
work: after a scale-up the next round resumes from that very step. The worker's exit code (75) is read
by nobody: the agent drops the results of workers it stopped, and an agent stopped by a signal ends
with that signal's exception (exit code 1).

Three things keep training the same through these changes, and this module provides the first two:

* **the global batch**: with fewer ranks, each rank accumulates more micro-batches, so that
  ``micro x accum x world`` stays the global batch (:func:`accumulation`). Without it the trainer's
  resume refuses, since the global batch, and so the sample stream and the optimizer's steps, would change;
* **the resume**: a worker of a later round resumes from the job's newest checkpoint
  (:func:`later_round`). ``TORCHELASTIC_RESTART_COUNT`` cannot say so: a membership change does not
  count as a restart, and an agent that joins later counts its own restarts from 0;
* **the sample stream**: the trainer's sampler counts progress in global samples, so any world size
  resumes at the same sample; the summary's ``data_sha256`` (every step's global sample ids, folded)
  proves that the stream equals an uninterrupted run's.

A node can join a running job only with :data:`AGENT_ENV` set for every agent: in torch 2.13 the agents
share one TCPStore server with their workers, and an agent that already has its address never
publishes it again (``dynamic_rendezvous.py``, ``next_rendezvous``: the bootstrap store info is built
only on the first round, or when the node becomes rank 0 without a server). A node that joins a later
round then waits for ``MASTER_ADDR`` in that round's keys until the store timeout, and the running
agent waits for its role info in ``_assign_worker_ranks``: both fail (measured: 60 s, then
``DistStoreError: wait timeout``). With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` rank 0 publishes a new
address every round and its worker hosts a fresh store (``torch/distributed/rendezvous.py``).

Run under torchrun as ``python -m ddpkit.elastic --global-batch-size G -- <ddpkit train flags>``: it reads
``WORLD_SIZE``, sets ``--grad-accum`` (and ``--resume`` in a later round) and trains with ``ddpkit train``.
:func:`agent_command` builds the torchrun command. Sources: torch 2.13 ``torch/distributed/run.py``
(``--nnodes MIN:MAX``) and ``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py`` (rounds,
``last_call_timeout``, and ``keep_alive_interval`` x ``keep_alive_max_attempt``, after which a silent
node is dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MEMBERSHIP_LOG = "elastic.jsonl"
# short timeouts for one machine: a round closes 2 s after the minimum joined; a node silent for 4 s is dropped
# (shorter risks dropping a live agent whose heartbeat thread a busy machine delayed: then it forms a job of its own).
# 1 s was seen too short at load 10-12: agents started together, or one rejoining after it stopped its worker for a
# joining node, arrived more than 1 s apart; the first closed a round alone, started a worker, and had to stop it again
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=4,join_timeout=60"
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""The environment every agent of a job that may grow needs (see the module's docstring)."""


def accumulation(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per rank per step that keep ``micro x accum x world == global_batch_size``."""
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise ValueError(f"global batch {global_batch_size} is not a multiple of micro batch {micro_batch_size} x "
                         f"{world_size} ranks: pick a global batch that every world size in --nnodes divides")
    return global_batch_size // per_step


def _flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


def later_round(checkpoint_dir: str | None, run_id: str | None) -> bool:
    """Whether this worker belongs to a later round of job ``run_id`` (torchrun's ``--rdzv-id``): the
    newest checkpoint in ``checkpoint_dir`` with a readable manifest was written by that job. Read-only
    (every worker of every node asks); the trainer verifies the checkpoint it resumes from."""
    if not checkpoint_dir or not run_id:
        return False
    from ddpkit import checkpoint

    for path in checkpoint.list_checkpoints(checkpoint_dir):
        try:
            return checkpoint.read_manifest(path).get("meta", {}).get("run_id") == run_id
        except checkpoint.CheckpointError:  # an interrupted save: the trainer skips it too
            continue
    return False


def worker_argv(train_argv: list[str], global_batch_size: int, world_size: int, adjust: bool = True,
                resume: bool = False) -> list[str]:
    """The ``ddpkit train`` arguments for this round: ``--grad-accum`` set from the world size (or, with
    ``adjust=False``, the negative control, left as given), and ``--resume`` in a later round."""
    if "--grad-accum" in train_argv and adjust:
        raise ValueError("--grad-accum is set from the world size here: give --global-batch-size instead")
    later = ["--resume"] if resume and "--resume" not in train_argv else []
    if not adjust:
        return ["train", *train_argv, *later]
    micro = int(_flag(train_argv, "--micro-batch-size", "8"))
    return ["train", *train_argv, "--grad-accum", str(accumulation(global_batch_size, micro, world_size)), *later]


def agent_command(port: int, run_id: str, global_batch_size: int, train_argv: list[str], *, is_host: bool,
                  nnodes: str = "1:2", max_restarts: int = 3, adjust: bool = True) -> list[str]:
    """One torchrun agent (one "node" with one worker) of an elastic job on this machine.

    ``is_host``: whether this agent hosts the rendezvous store. Every agent whose endpoint names its own
    machine would try to (and the first one to bind the port wins); on one machine that must be said, so
    that the agent that hosts it is not the one that is killed: the store dies with its host, and the
    whole job with it."""
    conf = f"{RDZV_CONF},is_host={'true' if is_host else 'false'}"
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", conf, "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
            "-m", "ddpkit.elastic", "--global-batch-size", str(global_batch_size),
            *([] if adjust else ["--no-adjust"]), "--", *train_argv]


def process_start_time() -> float | None:
    """When this process began (seconds since the epoch), from ``/proc`` (Linux; None elsewhere): for a
    worker, the moment its agent started it, before Python imported anything."""
    try:
        with open("/proc/self/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
        return time.time() - uptime + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in ticks since boot
    except (OSError, ValueError, IndexError):
        return None


def note_membership(metrics_dir: str | None, world_size: int, grad_accum: int | None) -> None:
    """Rank 0 of each round writes who is in it: the world size, the accumulation, torchrun's restart count,
    and when its process began (the time between that and ``time`` is Python importing torch and ddpkit)."""
    if metrics_dir and int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(metrics_dir, exist_ok=True)
        with open(os.path.join(metrics_dir, MEMBERSHIP_LOG), "a") as handle:
            handle.write(json.dumps({"event": "round", "world_size": world_size, "grad_accum": grad_accum,
                                     "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                     "time": time.time(), "process_start": process_start_time()}) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpkit.elastic", description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch-size", type=int, required=True)
    parser.add_argument("--no-adjust", action="store_true", help="keep --grad-accum as given (the negative control)")
    parser.add_argument("train", nargs=argparse.REMAINDER, help="-- then the ddpkit train flags")
    args = parser.parse_args(argv)
    train_argv = args.train[1:] if args.train[:1] == ["--"] else args.train
    if "WORLD_SIZE" not in os.environ:
        print("ddpkit.elastic: run it under torchrun (WORLD_SIZE is not set)", file=sys.stderr)
        return 2
    world = int(os.environ["WORLD_SIZE"])
    resume = later_round(_flag(train_argv, "--checkpoint-dir"), os.environ.get("TORCHELASTIC_RUN_ID"))
    try:
        full = worker_argv(train_argv, args.global_batch_size, world, adjust=not args.no_adjust, resume=resume)
    except ValueError as exc:
        print(f"ddpkit.elastic: {exc}", file=sys.stderr)
        return 2
    accum = _flag(full, "--grad-accum")
    note_membership(_flag(train_argv, "--metrics-dir"), world, int(accum) if accum else None)
    from ddpkit.cli import main as train_main

    return train_main(full)  # under torchrun it ends the process itself (os._exit) with the trainer's code


if __name__ == "__main__":
    sys.exit(main())
