"""How many bytes one rank holds: parameters, gradients, optimizer state and activations, by strategy.

Training state is counted **per parameter**. With AdamW:

* **fp32** training: weights 4 bytes, gradients 4, and AdamW's two moments (``exp_avg``,
  ``exp_avg_sq``) 8: **16 bytes/param** under DDP, where AdamW updates the weights in place. A sharded
  optimizer (ours, and DeepSpeed's) keeps an fp32 **master copy** of its shard besides the moments:
  4 + 8 = **12 bytes per parameter of the shard**, seed 004's figure.
* **16-bit mixed precision** (the ZeRO paper's accounting, its section 3.1, for fp16): 16-bit weights 2
  + 16-bit gradients 2 + K = 12 bytes of fp32 optimizer state (master weights 4, Adam's two moments 8)
  = **16 bytes/param**. bf16 has the same sizes as fp16, so the numbers stand for bf16 training
  (``"bf16-mixed"`` below).
* seed 003's 7B table counts fp32 weights (4), bf16 gradients (2) and the two moments (8), with no
  separate master: 14 bytes/param, 98 GB for 7B.

What each strategy shards over N data-parallel ranks (ZeRO's stages):

======================  ==========  =========  ================
strategy                parameters  gradients  optimizer state
======================  ==========  =========  ================
ddp (stage 0)           whole       whole      whole
zero1 / zero1-torch     whole       whole      1/N
zero2                   whole       1/N        1/N
zero3 / fsdp2           1/N         1/N        1/N
======================  ==========  =========  ================

``fsdp2`` shards **every tensor along dim 0** the way ``torch.chunk`` cuts it (FSDP2's
``_fsdp_param.py``: ``torch.chunk(param, N, dim=0)``, padded with empty chunks): chunks of ceil(d0/N)
rows, so the last ranks get fewer rows, or none, when d0 does not divide by N. Rank r holds
``max(0, min(c, d0 - r c))`` rows of ``c = ceil(d0 / N)`` (:func:`fsdp2_local_numel`): for
``Linear(1000, 3)`` + ``Linear(3, 1000)`` without biases on 2 ranks, 3500 and 2500 parameters, not
3000 each. (FSDP2 allocates each parameter's storage padded to chunk 0's size on every rank, so the
short ranks' *allocation* is rank 0's; the counts here are the local shards a DTensor holds, which the
gradients and Adam's moments follow exactly.)

``zero1-torch`` (``ZeroRedundancyOptimizer``) assigns *whole parameters* to ranks, largest first to
the least-loaded rank, so a rank's share is only about 1/N: one large matrix can tip it
(:func:`torch_zero_partition`). Activations do not shard with data parallelism at all: each rank
holds its own micro-batch's; activation checkpointing is the lever for those
(:func:`activation_bytes` measures them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GB = 1e9  # decimal gigabytes, as seed 003's table uses


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of state."""

    name: str
    weights: int
    grads: int
    master: int
    """A separate fp32 copy of the weights the optimizer updates (0: it updates the weights themselves)."""
    moments: int


PRECISIONS = {
    "fp32": Precision("fp32", weights=4, grads=4, master=0, moments=8),
    "bf16-mixed": Precision("16-bit mixed, fp32 master (the ZeRO paper's fp16 accounting, K = 12)", weights=2, grads=2, master=4, moments=8),
    "seed003": Precision("fp32 weights, bf16 gradients (seed 003)", weights=4, grads=2, master=0, moments=8),
}

SHARDED = {  # strategy -> (parameters, gradients, optimizer) sharded?
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "zero1-torch": (False, False, True),
    "zero2": (False, True, True),
    "zero3": (True, True, True),
    "fsdp2": (True, True, True),
}
KEEPS_MASTER_SHARD = {"zero1"}  # ours: an fp32 master copy of the shard even in fp32 training


def torch_zero_partition(sizes: list[int], world: int) -> list[int]:
    """Parameters per rank as ``ZeroRedundancyOptimizer`` assigns them: whole tensors, largest first,
    each to the rank with the fewest so far."""
    loads = [0] * world
    for size in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += size
    return loads


def fsdp2_local_numel(shape: tuple[int, ...] | list[int] | int, world: int, rank: int) -> int:
    """Elements of one tensor that FSDP2 leaves on ``rank``: ``torch.chunk`` along dim 0 into ``world``
    chunks of ceil(d0/world) rows (the last ones shorter or empty)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    rows = shape[0] if shape else 1
    rest = math.prod(shape[1:])
    chunk = math.ceil(rows / world)
    return max(0, min(chunk, rows - rank * chunk)) * rest


def bytes_per_rank(params: int, strategy: str = "ddp", world: int = 1, precision: str = "fp32",
                   param_sizes: list[int] | None = None, rank: int | None = None,
                   activations: int = 0, param_shapes: list[tuple[int, ...]] | None = None) -> dict:
    """Bytes one rank holds for a model of ``params`` parameters: ``params``, ``grads``, ``optimizer``,
    ``activations`` (given, e.g. measured), ``total``. ``param_sizes`` (each tensor's numel) makes the
    sharded counts exact: ceil(P/N) for a flat shard, the greedy partition for zero1-torch (``rank``
    picks one; default the fullest); ``param_shapes`` makes fsdp2's exact (dim-0 chunks, rank 0 the
    fullest by default; from ``param_sizes`` alone each tensor is taken as 1-D)."""
    if strategy not in SHARDED:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(SHARDED)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    p, (shard_w, shard_g, shard_o) = PRECISIONS[precision], SHARDED[strategy]
    if strategy == "zero1-torch" and param_sizes:
        loads = torch_zero_partition(param_sizes, world)
        optimizer_params = loads[rank] if rank is not None else max(loads)
    else:
        optimizer_params = math.ceil(params / world) if shard_o else params
    if strategy == "fsdp2" and (param_shapes or param_sizes):  # FSDP2: every tensor chunked along dim 0
        local = sum(fsdp2_local_numel(s, world, rank or 0) for s in (param_shapes or param_sizes))
    else:
        local = math.ceil(params / world)
    master = 4 if strategy in KEEPS_MASTER_SHARD and p.master == 0 else p.master
    out = {
        "params": p.weights * (local if shard_w else params),
        "grads": p.grads * (local if shard_g else params),
        "optimizer": (master + p.moments) * (local if strategy == "fsdp2" else optimizer_params),
        "activations": activations,
    }
    out["total"] = sum(out.values())
    return out


def zero_stage_table(params: float = 7e9, world: int = 8, precision: str = "seed003") -> list[dict]:
    """Seed 003's table, "memory per GPU (7B model, 8 GPUs)", by ZeRO stage, in GB."""
    rows = []
    for stage, strategy in (("0 (DDP)", "ddp"), ("1", "zero1-torch"), ("2", "zero2"), ("3", "zero3")):
        b = bytes_per_rank(int(params), strategy, world, precision)
        rows.append({"stage": stage, "params_gb": b["params"] / GB, "optimizer_gb": b["optimizer"] / GB,
                     "grads_gb": b["grads"] / GB, "total_gb": (b["params"] + b["grads"] + b["optimizer"]) / GB})
    return rows


def smallest_world(params: float, strategy: str, device_bytes: float, precision: str = "bf16-mixed",
                   activations: float = 0.0, max_world: int = 4096) -> int | None:
    """The fewest data-parallel ranks on which the state (plus ``activations`` per rank) fits in
    ``device_bytes``; None if no number up to ``max_world`` does (DDP never shrinks)."""
    for world in range(1, max_world + 1):
        if bytes_per_rank(int(params), strategy, world, precision)["total"] + activations <= device_bytes:
            return world
    return None


def activation_bytes(model: torch.nn.Module, inputs: torch.Tensor) -> int:
    """Bytes kept alive for backward by one forward pass of ``model`` on ``inputs``: every tensor autograd
    saves (each storage counted once), plus, under activation checkpointing, each checkpointed
    block's input, which the checkpoint holds to recompute the block."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def keep_input(module, args) -> None:
        pack(args[0])

    hooks = []
    if getattr(model, "activation_checkpointing", False):
        hooks = [block.register_forward_pre_hook(keep_input) for block in getattr(model, "blocks", [])]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    seen.pop(out.untyped_storage().data_ptr(), None)  # the output itself is not an activation kept for backward
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)  # weights saved for backward are not extra
