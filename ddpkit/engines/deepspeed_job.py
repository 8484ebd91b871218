"""The kit's DeepSpeed job as a command, one process per rank, under ``torchrun`` or DeepSpeed's own launcher.

    torchrun --standalone --nproc-per-node 2 -m ddpkit.engines.deepspeed_job --stage 3 --summary-json out.json
    deepspeed --num_gpus 2 --module ddpkit.engines.deepspeed_job --stage 3 --summary-json out.json

Both launchers start the processes and set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; DeepSpeed's also appends ``--local_rank=N`` to the command (accepted here and not
needed: ``LOCAL_RANK`` says the same). Each process joins the process group over gloo, trains
:func:`ddpkit.engines.deepspeed_run.train_engine` on the kit's job, rank 0 writes the summary, and every
process leaves after a barrier with ``os._exit``, as the kit's torchrun workers do (``ddpkit/cli.py``).

Why ``os._exit``: a process that ends the ordinary way tears down a live process group in C++ destructors
at interpreter exit, and that can abort with "terminate called without an active exception" after
training has finished (seen in 2 of 24 ZeRO-3 runs of an earlier measurement; the exit code is then
non-zero, and the launcher reports the job failed; rare: 0 in 24 torchrun runs of
``benchmarks/deepspeed_exit.py``). ``os._exit`` runs no destructor at all, after a barrier
so that no rank leaves while a peer may still be talking to it. ``--exit interpreter`` ends the ordinary
way instead, and ``--exit destroy`` after ``gc.collect()`` and ``destroy_process_group()`` (what
:func:`ddpkit.runtime.destroy_process_group` does for a process that lives on), to measure what each costs
(``benchmarks/deepspeed_exit.py``).

The launchers differ in one thing that stays on the machine. DeepSpeed's sets ``LOCAL_SIZE`` (the ranks
on this node), torchrun does not. When ``LOCAL_SIZE`` equals the world size, DeepSpeed's CPU
shared-memory op (``deepspeed/ops/csrc/cpu/comm/shm_interface.cpp``) takes every rank to be local and
creates one workspace per rank with ``shm_open``, ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_
<port>_<rank>``, 2 x 1 MiB + 2 x 32 MiB each, and nothing ever unlinks it: every run leaves its world
size of 66 MiB files in ``/dev/shm`` (RAM) until they are removed (:func:`shm_files`, :func:`remove`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

SHM_PREFIX = "deepspeed_allreduce_buffer_"  # SHM_BUFFER_NAME in deepspeed/ops/csrc/cpu/comm/shm.cpp
SHM_DIR = "/dev/shm"
EXITS = ("os-exit", "destroy", "interpreter")


def shm_files() -> dict[str, int]:
    """DeepSpeed's shared-memory workspaces now in ``/dev/shm``: name -> bytes."""
    if not os.path.isdir(SHM_DIR):
        return {}
    out = {}
    for name in os.listdir(SHM_DIR):
        if name.startswith(SHM_PREFIX):
            try:
                out[name] = os.stat(os.path.join(SHM_DIR, name)).st_size
            except FileNotFoundError:  # removed meanwhile
                continue
    return out


def remove(names) -> None:
    """Remove these workspaces from ``/dev/shm`` (what ``shm_unlink`` would have done)."""
    for name in names:
        if not name.startswith(SHM_PREFIX) or os.sep in name:
            raise ValueError(f"not one of DeepSpeed's workspaces: {name!r}")
        try:
            os.remove(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


LAUNCHERS = ("torchrun", "deepspeed")


def command(launcher: str, world_size: int, port: int, job_args: list[str]) -> list[str]:
    """The command line that starts the job's ``world_size`` processes under ``launcher`` on this machine.

    ``deepspeed`` is DeepSpeed's command (``deepspeed.launcher.runner``, the ``deepspeed`` script): on a
    machine without a hostfile it runs its per-node launcher (``deepspeed.launcher.launch``) here, which
    starts the ranks. ``--num_gpus`` is how many processes it starts, GPUs or not."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
                "-m", __name__, *job_args]
    if launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", f"--num_gpus={world_size}",
                f"--master_port={port}", "--module", __name__, *job_args]
    raise ValueError(f"unknown launcher {launcher!r}: use one of {', '.join(LAUNCHERS)}")


def run_under(launcher: str, folder: str, stage: int = 3, steps: int = 4, world_size: int = 2,
              timeout: float = 240.0, exit: str = "os-exit") -> dict:
    """Run the job under ``launcher`` (a bounded subprocess, its output streamed by
    :func:`ddpkit.notebook.run_command`) and return what it left: the exit code, rank 0's summary, the
    DeepSpeed workspaces that appeared in ``/dev/shm`` (name -> bytes) and the wall time."""
    import time

    from ddpkit.engines import require
    from ddpkit.launch import free_port
    from ddpkit.notebook import run_command

    require("deepspeed")
    os.makedirs(folder, exist_ok=True)
    summary_path = os.path.join(folder, f"{launcher}-zero{stage}.json")
    if os.path.exists(summary_path):
        os.remove(summary_path)
    job_args = ["--stage", str(stage), "--steps", str(steps), "--summary-json", summary_path, "--exit", exit]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore::FutureWarning"}
    before, started = shm_files(), time.monotonic()
    proc = run_command(command(launcher, world_size, free_port(), job_args), env=env, timeout=timeout,
                       show=lambda line: line.startswith(("ZeRO-", "ddpkit: error", "Traceback", "terminate called")))
    wall = time.monotonic() - started
    after = shm_files()
    summary = None
    if os.path.exists(summary_path):
        with open(summary_path) as handle:
            summary = json.load(handle)
    return {"launcher": launcher, "returncode": proc.returncode, "summary": summary, "wall_s": wall,
            "shm_new": {k: v for k, v in after.items() if k not in before},
            "aborted": "terminate called" in proc.stdout, "output_tail": proc.stdout[-3000:]}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddpkit.engines.deepspeed_job",
                                description="The kit's job under DeepSpeed ZeRO, one process per rank (torchrun or deepspeed).")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3, help="ZeRO stage (default 3)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    p.add_argument("--summary-json", default="", help="rank 0 writes the losses, the weights' sha256 and more here")
    p.add_argument("--exit", choices=EXITS, default="os-exit",
                   help="os-exit (default): leave after a barrier with os._exit; destroy: gc.collect(), "
                        "destroy_process_group(), then the interpreter's exit; interpreter: the ordinary way")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait (default 60)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # DeepSpeed's launcher adds it
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """One rank of the job (see the module docstring). Exit codes: 0 done, 2 bad input (one line), 1 a failure."""
    args = parse(argv)
    from ddpkit.engines import MissingExtra, require

    try:
        require("deepspeed")  # before the process group: one line, not a traceback from inside DeepSpeed
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError("RANK and WORLD_SIZE are not set: start this under torchrun or deepspeed (see --help)")
    except (MissingExtra, ValueError) as exc:
        print(f"ddpkit: error: {exc}", file=sys.stderr, flush=True)
        return 2
    code = 1
    try:
        code = _train(args)
    except BaseException:  # noqa: BLE001 - reported here, then the process ends
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if args.exit == "os-exit":
            os._exit(code)
    if args.exit == "destroy":  # what ddpkit.runtime.destroy_process_group does for a process that lives on
        from ddpkit import runtime

        runtime.destroy_process_group()
    return code  # then the interpreter exits (--exit interpreter: with the process group still alive)


def _train(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ddpkit import runtime
    from ddpkit.config import TrainConfig
    from ddpkit.engines import deepspeed_run

    deepspeed_run.import_deepspeed()  # DS_ACCELERATOR=cpu before DeepSpeed looks for a GPU
    ctx = runtime.init_process_group(runtime.RankContext.from_env("gloo"), args.timeout)
    cfg = TrainConfig(steps=args.steps, world_size=ctx.world_size, warmup_steps=0, grad_clip=0.0)
    result = deepspeed_run.train_engine(ctx, cfg, deepspeed_run.cpu_config(cfg, ctx.world_size, args.stage))
    if ctx.is_main:
        print(f"ZeRO-{result['stage']}: losses {' '.join(f'{x:.6f}' for x in result['losses'])}, "
              f"param_sha256 {result['param_sha256'][:16]}", flush=True)
        if args.summary_json:
            summary = {k: result[k] for k in ("stage", "losses", "param_sha256", "bytes")}
            summary |= {"world_size": ctx.world_size, "local_size": os.environ.get("LOCAL_SIZE"),
                        "local_rank_argument": args.local_rank}
            with open(args.summary_json, "w") as handle:
                json.dump(summary, handle)
    dist.barrier()  # nobody leaves while a peer may still be talking to it
    return 0


if __name__ == "__main__":
    sys.exit(main())
