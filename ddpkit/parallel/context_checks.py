"""Ring attention on real ranks, checked and measured: functions for ``ddpkit.launch`` (notebook 17, tests).

* :func:`check_against_full`: the ring's output and its hand-written dQ, dK, dV against autograd through
  causal attention written out over the whole sequence, and through ``F.scaled_dot_product_attention``;
* :func:`measure_memory`: bytes kept for backward per rank, against the sequence length;
* :func:`measure_overlap`: time blocked on the ring with the next hop posted before computing, or after;
* :func:`measure_balance`: blocks, FLOPs and compute time per rank, zig-zag against contiguous;
* :func:`block_flops`: the FLOPs one block of ring attention's forward costs;
* :func:`check_gpt_against_unsplit`: the whole GPT, context parallel, against the unsplit one;
* :func:`try_torch_context_parallel`: PyTorch's own ``context_parallel``, where it runs.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpkit.parallel.context import (
    LAYOUTS,
    RingStats,
    block_counts,
    full_attention,
    parallelize_context,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)


def _qkv(batch: int, heads: int, seq_len: int, head_dim: int, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v and an output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, head_dim, generator=g) for _ in range(4)]


def _all_shards(x: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def saved_bytes(fn, *args) -> int:
    """Bytes that ``fn(*args)`` keeps alive for backward (each storage once), as
    :func:`ddpkit.parallel.memory.activation_bytes` counts them."""
    seen: dict[int, int] = {}

    def pack(tensor):
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def check_against_full(ctx, batch: int = 2, heads: int = 4, seq_len: int = 64, head_dim: int = 16,
                       layout: str = "zigzag", rescale: bool = True, overlap: bool = True) -> dict:
    """Largest differences of the ring's output and gradients from full causal attention (``full``:
    written out; ``sdpa``: PyTorch's), each on the whole sequence by autograd; and what the ring did."""
    group, n, r = dist.group.WORLD, ctx.world_size, ctx.rank
    q, k, v, dout = _qkv(batch, heads, seq_len, head_dim)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    references = {}
    for name, fn in (("full", full_attention), ("sdpa", sdpa)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout)
        references[name] = [out.detach()] + [t.grad for t in leaves]
    local = [shard_sequence(t, r, n, dim=2, layout=layout).requires_grad_(True) for t in (q, k, v)]
    stats = (RingStats(), RingStats())
    out = ring_attention(*local, group, layout, overlap, rescale, stats)
    out.backward(shard_sequence(dout, r, n, dim=2, layout=layout))
    ours = [unshard_sequence(_all_shards(t.detach(), group), 2, layout) for t in (out, *(x.grad for x in local))]
    diffs = {name: {key: float((a - b).abs().max()) for key, a, b in zip(("out", "dq", "dk", "dv"), ours, ref)}
             for name, ref in references.items()}
    return {"diffs": diffs, "max_diff": max(d for per in diffs.values() for d in per.values()),
            "blocks": stats[0].blocks, "expected_blocks": block_counts(n, layout)[r],
            "messages_bytes": stats[0].bytes_sent + stats[1].bytes_sent}


def measure_memory(ctx, seq_lens: list[int], batch: int = 1, heads: int = 2, head_dim: int = 16,
                   written_out_max: int = 1024) -> list[dict]:
    """Per sequence length: bytes kept for backward by this rank's ring attention, by PyTorch's fused
    attention over the whole sequence on one rank, and by attention written out (its T x T
    probabilities; only up to ``written_out_max``)."""
    group, n, r = dist.group.WORLD, ctx.world_size, ctx.rank
    rows = []
    for seq_len in seq_lens:
        q, k, v, _ = _qkv(batch, heads, seq_len, head_dim)
        whole = [t.requires_grad_(True) for t in (q, k, v)]
        local = [shard_sequence(t.detach(), r, n, dim=2).requires_grad_(True) for t in (q, k, v)]
        rows.append({"seq_len": seq_len,
                     "ring": saved_bytes(ring_attention, *local, group),
                     "sdpa_one_rank": saved_bytes(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), *whole),
                     "written_out_one_rank": saved_bytes(full_attention, *whole) if seq_len <= written_out_max else None})
    return rows


def _blocked_on_bytes(mine: list, sender: list, receiver: list) -> dict:
    """One rank's exchanges (``RingStats.exchanges``), matched by posting order with those of the rank it
    receives from (``sender``) and the rank it sends to (``receiver``), split into seconds spent posting,
    seconds waiting for a peer that had not posted its side yet, and seconds waiting once both had: the
    wait for the bytes themselves. A hop cannot complete before both peers posted: gloo (and NCCL) moves
    a message only once its receive is posted, and the receive here needs the previous rank's send."""
    split = {"post_s": 0.0, "late_peer_s": 0.0, "on_bytes_s": 0.0}
    for (posted, returned, wait_start, wait_end), theirs, ours in zip(mine, sender, receiver):
        ready = max(theirs[0], ours[0])  # both ends of this rank's send and receive are posted
        late = min(wait_end, max(ready, wait_start)) - wait_start
        split["post_s"] += returned - posted
        split["late_peer_s"] += late
        split["on_bytes_s"] += wait_end - wait_start - late
    return split


def measure_overlap(ctx, batch: int = 4, heads: int = 4, seq_len: int = 1024, head_dim: int = 64,
                    repeats: int = 3) -> dict:
    """Forward and backward of the ring with the next hop posted before computing the current block
    (``overlap``) and after it (``serial``), alternately, ``repeats`` times each; for each mode the median
    run by the waiting on the bytes of all ranks (the same run on every rank): seconds computing, seconds
    blocked waiting on messages (``wait_s``), split into waiting for a peer that had not posted yet
    (``late_peer_s``: on a busy machine mostly a descheduled peer, what varies most from run to run) and
    waiting once both peers had posted (``on_bytes_s``: the transfer that was not hidden; summed over the
    ranks in ``all_ranks_on_bytes_s``), seconds spent posting (``post_s``, in either mode: gloo starts
    writing a message into the socket inside the posting call when its receive is already posted, after
    taking the connection's lock, which its own thread holds while reading an arriving message), and the
    per-hop timeline. The median, not the least: on a busy machine either mode has runs far off its
    usual, in both directions (serial runs waiting on the bytes less than most overlapped ones included).
    ``pairs``: per repeat, the overlapped run's waiting on the bytes over the serial run's (all ranks), for
    :func:`ddpkit.timing.verdict`.

    The split sets the ranks' records side by side on ``time.monotonic``, one clock for every process of
    one machine: it holds for ranks sharing a machine, as here."""
    group, n, r = dist.group.WORLD, ctx.world_size, ctx.rank
    q, k, v, dout = (shard_sequence(t, r, n, dim=2) for t in _qkv(batch, heads, seq_len, head_dim))
    runs: dict[str, list[dict]] = {"overlap": [], "serial": []}
    for _ in range(repeats):
        for mode, overlap in (("overlap", True), ("serial", False)):
            stats = (RingStats(), RingStats())
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            dist.barrier(group=group)
            start = time.perf_counter()
            ring_attention(*leaves, group, overlap=overlap, stats=stats).backward(dout)
            total = time.perf_counter() - start
            records: list = [None] * n
            dist.all_gather_object(records, stats[0].exchanges + stats[1].exchanges, group=group)
            split = [_blocked_on_bytes(records[i], records[(i - 1) % n], records[(i + 1) % n]) for i in range(n)]
            row = {"total_s": total, "wait_s": stats[0].wait_s + stats[1].wait_s, **split[r],
                   "all_ranks_on_bytes_s": sum(s["on_bytes_s"] for s in split),
                   "compute_s": stats[0].compute_s + stats[1].compute_s,
                   "forward_hops": stats[0].hops, "backward_hops": stats[1].hops,
                   "bytes_sent": stats[0].bytes_sent + stats[1].bytes_sent}
            runs[mode].append(row)
    # every rank computed the same totals from the same records, so every rank picks the same run
    medians = {mode: sorted(rows, key=lambda row: row["all_ranks_on_bytes_s"])[len(rows) // 2] for mode, rows in runs.items()}
    # each repeat ran the two modes back to back: a pair for a sign test (overlapped over serial, all ranks)
    pairs = [o["all_ranks_on_bytes_s"] / max(s["all_ranks_on_bytes_s"], 1e-9) for o, s in zip(runs["overlap"], runs["serial"])]
    return {**medians, "pairs": pairs}


def measure_balance(ctx, batch: int = 2, heads: int = 4, seq_len: int = 1024, head_dim: int = 128,
                    repeats: int = 4) -> dict:
    """Per layout, on this rank: blocks computed, the matrix-multiply FLOPs one forward ran (counted by
    ``torch.utils.flop_counter.FlopCounterMode`` as the ops are dispatched: exact, whatever the machine's
    load), what :func:`block_flops` says one block costs at these sizes, the least CPU seconds one forward spent computing its blocks, and the fastest forward's
    wall-clock seconds (about the same on every rank: each ring step waits for the slowest). The first
    pass of each layout is the warm-up (allocations, caches) and the one counted; the layouts then
    alternate, so that a rank slowed by a busy machine is slowed for both."""
    from torch.utils.flop_counter import FlopCounterMode

    group, n, r = dist.group.WORLD, ctx.world_size, ctx.rank
    shards = {layout: [shard_sequence(t, r, n, dim=2, layout=layout) for t in _qkv(batch, heads, seq_len, head_dim)[:3]]
              for layout in LAYOUTS}
    runs: dict[str, list] = {layout: [] for layout in LAYOUTS}
    flops: dict[str, int] = {}
    for attempt in range(repeats + 1):
        for layout in LAYOUTS:
            stats = (RingStats(), RingStats())
            dist.barrier(group=group)
            start = time.perf_counter()
            with torch.no_grad():
                if attempt == 0:  # counting slows the ops down: this pass is not timed
                    with FlopCounterMode(display=False) as counter:
                        ring_attention(*shards[layout], group, layout, stats=stats)
                    flops[layout] = counter.get_total_flops()
                else:
                    ring_attention(*shards[layout], group, layout, stats=stats)
            if attempt:
                runs[layout].append((stats[0].compute_cpu_s, time.perf_counter() - start, stats[0].blocks))
    per_block = block_flops(batch, heads, seq_len, head_dim, n)  # the formula, beside the count it should explain
    return {layout: {"blocks": rows[0][2], "flops": flops[layout], "block_flops": per_block,
                     "compute_cpu_s": min(c for c, _, _ in rows), "total_s": min(t for _, t, _ in rows)}
            for layout, rows in runs.items()}


def block_flops(batch: int, heads: int, seq_len: int, head_dim: int, world: int) -> int:
    """Matrix-multiply FLOPs of one forward block (a chunk of c = seq_len / 2N queries over one chunk of
    keys): scores q k^T and output p v, each 2 B H c c D. A diagonal block is computed whole and then
    masked, so it costs as much as any other."""
    c = seq_len // (2 * world)
    return 2 * (2 * batch * heads * c * c * head_dim)


def check_gpt_against_unsplit(ctx, cfg, batch: int = 4, layout: str = "zigzag") -> dict:
    """The GPT with context parallelism over the world against the whole GPT on the same tokens: logits
    (gathered), gradients (averaged over ranks, each rank's loss being the mean over its positions),
    and bytes kept for backward on a rank, whole and split."""
    from ddpkit.models import build_model, loss_fn
    from ddpkit.parallel.memory import activation_bytes

    group, n, r = dist.group.WORLD, ctx.world_size, ctx.rank
    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # views would count the whole storage
    whole = build_model(cfg)
    logits_whole = whole(inputs)
    loss_fn(logits_whole, targets).backward()
    split = parallelize_context(build_model(cfg), group, layout)
    local_inputs = shard_sequence(inputs, r, n, 1, layout)
    logits = split(local_inputs)
    loss_fn(logits, shard_sequence(targets, r, n, 1, layout)).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in split.parameters()])
    dist.all_reduce(grads, group=group)  # what DDP over the cp ranks does: the mean of equal-sized shards
    grads /= n
    full_grads = torch.cat([p.grad.reshape(-1) for p in whole.parameters()])
    gathered = unshard_sequence(_all_shards(logits.detach(), group), 1, layout)
    return {"output_diff": float((gathered - logits_whole.detach()).abs().max()),
            "grad_diff": float((grads - full_grads).abs().max()),
            "bytes_whole": activation_bytes(whole, inputs), "bytes_split": activation_bytes(split, local_inputs)}


def try_torch_context_parallel(ctx, batch: int = 1, heads: int = 2, seq_len: int = 32, head_dim: int = 8) -> dict:
    """PyTorch's ``context_parallel`` on this device: whether it ran, the error if not, and if it ran
    the largest difference of its output shard from ours (its default layout is head-tail = zig-zag)."""
    from torch.distributed.device_mesh import init_device_mesh

    q, k, v, _ = _qkv(batch, heads, seq_len, head_dim)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    buffers = [q.clone(), k.clone(), v.clone()]  # sharded in place inside the context
    try:
        from torch.distributed.tensor.experimental import context_parallel

        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            theirs = F.scaled_dot_product_attention(*buffers, is_causal=True)
    except Exception as exc:  # the lesson is the refusal: report it, whatever its type
        return {"ran": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300], "diff": None}
    local = [shard_sequence(t, ctx.rank, ctx.world_size, dim=2) for t in (q, k, v)]
    ours = ring_attention(*local, dist.group.WORLD)
    theirs = theirs.to_local() if hasattr(theirs, "to_local") else theirs
    return {"ran": True, "error": None, "diff": float((ours - theirs).abs().max())}
