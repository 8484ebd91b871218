"""Collectives from the wire up: a ring all-reduce built from ``send``/``recv``, and what collectives cost.

**The ring.** N ranks sit in a circle; each talks only to its two neighbours. The buffer is cut into N
chunks. *Reduce-scatter*: in N-1 steps every rank passes a partial sum of one chunk to its neighbour,
which adds its own values and passes it on; afterwards rank r holds chunk r summed over all ranks.
*All-gather*: in N-1 more steps the finished chunks travel round the circle until every rank has all
of them. Every rank sends 2(N-1) messages of M/N bytes: **2(N-1)/N x M bytes per rank**, almost 2M
however many ranks there are. That is why a ring all-reduce scales: the bytes per rank do not grow
with N (the number of messages, and so the latency, does).

Floating-point addition is not associative, so "the sum" depends on the order in which the ranks'
values are added. :func:`ring_all_reduce` adds them in the order gloo's own ring does (chunk boundaries
included), so its result is **bitwise** equal to ``dist.all_reduce`` on gloo, not merely close: the
test that proves the ring correct can compare bits.

**The cost.** nccl-tests reports two numbers per collective of M bytes taking t seconds:
``algbw = M / t`` (what the caller sees) and ``busbw = algbw x factor``, the factor being the share of
M each rank must move for that collective (2(N-1)/N for all-reduce, (N-1)/N for reduce-scatter and
all-gather, 1 for broadcast), so busbw is comparable across collectives and world sizes and can be
held against the hardware's limit. On one machine the "link" is memory, so the limit here is a memory
copy's bandwidth, measured beside it (:func:`memcpy_bandwidth`). An **alpha-beta model**
``t = alpha + M / bandwidth`` *per message*, fitted to the measured all-reduces knowing that a ring sends
2(N-1) messages (:func:`ddpkit.parallel.cost.fit_ring`), separates latency (small messages) from
bandwidth (large ones) and predicts what more ranks would cost (``ddpkit.parallel.cost``).
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

BUS_FACTOR = {  # share of the message each rank must move, as nccl-tests defines busbw
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
COLLECTIVES = tuple(BUS_FACTOR)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``dist.reduce_scatter_tensor`` (newer torch renames it and warns about the old name; the old name
    is the one every supported version has)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(output, input, group=group)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``dist.all_gather_into_tensor``, without the rename warning of newer torch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(output, input, group=group)


# --------------------------------------------------------------------------- the ring, by hand

def chunk_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """Where the ring cuts a buffer of ``numel`` elements: gloo splits it into 2N equal segments
    (rounded up), two per rank, so the last chunks may be shorter or empty."""
    segment = math.ceil(numel / (2 * world))
    return [(min(numel, 2 * r * segment), min(numel, 2 * (r + 1) * segment)) for r in range(world)]


@dataclass
class RingStats:
    """What one rank put on the wire during a ring collective."""

    messages: int = 0
    bytes_sent: int = 0


BATCHED = True
"""Post each step's send and receive together. False posts the send, then waits for the receive: fine on
gloo, which buffers the send, and a deadlock on NCCL at two ranks (both neighbours are the same peer, and
each send waits for a receive queued behind the peer's own send). Kept to show that it does."""


def _exchange(send: torch.Tensor, recv: torch.Tensor, to: int, frm: int, group, stats: RingStats) -> None:
    """Send to one neighbour while receiving from the other, the two posted together (``batch_isend_irecv``,
    NCCL's grouped send and receive). An empty chunk (a buffer shorter than 2N elements) is not sent at
    all: both of its ends know it is empty, since they compute the same chunk bounds."""
    to, frm = (dist.get_global_rank(group, to), dist.get_global_rank(group, frm)) if group else (to, frm)
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send.contiguous(), to, group=group))
        stats.messages += 1
        stats.bytes_sent += send.numel() * send.element_size()
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, frm, group=group))
    if not BATCHED:  # the send posted, then the receive waited for, then the send
        request = dist.isend(ops[0].tensor, to, group=group) if send.numel() else None
        if recv.numel():
            dist.recv(recv, frm, group=group)
        if request is not None:
            request.wait()
    elif ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def ring_reduce_scatter_(flat: torch.Tensor, group=None, stats: RingStats | None = None) -> tuple[int, int]:
    """Phase 1, in place on a 1-D tensor: afterwards this rank's chunk holds the sum over all ranks
    (the other chunks hold partial sums). Returns this rank's chunk bounds.

    At step k rank r sends chunk r+1+k to rank r-1 and receives chunk r+2+k from rank r+1, adding its
    own values to it; after N-1 steps the chunk it received last, chunk r, has met every rank.
    """
    stats = stats if stats is not None else RingStats()
    n, r = dist.get_world_size(group), dist.get_rank(group)
    bounds = chunk_bounds(flat.numel(), n)
    left, right = (r - 1) % n, (r + 1) % n
    for k in range(n - 1):
        s0, s1 = bounds[(r + 1 + k) % n]
        g0, g1 = bounds[(r + 2 + k) % n]
        incoming = torch.empty(g1 - g0, dtype=flat.dtype, device=flat.device)
        _exchange(flat[s0:s1], incoming, left, right, group, stats)
        flat[g0:g1] += incoming  # partial sum so far + this rank's own values
    return bounds[r]


def ring_all_gather_(flat: torch.Tensor, group=None, stats: RingStats | None = None) -> None:
    """Phase 2, in place: every rank starts owning its chunk and ends holding every rank's chunk. At
    step k rank r passes chunk r+k to rank r-1 and receives chunk r+1+k from rank r+1."""
    stats = stats if stats is not None else RingStats()
    n, r = dist.get_world_size(group), dist.get_rank(group)
    bounds = chunk_bounds(flat.numel(), n)
    left, right = (r - 1) % n, (r + 1) % n
    for k in range(n - 1):
        s0, s1 = bounds[(r + k) % n]  # its own chunk first, then the one it received last
        g0, g1 = bounds[(r + 1 + k) % n]
        _exchange(flat[s0:s1], flat[g0:g1], left, right, group, stats)


def ring_all_reduce(tensor: torch.Tensor, group=None) -> RingStats:
    """Sum ``tensor`` over the group in place with a hand-written ring (reduce-scatter, then
    all-gather), bitwise equal to gloo's ``dist.all_reduce``. Returns what this rank sent."""
    stats = RingStats()
    if dist.get_world_size(group) == 1:
        return stats
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    ring_reduce_scatter_(flat, group, stats)
    ring_all_gather_(flat, group, stats)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return stats


def check_ring(ctx, sizes: list[int], seed: int = 0) -> list[dict]:
    """Run the hand-written ring and ``dist.all_reduce`` on the same random values (a function for
    ``ddpkit.launch``). Per size: whether the results are bitwise equal, the largest difference, and
    the messages and bytes this rank sent."""
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(seed + 1000 * n + ctx.rank)  # drawn on the host: the same values anywhere
        mine = (torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 4, (n,), generator=g)).to(ctx.device)
        ours, theirs = mine.clone(), mine.clone()
        stats = ring_all_reduce(ours)
        dist.all_reduce(theirs)
        rows.append({"n": n, "bitwise": torch.equal(ours, theirs), "max_diff": float((ours - theirs).abs().max()),
                     "messages": stats.messages, "bytes_sent": stats.bytes_sent})
    return rows


def show_collectives(ctx, n: int = 6) -> dict:
    """Each collective on a tiny tensor (rank r holds r*10 + [0, 1, ...]): before and after, on every
    rank (a function for ``ddpkit.launch``)."""
    world, r, device = ctx.world_size, ctx.rank, ctx.device
    mine = torch.arange(n, dtype=torch.float32, device=device) + 10 * r
    out = {"before": mine.tolist()}
    t = mine.clone()
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    t = mine.clone()
    dist.broadcast(t, src=0)
    out["broadcast"] = t.tolist()
    shard = torch.empty(n // world, device=device)
    reduce_scatter_tensor(shard, mine[: n // world * world].clone())
    out["reduce_scatter"] = shard.tolist()
    gathered = torch.empty(n // world * world, device=device)
    all_gather_into_tensor(gathered, mine[: n // world].clone())
    out["all_gather"] = gathered.tolist()
    return out


def opposite_orders(ctx, own_group: bool, numel: int = 100_000) -> bool:
    """The async-save race made deterministic (a function for ``ddpkit.launch``): every rank issues an
    all-reduce (training) and an all-gather (a background checkpoint's) without waiting, rank 0 in one
    order and the others in the opposite one. gloo matches a group's messages by the order its
    collectives were called, so on one shared group rank 0's all-reduce meets the others' all-gather:
    expect wrong sums, an error or a timeout, every time. With ``own_group`` the all-gather runs on a
    group of its own and both complete correctly whatever the order. Returns whether both results are
    right (an error or a timeout propagates)."""
    group = dist.new_group(backend="gloo") if own_group else None  # collective: every rank creates it
    world = ctx.world_size
    summed = torch.full((numel,), float(ctx.rank + 1))
    gathered = [torch.empty(numel) for _ in range(world)]
    mine = torch.full((numel,), 10.0 * (ctx.rank + 1))
    issue = [lambda: dist.all_reduce(summed, async_op=True),
             lambda: dist.all_gather(gathered, mine, group=group, async_op=True)]
    works = [op() for op in (issue if ctx.rank == 0 else issue[::-1])]
    for work in works:
        work.wait()
    right_sum = bool((summed == world * (world + 1) / 2).all())
    right_gather = all(bool((g == 10.0 * (r + 1)).all()) for r, g in enumerate(gathered))
    return right_sum and right_gather


def ring_bytes_per_rank(nbytes: int, world: int) -> float:
    """What the ring sends from each rank for an all-reduce of ``nbytes``: 2(N-1)/N x M."""
    return 2 * (world - 1) / world * nbytes


# --------------------------------------------------------------------------- measuring collectives

def memcpy_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of a plain memory copy of ``nbytes`` on this machine (best of ``repeats``), on one
    thread, as each rank runs: the ceiling for any collective between processes that share its memory.
    (On two threads a copy waits for the slower one: beside a busy process on every core that halved it
    several times over, below what gloo's single-threaded ranks reached.)"""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best, threads = math.inf, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best


def run_collective(op: str, tensor: torch.Tensor, group=None, out: torch.Tensor | None = None) -> None:
    """One call of a torch collective on a message of ``tensor``'s size (nccl-tests' conventions:
    all_gather's message is the gathered output, reduce_scatter's the full input)."""
    if op == "all_reduce":
        dist.all_reduce(tensor, group=group)
    elif op == "broadcast":
        dist.broadcast(tensor, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    elif op == "reduce_scatter":
        reduce_scatter_tensor(out, tensor, group)
    elif op == "all_gather":
        all_gather_into_tensor(tensor, out, group)
    elif op == "ring_all_reduce":
        ring_all_reduce(tensor, group)
    else:
        raise ValueError(f"unknown collective {op!r}: use one of {', '.join(COLLECTIVES)} or ring_all_reduce")


def time_collective(op: str, nbytes: int, group=None, iters: int = 5, warmup: int = 1,
                    device: torch.device | str = "cpu") -> float:
    """Median seconds of one ``op`` on a message of ``nbytes`` on ``device`` (collective: every rank
    calls). Every call starts from a barrier, so a rank that arrived late is not billed to the collective."""
    return _timed_calls(op, nbytes, group, iters, warmup, torch.device(device))[0]


def _timed_calls(op: str, nbytes: int, group, iters: int, warmup: int,
                 device: torch.device = torch.device("cpu")) -> tuple[float, float]:
    """(median, fastest) seconds of ``iters`` calls, each the slowest rank's. On a busy machine the
    fastest call is the one least disturbed by other processes: what a cost model should be fitted to.

    Timed on the device's clock: on a GPU a collective returns as soon as it is queued, so CUDA events
    recorded on the stream around it measure it (read once it has finished); on the CPU, the host clock."""
    n = dist.get_world_size(group)
    numel = max(n, nbytes // 4 // n * n)
    tensor = torch.ones(numel, device=device)
    out = torch.empty(numel // n, device=device) if op in ("reduce_scatter", "all_gather") else None
    times = []
    for i in range(warmup + iters):
        dist.barrier(group=group, **({"device_ids": [device.index]} if device.type == "cuda" else {}))
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_collective(op, tensor, group, out)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            started = time.perf_counter()
            run_collective(op, tensor, group, out)
            seconds = time.perf_counter() - started
        if i >= warmup:
            times.append(seconds)
    # a collective is done when the last rank is: every rank reports the slowest rank's times
    slowest = torch.tensor([statistics.median(times), min(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest[0]), float(slowest[1])


def bandwidths(op: str, nbytes: int, seconds: float, world: int) -> dict:
    """algbw and busbw (bytes/s) of one measurement, as nccl-tests defines them."""
    algbw = nbytes / seconds
    factor = BUS_FACTOR["all_reduce" if op == "ring_all_reduce" else op](world)
    return {"op": op, "bytes": nbytes, "seconds": seconds, "algbw": algbw, "busbw": algbw * factor}


def benchmark(ctx, sizes: list[int], ops: tuple[str, ...] = COLLECTIVES, iters: int = 5) -> list[dict]:
    """Time every ``op`` at every message size on the world (a function for ``ddpkit.launch``); every
    rank returns the same rows: op, bytes, seconds (median), best_seconds (fastest), algbw and busbw
    (of the median), world."""
    rows = []
    for op in ops:
        for nbytes in sizes:
            seconds, fastest = _timed_calls(op, nbytes, None, iters, 1, ctx.device)
            rows.append({**bandwidths(op, nbytes, seconds, ctx.world_size), "best_seconds": fastest, "world": ctx.world_size})
    return rows


# --------------------------------------------------------------------------- the alpha-beta model

# The cost model lives in ddpkit.parallel.cost (per message, two link classes, scaling efficiency);
# these names stay importable from here.
from ddpkit.parallel.cost import (  # noqa: E402,F401
    AlphaBeta,
    fit_alpha_beta,
    fit_ring,
    ring_all_reduce_seconds,
    scaling_efficiency,
)
