"""Point-to-point patterns checked under NCCL's rule, on a CPU: a send completes only when its receive is posted.

gloo buffers a message whose receiver has not asked for it yet, so on a CPU almost any order of sends
and receives works. NCCL does not promise that. Its documentation on point-to-point communication:
*"Point-to-point calls within a group will be blocking until that group of calls completes, but calls
within a group can be seen as progressing independently, hence should never block each other. It is
therefore important to merge calls that need to progress concurrently to avoid deadlocks. The only
exception is point-to-point calls within a group targeting the same peer, which are executed in
order."* Outside a group, every NCCL call is an operation on a CUDA stream, and a stream runs its
operations in the order they were issued; a send larger than NCCL's buffers cannot finish before the
peer's matching receive is running. So code that is correct on gloo can hang on GPUs.

This module proves the GPU's rule without a GPU, in two steps:

1. :class:`Recorder` runs real code on real (gloo) ranks and records, on each rank, every
   communication call in the order it was issued: sends and receives (with peer and bytes),
   ``batch_isend_irecv`` batches (NCCL group calls), and collectives (with their group);
2. :func:`replay` executes all ranks' records under **rendezvous semantics**: each rank runs its
   operations strictly in the order issued (one queue per rank: stricter than a GPU, which runs
   different communicators' operations on different streams, so a pattern that passes here passes
   there); a send completes only together with its matching receive (the k-th send from a to b on a
   group with the k-th receive at b from a on that group), both at the head of their ranks' queues; a
   batch's operations are all at the head at once and progress independently (in order per peer and
   direction); a collective completes when every member of its group has it at the head. If no
   operation can complete and some remain, it is a deadlock: :class:`Deadlock` names every stuck rank and
   the operation it waits in. ``eager_bytes`` lets sends up to that size complete without their
   receive (NCCL's buffers): what let the old pipeline pass a GPU test with small activations.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

P2P = ("isend", "irecv", "send", "recv")
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list")


@dataclass(frozen=True)
class Op:
    """One recorded operation: ``send``/``recv`` with ``peer`` (a global rank), or a collective ``kind``."""

    kind: str
    group: tuple[int, ...]
    peer: int = -1
    nbytes: int = 0

    def __str__(self) -> str:
        if self.kind in ("send", "recv"):
            arrow = "->" if self.kind == "send" else "<-"
            return f"{self.kind}{arrow}{self.peer} ({self.nbytes} B)"
        return f"{self.kind} on {list(self.group)}"


def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _peer(group, peer, group_peer) -> int:
    if peer is None and group_peer is not None:
        return dist.get_global_rank(group, group_peer) if group is not None else group_peer
    return peer


class Recorder:
    """Within ``with Recorder() as rec:``, every ``torch.distributed`` communication call of this process is
    recorded in ``rec.ops`` (a batch as one list of ops) and then carried out as usual. Calls made inside
    another recorded call (``all_gather_object`` gathering with ``all_gather``, a batch calling ``isend``)
    count once, as the outer call."""

    def __init__(self) -> None:
        self.ops: list[list[Op]] = []
        self._local = threading.local()
        self._saved: dict = {}

    def _wrap(self, name: str, original):
        recorder = self

        def wrapper(*args, **kwargs):
            depth = getattr(recorder._local, "depth", 0)
            if depth == 0 and threading.current_thread() is threading.main_thread():
                recorder.ops.append(recorder._describe(name, args, kwargs))
            recorder._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                recorder._local.depth = depth

        wrapper.__name__ = wrapper.__qualname__ = name
        return wrapper

    def _describe(self, name: str, args, kwargs) -> list[Op]:
        if name == "batch_isend_irecv":
            return [Op("send" if p.op.__name__ == "isend" else "recv", _ranks(p.group), p.peer,
                       p.tensor.numel() * p.tensor.element_size()) for p in args[0]]
        call = inspect.signature(self._saved[(c10d, name)]).bind_partial(*args, **kwargs).arguments
        group = call.get("group")
        if name in P2P:
            tensor = call["tensor"]
            peer = _peer(group, call.get("dst", call.get("src")), call.get("group_dst", call.get("group_src")))
            kind = "send" if name in ("isend", "send") else "recv"
            return [Op(kind, _ranks(group), peer, tensor.numel() * tensor.element_size())]
        return [Op(name, _ranks(group))]

    def __enter__(self) -> "Recorder":
        names = ("batch_isend_irecv", *P2P, *COLLECTIVES)
        for module in (dist, c10d):
            for name in names:
                if hasattr(module, name):
                    self._saved[(module, name)] = getattr(module, name)
        originals = {name: getattr(c10d, name) for name in names if hasattr(c10d, name)}
        wrappers = {name: self._wrap(name, fn) for name, fn in originals.items()}
        for (module, name) in self._saved:
            setattr(module, name, wrappers[name])  # both: P2POp checks its op against c10d's isend and irecv
        return self

    def __exit__(self, *exc) -> None:
        for (module, name), fn in self._saved.items():
            setattr(module, name, fn)


def recorded(ctx, fn, *args, **kwargs) -> dict:
    """Run ``fn(ctx, *args, **kwargs)`` under a :class:`Recorder` (a function for ``ddpkit.launch``):
    its result and this rank's operations."""
    with Recorder() as recorder:
        result = fn(ctx, *args, **kwargs)
    return {"result": result, "ops": recorder.ops}


class Deadlock(RuntimeError):
    """No rank can go on: ``stuck`` maps each rank that has operations left to the one it waits in."""

    def __init__(self, stuck: dict[int, list[str]]) -> None:
        self.stuck = stuck
        lines = "; ".join(f"rank {r} waits in [{', '.join(ops)}]" for r, ops in sorted(stuck.items()))
        super().__init__(f"deadlock under rendezvous semantics: {lines}")


@dataclass
class _Pending:
    op: Op
    index: int  # the k-th of its channel (k-th send a->b on a group, k-th collective on a group)
    done: bool = False
    posted: bool = False
    partner: "_Pending | None" = field(default=None, repr=False)


def replay(ops_per_rank: list[list[list[Op]]], eager_bytes: int = 0) -> int:
    """Execute every rank's recorded batches under rendezvous semantics (see the module docstring).
    Returns the number of operations completed; raises :class:`Deadlock` if some can never complete, and
    ValueError if a send and its receive disagree on the size."""
    channels: dict[tuple, int] = {}
    queues = []
    for rank, batches in enumerate(ops_per_rank):
        queue = []
        for batch in batches:
            items = []
            for op in batch:
                if op.kind == "send":
                    key = ("send", op.group, rank, op.peer)
                elif op.kind == "recv":
                    key = ("recv", op.group, op.peer, rank)
                else:
                    key = ("coll", op.group, rank)
                items.append(_Pending(op, channels.get(key, 0)))
                channels[key] = channels.get(key, 0) + 1
            queue.append(items)
        queues.append(queue)
    heads = [0] * len(queues)
    completed = 0

    def active(rank: int) -> list[_Pending]:
        """The operations of ``rank`` that can progress now: the head batch's first open one per peer and direction."""
        if heads[rank] >= len(queues[rank]):
            return []
        seen, out = set(), []
        for item in queues[rank][heads[rank]]:
            lane = (item.op.kind, item.op.peer, item.op.group)
            if not item.done and lane not in seen:
                seen.add(lane)
                out.append(item)
        return out

    while True:
        progressed = False
        for rank in range(len(queues)):
            for item in active(rank):
                item.posted = True
        sends = {}
        for rank in range(len(queues)):
            for item in active(rank):
                if item.op.kind == "send":
                    sends[(item.op.group, rank, item.op.peer, item.index)] = item
        colls: dict[tuple, list] = {}
        for rank in range(len(queues)):
            for item in active(rank):
                if item.op.kind == "send" and item.op.nbytes <= eager_bytes:
                    item.done, progressed = True, True  # fits in the receiver's buffers
                elif item.op.kind == "recv":
                    send = sends.get((item.op.group, item.op.peer, rank, item.index))
                    early = _eager_sent(queues[item.op.peer], item, rank, eager_bytes)
                    partner = send or early
                    if partner is not None:
                        if partner.op.nbytes != item.op.nbytes:
                            raise ValueError(f"rank {item.op.peer} sends {partner.op.nbytes} B that rank {rank} receives "
                                             f"as {item.op.nbytes} B")
                        partner.done = item.done = progressed = True
                elif item.op.kind not in ("send", "recv"):
                    colls.setdefault((item.op.group, item.index), []).append((rank, item))
        for (group, _), members in colls.items():
            if {r for r, _ in members} == set(group):
                for _, item in members:
                    item.done = progressed = True
        for rank in range(len(queues)):
            while heads[rank] < len(queues[rank]) and all(i.done for i in queues[rank][heads[rank]]):
                completed += len(queues[rank][heads[rank]])
                heads[rank] += 1
                progressed = True
        if all(heads[r] >= len(queues[r]) for r in range(len(queues))):
            return completed
        if not progressed:
            raise Deadlock({r: [str(i.op) for i in queues[r][heads[r]] if not i.done]
                            for r in range(len(queues)) if heads[r] < len(queues[r])})


def _eager_sent(queue: list[list[_Pending]], receive: _Pending, rank: int, eager_bytes: int) -> _Pending | None:
    """The matching send, if it was small enough to complete into buffers when it was posted."""
    if eager_bytes <= 0:
        return None
    for batch in queue:
        for item in batch:
            op = item.op
            if op.kind == "send" and op.peer == rank and op.group == receive.op.group and item.index == receive.index:
                return item if item.posted and op.nbytes <= eager_bytes else None
    return None


def check(results: list[dict], eager_bytes: int = 0) -> int:
    """:func:`replay` the ``ops`` of :func:`recorded` results (one per rank, in rank order)."""
    return replay([r["ops"] for r in results], eager_bytes)
