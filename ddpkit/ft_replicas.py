"""One replica group of a torchft job: a training loop that survives the loss of another replica.

torchft (``pip install 'ddpkit[ft]'``) splits a data-parallel job into **replica groups** that can fail
and come back one at a time. A *lighthouse* (one small server for the whole job) forms a **quorum**
before each step: the replica groups that are alive and asking. Each group's ``torchft.Manager``

* asks the lighthouse for the step's quorum (``start_quorum``) and, when the members changed,
  reconfigures its process group to exactly those members (no process restarts);
* **heals** a group that is behind (a restarted one at step 0): it receives the weights and optimizer
  state of a live peer (over HTTP by default) before the step, and takes the peer's step number;
* all-reduces the gradients over the quorum (``manager.allreduce``: SUM, then divided by the number of
  participants); a collective that fails (a peer died in the middle) is recorded, not raised;
* decides per step whether to apply it (``should_commit``): only when no error happened and enough
  replicas took part. A step that is not committed is not applied; the loop simply runs it again.

This file is that loop for one replica group of one process, run as
``python -m ddpkit.ft_replicas --replica-id R --lighthouse ADDR --log FILE ...``; it writes one JSON
line per event (joined, step, dying, crashed, done) to ``FILE``. :mod:`ddpkit.ft_drill` starts, kills and
restarts these processes and reads the logs. The fault is injected by the replica itself, at an exact
point: after committing a step (``--die-mode between``) or after the first of its gradients' all-reduces
of a step and before the second (``--die-mode allreduce``), with SIGKILL, as a lost machine would. The
dying replica counts its calls of ``manager.allreduce`` to find that point; the survivor runs torchft as is.

How the gradients are averaged (``--wrapper``), three ways torchft 0.2.0 offers, only the first of which
survives a peer dying in the middle of a step:

* ``manual`` (the lesson's): ``manager.allreduce(param.grad).wait()`` for each gradient, by hand. A failed
  all-reduce is recorded by the manager (``_ManagedWork.wait`` catches the error and returns False),
  ``should_commit()`` says no, and the step is run again;
* ``ddp``: ``torchft.ddp.DistributedDataParallel``, torch's DDP with a comm hook that calls
  ``manager.allreduce(bucket.buffer())``, ``wait()``, then ``assert fut._fut`` on the work's future. After a
  failed all-reduce that ``wait()`` returned early, before it built the future chain, so the assertion
  fails inside ``backward()`` and the *survivor* crashes: the one process the fault tolerance was for.
  (Buckets are one parameter each here, ``bucket_cap_mb`` tiny, so a death can fall between two of them.);
* ``pure``: ``torchft.ddp.PureDistributedDataParallel``, a gradient hook that calls ``manager.allreduce``
  and never waits. The averaging (a division by the participants) is a callback torchft runs only on
  ``wait()``, so it never runs: each step applies the *sum* of the replicas' gradients, not their mean,
  and the optimizer may even read a gradient the all-reduce is still writing. It trains differently from
  the manual loop from the first step, with no failure at all.

Source: torchft 0.2.0, ``torchft/manager.py`` (``start_quorum``, ``allreduce``, ``should_commit``) and
``torchft/optim.py`` (``OptimizerWrapper`` calls ``start_quorum`` in ``zero_grad`` and
``should_commit`` in ``step``; this loop calls them by hand, so each one is visible).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
from torch import nn

MISSING = "torchft is not installed: pip install 'ddpkit[ft]' (per-replica fault tolerance needs it)"
WIDTH, CLASSES, BATCH = 16, 4, 32
WRAPPERS = ("manual", "ddp", "pure")
BUCKET_CAP_MB = 1e-6  # torchft's DDP wrapper: one bucket per parameter, so there are several all-reduces a step


def available() -> bool:
    """True when torchft can be imported (the optional extra ``ddpkit[ft]``)."""
    # torchft's Rust side logs every quorum tick at INFO to stderr, read from RUST_LOG when it is first
    # imported; WARN keeps a notebook's log readable (a RUST_LOG already set wins)
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft  # noqa: F401
    except ImportError:
        return False
    return True


def param_sha256(model: nn.Module) -> str:
    """sha256 of the model's state dict (sorted keys, raw bytes): equal hashes mean bitwise equal weights."""
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def make_model() -> nn.Module:
    """The same initial weights in every process (seeded); a restarted replica starts from these too."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def batch(step: int, participant: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of the ``participant``-th replica in the quorum at ``step``: a function of both alone, so a
    replica that retries a step, or heals and takes over a step number, trains on the samples that step owns."""
    gen = torch.Generator().manual_seed(1_000 * step + participant)
    targets = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    inputs = torch.randn(BATCH, WIDTH, generator=gen) + nn.functional.one_hot(targets, WIDTH).float() * 3
    return inputs, targets


class EventLog:
    """One JSON object per line, flushed at once: the controller reads it while the replica runs, and a
    SIGKILL loses nothing written before it."""

    def __init__(self, path: str, replica: int):
        self.handle, self.replica = open(path, "a", buffering=1), replica

    def write(self, event: str, **fields) -> None:
        self.handle.write(json.dumps({"event": event, "replica": self.replica, "time": time.time(), **fields}) + "\n")
        self.handle.flush()


def wait_for_gate(gate_dir: str, replica: int, replicas: int, timeout_s: float) -> None:
    """Every first-generation replica waits until all are up before its first quorum, so the first quorum
    has them all (the lighthouse would otherwise start with whoever asked first; ``min_replicas`` cannot
    be used for this, since the job must then go on with fewer)."""
    open(os.path.join(gate_dir, f"ready-{replica}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while len([n for n in os.listdir(gate_dir) if n.startswith("ready-")]) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {replica}: not all {replicas} replicas started within {timeout_s:.0f} s")
        time.sleep(0.02)


def train(args: argparse.Namespace) -> None:
    from torchft import Manager, ProcessGroupGloo

    log = EventLog(args.log, args.replica_id)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # momentum: state a heal must carry

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    # each replica group has its own TCPStore (its own ranks meet there; here one rank per group)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    seconds = timedelta(seconds=args.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=seconds), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
                      use_async_quorum=False,  # quorum (and healing) finish before the step's forward
                      # Both first replicas build the same seeded model (their "joined" events log the same
                      # sha), so step 0 needs no heal. A heal at step 0 would also race a wrapper that never
                      # waits: the source serves its state only until its should_commit(), which such a
                      # wrapper reaches in milliseconds (seen under load: the peer's fetch timed out, again
                      # at every step). A replica that joins later still heals (its step is behind).
                      init_sync=False,
                      timeout=seconds, quorum_timeout=timedelta(seconds=4 * args.timeout), connect_timeout=seconds,
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=args.lighthouse, replica_id=f"replica_{args.replica_id}", hostname="localhost")
    if args.gate:
        wait_for_gate(args.gate, args.replica_id, args.replicas, args.timeout * 4)
    calls = inject_death(manager, args, log)
    net = wrap(model, manager, args.wrapper)
    deadline, first, together = time.monotonic() + args.run_timeout, True, 0
    try:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {args.replica_id}: not done within {args.run_timeout:.0f} s")
            manager.start_quorum(allow_heal=not args.no_heal)
            step, participants = manager.current_step(), manager.num_participants()
            if first:  # after a heal, the step and the weights are the live peer's
                log.write("joined", step=step, participants=participants, sha=param_sha256(model))
                first = False
                if args.exit_after_join:
                    break
            before = param_sha256(model)
            optimizer.zero_grad()
            calls[0] = 0
            inputs, targets = batch(step, manager.participating_rank() or 0)
            loss = nn.functional.cross_entropy(net(inputs), targets)
            try:
                loss.backward()  # the ddp and pure wrappers all-reduce from inside backward
            except Exception as exc:
                log.write("crashed", step=step, error=type(exc).__name__, message=str(exc)[:300], where=where(exc))
                raise
            if args.wrapper == "manual":
                for param in model.parameters():
                    manager.allreduce(param.grad).wait()  # one at a time: the failure point is exact
            committed = manager.should_commit()
            if committed or args.ignore_commit:
                optimizer.step()
            after = param_sha256(model)
            log.write("step", step=step, committed=committed, participants=participants, loss=loss.item(),
                      sha_before=before, sha=after)
            if args.die_mode == "between" and committed and manager.current_step() == args.die_at_step:
                die(log, step, "after committing the step")
            together = together + 1 if committed and participants == args.end_replicas else 0
            if manager.current_step() >= args.steps and together >= 2:  # every replica sees the same quorums
                break
            time.sleep(args.step_sleep)  # pacing, so the survivor's steps alone are countable
        log.write("done", step=manager.current_step(), sha=param_sha256(model))
    finally:
        manager.shutdown(wait=False)


def wrap(model: nn.Module, manager, wrapper: str) -> nn.Module:
    """The module the loop calls forward on: the model itself (``manual``) or one of torchft's DDP wrappers."""
    if wrapper == "ddp":
        from torchft.ddp import DistributedDataParallel

        return DistributedDataParallel(manager, model, bucket_cap_mb=BUCKET_CAP_MB)
    if wrapper == "pure":
        from torchft.ddp import PureDistributedDataParallel

        return PureDistributedDataParallel(manager, model)
    return model


def inject_death(manager, args: argparse.Namespace, log: EventLog) -> list[int]:
    """With ``--die-mode allreduce``: SIGKILL this process at ``--die-at-step`` when its second
    ``manager.allreduce`` of the step is called, whichever wrapper calls it. Returns the step's call counter
    (the loop resets it). Only the dying replica's manager is patched; a survivor's runs torchft's code as is."""
    calls = [0]
    if args.die_mode != "allreduce":
        return calls
    allreduce = manager.allreduce

    def counted(tensor, *rest, **kwargs):
        if manager.current_step() == args.die_at_step and calls[0] == 1:
            die(log, args.die_at_step, "between two gradients' all-reduces")
        calls[0] += 1
        return allreduce(tensor, *rest, **kwargs)

    manager.allreduce = counted  # the DDP wrapper's comm hook calls manager.allreduce too: it finds this one
    return calls


def where(exc: BaseException) -> str:
    """``file:line (function)`` of the innermost frame an exception was raised in: where a crash happened."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "?"
    code = tb.tb_frame.f_code
    parts = code.co_filename.replace(os.sep, "/").split("/")
    return f"{'/'.join(parts[-2:])}:{tb.tb_lineno} ({code.co_name})"


def die(log: EventLog, step: int, point: str) -> None:
    log.write("dying", step=step, where=point)
    os.kill(os.getpid(), signal.SIGKILL)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddpkit.ft_replicas", description=__doc__.splitlines()[0])
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--replicas", type=int, default=2, help="replica groups that start together (with --gate)")
    p.add_argument("--end-replicas", type=int, default=2, help="replica groups that must train together at the end")
    p.add_argument("--lighthouse", required=True, help="the lighthouse's address (http://host:port)")
    p.add_argument("--log", required=True, help="JSON-lines event log")
    p.add_argument("--steps", type=int, default=20, help="stop once this step is committed with every replica back")
    p.add_argument("--die-at-step", type=int, default=-1)
    p.add_argument("--die-mode", choices=("none", "between", "allreduce"), default="none")
    p.add_argument("--wrapper", choices=WRAPPERS, default="manual",
                   help="how gradients are averaged: by hand with wait() (works), or torchft's DDP wrappers")
    p.add_argument("--no-heal", action="store_true", help="never receive a live peer's state (the negative control)")
    p.add_argument("--ignore-commit", action="store_true", help="step even when should_commit() says no (the negative control)")
    p.add_argument("--exit-after-join", action="store_true", help="stop after the first quorum (to inspect a join)")
    p.add_argument("--gate", default="", help="folder where the first replicas wait for each other")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for a collective, an RPC, a heal")
    p.add_argument("--run-timeout", type=float, default=60.0)
    p.add_argument("--step-sleep", type=float, default=0.02)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not available():
        print(MISSING, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
