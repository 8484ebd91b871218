"""Who am I? The runtime plane: one rank's identity, its device, its process groups and its layout.

Every distributed program starts by answering four questions: how many processes are in the job
(``world_size``), which one am I (``rank``, unique across the job), which device do I own on my node
(``local_rank``), and which communication backend do we share (gloo on CPU, NCCL on GPU). With more
than one kind of parallelism a fifth: where do I sit in the parallel layout (my data-parallel index,
my tensor-parallel shard, my pipeline stage). The answers live in a :class:`RankContext`, built
**once** (from the launcher, or from the environment that ``torchrun`` sets) and passed explicitly to
whatever needs it: no module reads distributed state from globals.

Naming, as in PyTorch's own docs: ``rank`` is global, ``local_rank`` indexes devices on one node, and
``local_world_size`` is the number of ranks on this node. On one node ``rank == local_rank``.

Two rules that keep numerics and GPUs honest:

* **Threads**: every rank runs **one** intra-op thread unless ``OMP_NUM_THREADS`` says otherwise,
  whoever started it (the ddpkit launcher, fork or spawn, or torchrun, which itself sets ``OMP_NUM_THREADS=1`` only
  when it is unset and ``--nproc-per-node`` > 1), so the same config gives the same bits however it was
  launched. A *forked* rank always runs one: GNU OpenMP's
  thread pool does not survive ``fork`` (a child that opens a parallel region after the parent used
  one hangs in a futex).
* **GPUs are counted without initialising CUDA** (through NVML, as ``torch.cuda.device_count`` does).
  ``torch.cuda.is_available()`` initialises the CUDA driver in the calling process, after which a
  forked child cannot use the GPU, although ``torch.cuda.is_initialized()`` still says False.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
import random
import signal
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpkit.parallel.dims import ParallelDims

BACKENDS = ("auto", "gloo", "nccl")

DEFAULT_TIMEOUT_S = 30.0  # collective timeout: long enough for a CPU step, short enough for a notebook
"""PyTorch's defaults (10 minutes on NCCL, 30 on gloo) look exactly like a hang in a notebook. Teaching runs want a
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
    """Number of processes on this node."""
    backend: str
    """``gloo`` or ``nccl``: already resolved, never ``auto``."""
    device: torch.device
    """Where this rank's tensors live."""
    dims: ParallelDims | None = None
    """The parallel layout; None means pure data parallelism (dp = world)."""
    mesh: Any = None
    """The :class:`~torch.distributed.device_mesh.DeviceMesh` over (pp, dp, tp), built by :meth:`with_dims`
    (collective: every rank calls it; the trainer does). A plain launch does without it."""

    def __post_init__(self) -> None:
        if self.dims is None:
            object.__setattr__(self, "dims", ParallelDims(dp=self.world_size))
        if self.dims.world_size != self.world_size:
            raise ValueError(f"layout {self.dims.describe()} has {self.dims.world_size} ranks, "
                             f"the job has {self.world_size}")

    @property
    def is_main(self) -> bool:
        """True on the rank that writes checkpoints, summaries and the console table."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (which share of the samples it gets)."""
        return self.dims.coords(self.rank)["dp"]

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_group(self):
        """The process group of this rank's data-parallel peers (the world when dp = world)."""
        if self.mesh is None and self.dims.dp == self.world_size:
            return dist.group.WORLD
        return self._mesh_group("dp")

    @property
    def tp_group(self):
        """The process group of this rank's tensor-parallel peers (they hold the slices of the same layers)."""
        return self._mesh_group("tp")

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (which layers it holds)."""
        return self.dims.coords(self.rank)["pp"]

    @property
    def pp_group(self):
        """The process group of this rank's pipeline peers: one rank per stage, same dp and tp coordinates."""
        return self._mesh_group("pp")

    def _mesh_group(self, axis: str):
        if self.mesh is None:
            raise RuntimeError(f"layout {self.dims.describe()} needs its device mesh: ctx = ctx.with_dims(ctx.dims) on every rank")
        return self.mesh.get_group(axis)

    def stage_rank(self, stage: int) -> int:
        """Global rank of this rank's peer on pipeline stage ``stage`` (same dp, cp and tp coordinates)."""
        return self.rank + (stage - self.pp_rank) * self.dims.dp * self.dims.cp * self.dims.tp

    @property
    def world_group(self):
        """Every rank of the job, named explicitly."""
        return dist.group.WORLD

    def with_dims(self, dims: ParallelDims) -> "RankContext":
        """The same rank in another layout, with its mesh (collective: every rank calls it)."""
        if dims == self.dims and self.mesh is not None:
            return self
        return dataclasses.replace(self, dims=dims, mesh=dims.build_mesh(self.device.type))

    @classmethod
    def from_env(cls, backend: str = "auto") -> "RankContext":
        """Build the context from the variables ``torchrun`` (or the ddpkit launcher) sets."""
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in os.environ]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not set: run under torchrun or ddpkit.launch")
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        resolved = resolve_backend(backend, local_world_size)
        return cls(rank, local_rank, world_size, local_world_size, resolved, device_for(resolved, local_rank))


def under_torchrun() -> bool:
    """True when an external launcher (torchrun, a SLURM wrapper, ...) already made us a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "DDPKIT_LAUNCHED" not in os.environ


# ----------------------------------------------------------------------------- devices

def gpu_count() -> int:
    """GPUs this process may use, counted without initialising CUDA here (so forking stays possible).

    ``torch.cuda.device_count()`` asks NVML first, which does not touch the CUDA driver; it falls back
    to the CUDA runtime only when NVML is unusable, so we ask only when NVML can be loaded.
    """
    if not torch.backends.cuda.is_built():
        return 0  # a CPU build of torch
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    if not _nvml_loadable():
        return 0  # counting would initialise CUDA here; without NVML we run on the CPU
    return torch.cuda.device_count()


def _nvml_loadable() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def cuda_touched() -> bool:
    """True when the CUDA driver is live in this process (torch initialised it, or someone called the
    runtime, e.g. ``torch.cuda.is_available()``): a forked child could not use the GPU then.

    The driver library is loaded on first use, never by ``import torch``, so its presence in the
    process's memory map is the tell-tale even when ``torch.cuda.is_initialized()`` says False.
    """
    if torch.cuda.is_initialized():
        return True
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


def resolve_backend(requested: str, local_world_size: int) -> str:
    """``auto`` means NCCL when every rank on this node can own a GPU, else gloo on CPU.

    NCCL needs one GPU per rank: two NCCL ranks cannot share one device (Colab gives at most one),
    so asking for it where it cannot work is an error raised here, before anything is spawned.
    """
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}: use one of {', '.join(BACKENDS)}")
    gpus = gpu_count()
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


def threads_per_rank(forked: bool = False) -> int:
    """Intra-op threads for one rank: ``OMP_NUM_THREADS`` if the user set it, else 1; always 1 if forked."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    requested = int(value) if value.isdigit() and int(value) > 0 else 1
    return 1 if forked else requested


# ----------------------------------------------------------------------------- process group

def init_process_group(ctx: RankContext, timeout_s: float = DEFAULT_TIMEOUT_S, forked: bool = False,
                       store: dist.Store | None = None) -> RankContext:
    """Set this rank's threads, pin its device and join the job's process group (on ``store`` when given,
    else env:// rendezvous on MASTER_ADDR:MASTER_PORT, or one that already exists). Returns the context."""
    torch.set_num_threads(threads_per_rank(forked))
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=ctx.backend, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout,
            device_id=ctx.device if ctx.device.type == "cuda" else None,
            store=store if store is not None else _torchelastic_store(ctx, timeout),
        )
    return ctx


def _torchelastic_store(ctx: RankContext, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the agent's store, with this restart's own key space where that is safe; else
    None (env://).

    torchrun's agent hosts the rendezvous store and keeps it across ``--max-restarts``. Without a
    per-attempt prefix, the workers of restart N can read keys that the dead workers of restart N-1
    wrote (a peer's old address, barrier counts): measured here as an occasional "connection refused"
    to a dead rank's port, or a hang, during the restarted process group's set-up.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), ctx.world_size,
                          is_master=False, timeout=timeout)
    prefix = attempt_prefix(os.environ)
    return store if prefix is None else dist.PrefixStore(prefix, store)


def attempt_prefix(env) -> str | None:
    """The key space of this restart, or None where the workers of one round cannot agree on it.

    ``TORCHELASTIC_RESTART_COUNT`` is each agent's own count: the agent whose worker failed counts the
    restart, while the other nodes' agents restart their healthy workers for the new round without
    counting it (``_invoke_run`` in torch's ``elastic/agent/server/api.py``), and an agent that joins
    later counts from 0. On one node every worker has the same count; on several, prefixes built from it
    would never meet and the process group would wait until its timeout. There the store is used as
    torch's own ``env://`` set-up uses it, without a prefix."""
    if env.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    return f"/ddpkit/attempt_{env['TORCHELASTIC_RESTART_COUNT']}"


def destroy_process_group() -> None:
    """Leave the process group cleanly, in a process that goes on living (under torchrun).

    ``gc.collect()`` first: objects still holding the group (a DDP reducer, pending work) must be
    freed before the group is, or the process can abort at exit with "terminate called without an
    active exception" (seen with gloo on torch 2.13). Ranks started by the launcher skip this: they
    end with ``os._exit`` once every rank is done, which runs no C++ destructor at all.
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def die_with_parent(*_: Any) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans after a kernel crash).
    Also usable as a DataLoader ``worker_init_fn``: a worker then dies with its rank."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU, and every GPU lazily) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
