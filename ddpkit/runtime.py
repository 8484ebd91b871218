"""Who am I? The runtime plane: one rank's identity, its device, and its process group.

Every distributed program starts by answering four questions: how many processes are in the job
(``world_size``), which one am I (``rank``, unique across the job), which device do I own on my node
(``local_rank``), and which communication backend do we share (gloo on CPU, NCCL on GPU). The answers
live in a :class:`RankContext`, built **once** (from the launcher, or from the environment that
``torchrun`` sets) and passed explicitly to whatever needs it: no module reads distributed state from
globals.

Naming, as in PyTorch's own docs: ``rank`` is global, ``local_rank`` indexes devices on one node, and
``local_world_size`` is the number of ranks on this node. On one node ``rank == local_rank``.
"""

from __future__ import annotations

import datetime
import gc
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl")

DEFAULT_TIMEOUT_S = 30.0  # collective timeout: long enough for a CPU step, short enough for a notebook
"""PyTorch's default is 30 minutes, which in a notebook looks exactly like a hang. Teaching runs want a
stuck collective to raise within seconds, naming what it waited for."""


@dataclass(frozen=True)
class RankContext:
    """One rank's view of the job. Immutable: built once, then passed around."""

    rank: int
    """Global index of this process, 0 .. world_size-1. Rank 0 does the job's one-off work."""
    local_rank: int
    """Index of this process on its node; picks the GPU (``cuda:{local_rank}``)."""
    world_size: int
    """Number of processes in the job."""
    local_world_size: int
    """Number of processes on this node (sets threads per rank on CPU)."""
    backend: str
    """``gloo`` or ``nccl``: already resolved, never ``auto``."""
    device: torch.device
    """Where this rank's tensors live."""

    @property
    def is_main(self) -> bool:
        """True on the rank that writes checkpoints, summaries and the console table."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, backend: str = "auto") -> "RankContext":
        """Build the context from the variables ``torchrun`` (or the ddpkit launcher) sets."""
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"{', '.join(missing)} not set: run under torchrun or ddpkit.launch, "
                "or use RankContext.single_process()"
            )
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        resolved = resolve_backend(backend, local_world_size)
        return cls(rank, local_rank, world_size, local_world_size, resolved,
                   device_for(resolved, local_rank))

    @classmethod
    def single_process(cls) -> "RankContext":
        """A world of one, with no process group: for code that also runs outside a job."""
        return cls(0, 0, 1, 1, "gloo", torch.device("cpu"))


def under_torchrun() -> bool:
    """True when an external launcher (torchrun, SLURM wrapper, ...) already made us a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "DDPKIT_LAUNCHED" not in os.environ


def resolve_backend(requested: str, local_world_size: int) -> str:
    """``auto`` means NCCL when every rank on this node can own a GPU, else gloo on CPU.

    NCCL needs one GPU per rank: two NCCL ranks cannot share one device (Colab gives at most one),
    so asking for it where it cannot work is an error raised here, before anything is spawned.
    """
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}: use one of {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "nccl" if gpus >= local_world_size and dist.is_nccl_available() else "gloo"
    if requested == "nccl":
        if gpus == 0 or not dist.is_nccl_available():
            raise ValueError("backend nccl needs CUDA GPUs and none is available: use --backend gloo (or auto)")
        if gpus < local_world_size:
            raise ValueError(
                f"backend nccl needs one GPU per rank: {local_world_size} ranks on this node but "
                f"{gpus} GPU(s); use --world-size {gpus} or --backend gloo"
            )
    return requested


def device_for(backend: str, local_rank: int) -> torch.device:
    """NCCL ranks own ``cuda:{local_rank}``; gloo ranks compute on the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def threads_per_rank(local_world_size: int) -> int:
    """CPU threads each rank may use so that ranks x threads <= cores (oversubscription thrashes).

    An explicit ``OMP_NUM_THREADS`` (torchrun sets 1 by default) wins: it is the user's choice, and
    numerics must not depend on who launched the job.
    """
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def init_process_group(ctx: RankContext, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the job's process group (env:// rendezvous on MASTER_ADDR:MASTER_PORT) and pin the device."""
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    torch.set_num_threads(threads_per_rank(ctx.local_world_size))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=ctx.backend, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout,
            device_id=ctx.device if ctx.device.type == "cuda" else None, store=_torchelastic_store(ctx, timeout),
        )


def _torchelastic_store(ctx: RankContext, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the agent's store, with this restart's own key space; else None (env://).

    torchrun's agent hosts the rendezvous store and keeps it across ``--max-restarts``. Without a
    per-attempt prefix, the workers of restart N can read keys that the dead workers of restart N-1
    wrote (a peer's old address, barrier counts): measured here as an occasional "connection refused"
    to a dead rank's port, or a hang, during the restarted process group's set-up.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), ctx.world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/ddpkit/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def destroy_process_group() -> None:
    """Leave the process group cleanly.

    ``gc.collect()`` first: objects still holding the group (a DDP reducer, pending work) must be
    freed before the group is, or the rank can abort at exit with "terminate called without an
    active exception" (seen with gloo on torch 2.13).
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every GPU) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
