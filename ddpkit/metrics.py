"""The observability plane: is the run healthy, and is it input-, compute- or communication-bound?

* **Structured logs on every rank** (one JSONL file each), because a rank-0-only log hides the
  straggler and the rank that failed; a **dense console on rank 0 only**, because N copies of the
  same table are noise.
* **Step time by phase** (data, h2d, forward, backward, comm, optimizer). Communication is
  **measured** by a DDP communication hook that timestamps each bucket's all-reduce from launch to
  completion. The popular alternative, "comm = total - (data + forward + backward + optimizer)",
  reads about zero under DDP, because DDP overlaps the all-reduce with backward and waits for it
  *inside* ``loss.backward()``: the remainder has nowhere left to hide it. The hook is Python, called
  by DDP's C++ reducer for each bucket, with a callback on gloo's thread that contends for the GIL:
  about 4% of a small step here (``benchmarks/trainer_overhead.py``). So the trainer measures it only
  when something reads it per step (``--metrics-dir``); otherwise DDP's built-in C++ all-reduce hook
  does the same arithmetic unmeasured (:meth:`CommTimer.register` with ``measure=False``).
* **Fingerprints** that make correctness checkable: ``param_sha256`` (bytes of every tensor of the
  state dict, sorted by key) and the running ``data_sha256`` of the global sample ids of each step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddpkit.files import atomic_write

if TYPE_CHECKING:  # only a type here: the runtime plane sits above observability, not below it
    from ddpkit.runtime import RankContext

PHASES = ("data_s", "h2d_s", "forward_s", "backward_s", "comm_s", "optimizer_s", "sync_s")
"""Per-step phase times. ``comm_s`` is measured by :class:`CommTimer` and overlaps ``backward_s``;
``sync_s`` is the step's own small collectives after the optimizer (the global loss all-reduce and,
every few steps, the gather of sample ids for ``data_sha256``)."""


class CommTimer:
    """A DDP comm hook that does what the default one does (``allreduce_hook``: divide the bucket by the
    group size, all-reduce it, bit for bit the same) and measures it.

    ``register(ddp_model)`` installs it. Per step it reports ``calls`` (buckets all-reduced), ``bytes``
    and ``seconds``: the length of the union of [launch, completion] intervals of all buckets, i.e.
    the wall time during which at least one all-reduce was in flight (buckets overlap each other and
    backward, so summing them would double-count). ``register(ddp_model, measure=False)`` installs
    DDP's built-in C++ hook instead and measures nothing (``measured`` is False, ``seconds`` None).

    How completion is observed depends on the backend. gloo completes a bucket's future when the
    all-reduce has finished, so a host clock read in a ``then`` callback is right. NCCL completes it as
    soon as the work is *queued* on the GPU, so a host clock would read about zero: there, CUDA events
    are recorded on the stream instead (the callback runs with its stream waiting for the all-reduce)
    and read when :attr:`seconds` is asked for.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.measured = True  # False once register(..., measure=False) left the all-reduce to DDP's C++ hook
        self._lock = threading.Lock()  # completions arrive on the backend's threads
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.calls, self.bytes, self._intervals = 0, 0, []
            if self.cuda:
                self._origin = torch.cuda.Event(enable_timing=True)
                self._origin.record()

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel, measure: bool = True) -> "CommTimer":
        """Install the timing hook on ``ddp_model``; with ``measure=False``, DDP's built-in ``ALLREDUCE`` hook.

        The built-in hook (C++, ``AllReduceCommHook`` in ``torch/csrc/distributed/c10d/default_comm_hooks.cpp``)
        divides the bucket by the group size and all-reduces it, exactly as :meth:`_hook` does, so the two
        give bitwise the same weights. DDP with no hook at all would not: its reducer multiplies each
        gradient by 1/size as it copies it into the bucket (``mul_out``), which rounds differently from a
        division when the size is not a power of two (``tests/test_comm_timing.py`` shows it on 3 ranks)."""
        if not measure:
            ddp_model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
            self.measured = False
            return self
        # the hook's state is DDP's own group: with tensor or pipeline parallelism that is the dp group, not the world
        ddp_model.register_comm_hook(ddp_model.process_group, self._hook)
        return self

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _hook(self, process_group, bucket):  # no annotations: DDP checks them literally
        """What DDP's default hook does (divide by the group size, all-reduce), with timestamps."""
        started = self._now()
        group = process_group if process_group is not None else dist.group.WORLD
        tensor = bucket.buffer()
        with self._lock:
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
        tensor.div_(group.size())
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            ended = self._now()
            with self._lock:
                self._intervals.append((started, ended))
            return f.value()[0]

        return fut.then(done)

    @contextlib.contextmanager
    def timed(self, nbytes: int):
        """Measure a blocking collective of ``nbytes`` run inside the block (a strategy without DDP's
        hooks, e.g. ZeRO's reduce-scatter and all-gather, reports its communication this way)."""
        started = self._now()
        try:
            yield
        finally:
            ended = self._now()
            with self._lock:
                self.calls += 1
                self.bytes += nbytes
                self._intervals.append((started, ended))

    @property
    def seconds(self) -> float | None:
        if not self.measured:
            return None
        with self._lock:
            intervals = list(self._intervals)
        if self.cuda:  # event pairs -> seconds after the origin recorded at reset()
            for _, end in intervals:
                end.synchronize()
            intervals = [(self._origin.elapsed_time(a) / 1e3, self._origin.elapsed_time(b) / 1e3) for a, b in intervals]
        total, end = 0.0, -math.inf
        for lo, hi in sorted(intervals):
            if hi > end:
                total += hi - max(lo, end)
                end = hi
        return total


class MetricsLogger:
    """JSONL events on every rank, and a loss table on rank 0's console."""

    def __init__(self, ctx: RankContext, metrics_dir: str | None, log_every: int = 10,
                 console: bool | None = None) -> None:
        self.ctx, self.log_every = ctx, log_every
        self.console = ctx.is_main if console is None else console
        self._file = None
        self._header_done = False
        if metrics_dir:
            os.makedirs(metrics_dir, exist_ok=True)
            self._file = open(os.path.join(metrics_dir, f"rank-{ctx.rank:05d}.jsonl"), "a")  # noqa: SIM115

    def event(self, event: str, step: int, **fields: Any) -> None:
        """One structured line: ``{"event", "rank", "step", "time", ...}``."""
        if self._file is not None:
            record = {"event": event, "rank": self.ctx.rank, "step": step, "time": time.time(), **fields}
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def wants_step(self, step: int, last: bool = False) -> bool:
        """Would :meth:`step` write or print anything? (A caller can skip building the fields when not.)"""
        return self._file is not None or (self.console and (step % self.log_every == 0 or last or step == 1))

    def step(self, step: int, last: bool = False, **fields: Any) -> None:
        """A step event; and on the console rank, a table row every ``log_every`` steps."""
        self.event("step", step, **fields)
        if self.console and (step % self.log_every == 0 or last or step == 1):
            if not self._header_done:
                print(f"{'step':>6} {'loss':>9} {'lr':>9} {'samples/s':>10} {'step ms':>8} {'comm ms':>8}")
                self._header_done = True
            comm = fields.get("comm_s")  # absent when not measured (no --metrics-dir): shown as "-"
            print(f"{step:>6} {fields['loss']:>9.4f} {fields['lr']:>9.2e} {fields['samples_per_s']:>10.0f} "
                  f"{fields['step_time_s'] * 1e3:>8.2f} {'-' if comm is None else f'{comm * 1e3:.2f}':>8}", flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(metrics_dir: str, event: str | None = "step") -> list[dict]:
    """All events (of one kind, by default step events) from every rank's JSONL file."""
    records = []
    for name in sorted(os.listdir(metrics_dir)):
        if name.endswith(".jsonl"):
            with open(os.path.join(metrics_dir, name)) as handle:
                records += [json.loads(line) for line in handle if line.strip()]
    return [r for r in records if event is None or r["event"] == event]


def reduce_across_ranks(ctx: RankContext, values: dict[str, float]) -> dict[str, dict[str, float]]:
    """Mean and max of each value across ranks (max exposes a straggler that the mean hides)."""
    keys = sorted(values)
    local = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=ctx.device)
    total, peak = local.clone(), local.clone()
    if ctx.is_distributed:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.world_group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ctx.world_group)
    return {k: {"mean": float(total[i]) / ctx.world_size, "max": float(peak[i])} for i, k in enumerate(keys)}


def state_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over the bytes of every tensor, in sorted key order: equal iff bitwise equal.

    A sharded tensor (a DTensor, from FSDP or tensor parallelism) is hashed as the full tensor it
    represents, so the hash does not depend on how the state is split; gathering it is collective,
    so every rank calls this then.
    """
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key]
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        tensor = tensor.detach().to("cpu").contiguous().reshape(-1)  # 0-d tensors cannot be viewed as bytes
        digest.update(key.encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def optimizer_sha256(optimizer: torch.optim.Optimizer | dict) -> str:
    """sha256 of an optimizer's whole state (every moment and step counter, and the param groups).

    Takes an optimizer (its ``state_dict()``, keyed by parameter index) or a state dict, such as the
    one ``torch.distributed.checkpoint.state_dict`` returns (keyed by parameter name).
    """
    state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    flat = {}
    for key, entry in state["state"].items():
        label = f"{key:06d}" if isinstance(key, int) else key
        for name, value in entry.items():
            flat[f"state.{label}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    groups = json.dumps(state["param_groups"], sort_keys=True).encode()
    flat["param_groups"] = torch.frombuffer(bytearray(groups), dtype=torch.uint8)
    return state_sha256(flat)


def state_l2(state_dict: dict[str, torch.Tensor]) -> float:
    """Global L2 norm of a (full) model state dict's tensors, in key order (float64)."""
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in state_dict.values()))


DATA_SHA256_START = hashlib.sha256(b"ddpkit-data").hexdigest()


def extend_data_sha256(previous: str, step_sample_ids: list[int]) -> str:
    """Fold one optimizer step's global sample ids (sorted) into the running data hash."""
    ids = ",".join(str(i) for i in sorted(step_sample_ids))
    return hashlib.sha256(f"{previous}:{ids}".encode()).hexdigest()


def write_summary(path: str, summary: dict[str, Any]) -> None:
    """Write the summary JSON atomically (a reader never sees half a file, a failure leaves no temp file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path, "w") as handle:
        json.dump(summary, handle, indent=1)
