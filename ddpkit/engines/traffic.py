"""The collectives a training step issues, counted the same way for every engine: torch's Flight Recorder.

To compare the kit's strategies with DeepSpeed's stages, one counter must see both. DeepSpeed's own
communication logger sees only what goes through ``deepspeed.comm``; the kit's
:class:`~ddpkit.parallel.collective_log.CollectiveLog` sees only Python calls of ``torch.distributed``,
so neither sees DDP's gradient all-reduce, which DDP's C++ reducer issues straight to the process group.
The Flight Recorder (``ddpkit/debug/flight.py``) sits below all of them: every collective a process group
runs is an entry in the rank's ring, with a ``record_id`` that only grows, the op the backend ran
(``profiling_name``, e.g. ``gloo:all_reduce``), the sizes of what this rank sent, and the Python stack
that issued it. A window is two record ids: the last one before the steps counted and what came after.

Each entry is described by:

* ``op``: the ``torch.distributed`` function that was called (the outermost frame in
  ``distributed_c10d.py``), as its kind: ``all_reduce``, ``all_gather``, ``reduce_scatter``,
  ``broadcast``. No such frame means C++ issued it, named by what the backend ran: during backward,
  that is DDP's reducer;
* ``gloo``: what the backend ran. On gloo a reduce-scatter is an all-reduce of the whole buffer, of which
  each rank keeps its chunk (its ``profiling_name`` says ``gloo:all_reduce``): it moves an all-reduce's
  bytes here, where NCCL's would move half;
* ``numel``: the elements this rank sent in;
* ``issuer``: the first frame outside the collective plumbing (``torch.distributed``'s wrappers,
  ``deepspeed.comm`` and DeepSpeed's profiling decorator): which function of which engine asked for it.

The comparison's own bookkeeping (the global loss all-reduce in ``ddpkit/step.py``, which the kit's
trainer and :func:`ddpkit.engines.deepspeed_run.train_engine` both issue once per step) is left out.
"""

from __future__ import annotations

import io
import math
import os

import torch

from ddpkit.debug.flight_read import _PlainData
from ddpkit.hooks import Hook

KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
         "_all_gather_base": "all_gather", "all_gather": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "reduce_scatter_single": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
         "reduce_scatter": "reduce_scatter", "broadcast": "broadcast"}
PLUMBING = ("distributed_c10d.py", "c10d_logger.py", "typing_extensions.py",
            os.path.join("deepspeed", "comm", ""), os.path.join("deepspeed", "utils", "nvtx.py"))
"""Frames that pass a collective on rather than ask for it (a path ending or a folder)."""
AUTOGRAD = os.path.join("torch", "autograd", "graph.py")  # where backward hands over to C++
BOOKKEEPING = os.path.join("ddpkit", "step.py")
"""The file whose collectives are the comparison's own (the global loss), not the engine's."""


def ring() -> list[dict]:
    """This process's Flight Recorder entries, oldest first, as plain data."""
    if not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):
        raise RuntimeError(f"torch {torch.__version__} cannot dump its Flight Recorder: use torch 2.13 or newer")
    return _PlainData(io.BytesIO(torch._C._distributed_c10d._dump_fr_trace())).load().get("entries", [])


def last_record_id() -> int:
    """The newest entry's id (-1 when the ring is empty): the start of a window."""
    entries = ring()
    return entries[-1]["record_id"] if entries else -1


def since(record_id: int) -> list[dict]:
    """The entries recorded after ``record_id``, each :func:`describe` d. Raises if the ring has already
    dropped some of them (it keeps the last ``TORCH_FR_BUFFER_SIZE`` entries), or records nothing."""
    if os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "")).strip() == "0":
        raise RuntimeError("the Flight Recorder is off (TORCH_FR_BUFFER_SIZE=0): unset it to count collectives")
    entries = ring()
    if entries and entries[0]["record_id"] > record_id + 1:  # ids count from 0, one per collective
        raise RuntimeError(f"the Flight Recorder's ring dropped entries {record_id + 1}..{entries[0]['record_id'] - 1}: "
                           "raise TORCH_FR_BUFFER_SIZE or count fewer steps")
    return [describe(e) for e in entries if e["record_id"] > record_id]


def _is(frame: dict, ending: str) -> bool:
    return frame["filename"].endswith(ending) or (ending.endswith(os.sep) and ending in frame["filename"])


def describe(entry: dict) -> dict:
    """One ring entry as ``{"op", "gloo", "numel", "issuer", "bookkeeping"}`` (see the module docstring)."""
    frames = entry.get("frames") or []
    c10d = [f["name"] for f in frames if _is(f, "distributed_c10d.py")]
    ran = entry["profiling_name"].split(":", 1)[-1]
    issuer = next((f for f in frames if not any(_is(f, p) for p in PLUMBING)), None)
    numel = sum(math.prod(size) for size in entry.get("input_sizes") or [[]])
    if c10d:
        op, who = KINDS.get(c10d[-1], c10d[-1]), _name(issuer)
    elif any(_is(f, AUTOGRAD) for f in frames):  # C++ asked, from inside backward: DDP's reducer
        op, who = ran, "C++ (DDP's reducer, in backward)"
    else:  # C++ asked, called from Python (e.g. DDP's start-up broadcast of the weights)
        op, who = ran, f"C++, under {_name(issuer)}"
    return {"op": op, "gloo": ran, "numel": numel, "issuer": who,
            "bookkeeping": bool(c10d and issuer and _is(issuer, BOOKKEEPING))}


def _name(frame: dict | None) -> str:
    return f"{frame['name']} ({os.path.basename(frame['filename'])})" if frame else "?"


def per_step(entries: list[dict], steps: int) -> dict:
    """``{op: {"calls", "numel", "gloo", "issuers"}}`` per step over ``steps`` steps, bookkeeping left out."""
    out: dict = {}
    for e in entries:
        if e["bookkeeping"]:
            continue
        row = out.setdefault(e["op"], {"calls": 0, "numel": 0, "gloo": set(), "issuers": set()})
        row["calls"] += 1
        row["numel"] += e["numel"]
        row["gloo"].add(e["gloo"])
        row["issuers"].add(e["issuer"])
    return {op: {"calls": r["calls"] / steps, "numel": r["numel"] / steps, "gloo": sorted(r["gloo"]),
                 "issuers": sorted(r["issuers"])} for op, r in sorted(out.items())}


class StepWindow(Hook):
    """A trainer hook that counts the collectives of every step after the first (the first also builds
    buffers and, under FSDP2, lazily initialises): :attr:`per_step` once the run has ended."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.per_step: dict = {}

    def before_step(self, trainer) -> None:
        if trainer.step == 1:
            self.start = last_record_id()

    def on_end(self, trainer) -> None:
        if self.start is not None:
            self.per_step = per_step(since(self.start), trainer.step - 1)
