"""Context parallelism from scratch: ring attention, with the causal work balanced by a zig-zag layout.

Context parallelism splits **every** activation along the sequence: rank r of N holds T/N positions
of the tokens, of every layer's input and output, and of the queries, keys and values. Everything but
attention is independent along the sequence; attention needs every query to see every (earlier) key.
**Ring attention** (Liu, Zaharia and Abbeel, 2023, arXiv 2310.01889) keeps the queries in place and
passes the key/value blocks around a ring of ranks: in N steps each rank sees every rank's K and V,
while it only ever holds two blocks (the one it computes with and the one arriving).

* **Online softmax.** Attention over the whole sequence is softmax(q k^T / sqrt(d)) v. Computed one
  key block at a time, each block gives its own normalised output ``o_j`` and the log of its softmax
  denominator ``lse_j = log sum exp(s)``. Two partial results merge exactly as
  ``lse = log(e^lse_1 + e^lse_2)`` and ``o = e^(lse_1 - lse) o_1 + e^(lse_2 - lse) o_2``
  (Milakov and Gimelshein, 2018, arXiv 1805.02867; FlashAttention, Dao et al., 2022, arXiv 2205.14135):
  each partial output is re-weighted by its share of the final denominator (:func:`merge`).
* **Causal masking, balanced.** With the sequence cut in N contiguous pieces, rank N-1's queries see
  every key block and rank 0's only its own: the last rank does about 2N-1 times the work of the first,
  and every ring step waits for the slowest. Cut the sequence in 2N chunks instead and give rank r
  chunks r and 2N-1-r (**zig-zag**, as zhuzilin's ring-flash-attention names it; PyTorch's
  ``context_parallel`` calls it head-tail load balancing and uses it by default): every rank then computes
  the same number of blocks (:func:`block_counts`).
* **Overlap.** At each step a rank posts the exchange of the *next* K/V block (one
  ``dist.batch_isend_irecv`` holding its send to the next rank and its receive from the previous one,
  posted together so that it cannot deadlock when a send completes only once its receive is posted, as
  with NCCL) and computes with the current block while the bytes travel; it waits only afterwards.

The backward (:class:`RingAttention`) is written by hand, FlashAttention-style: it recomputes each
block's probabilities from the saved log-sum-exp, accumulates dQ locally, and passes each K/V block's
partial dK/dV around the ring **with** the block, so that after N steps every rank receives the
complete gradient of its own keys and values. It is checked against autograd through full attention and
through ``F.scaled_dot_product_attention`` (tests/test_context.py). What stays on a rank for backward is
its own q, k, v, output and log-sum-exp: 1/N of full attention's.

PyTorch has its own, ``torch.distributed.tensor.experimental.context_parallel``; on CPU it stops at
"Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered" (torch 2.13): ``context_checks.try_torch_context_parallel`` shows it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")


def chunk_ids(rank: int, world: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two of the sequence's 2N chunks that ``rank`` holds: (r, 2N-1-r) zig-zag, (2r, 2r+1) contiguous."""
    if layout == "zigzag":
        return rank, 2 * world - 1 - rank
    if layout == "contiguous":
        return 2 * rank, 2 * rank + 1
    raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def shard_sequence(x: torch.Tensor, rank: int, world: int, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (whose length must divide by 2N): its two chunks, in order."""
    if x.shape[dim] % (2 * world):
        raise ValueError(f"context parallelism over {world} ranks needs a sequence length divisible by "
                         f"{2 * world}, got {x.shape[dim]}")
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, world, layout)], dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """The whole sequence from every rank's shard (``shards[r]`` is rank r's)."""
    world, chunks = len(shards), {}
    for rank, shard in enumerate(shards):
        for i, part in zip(chunk_ids(rank, world, layout), shard.chunk(2, dim)):
            chunks[i] = part
    return torch.cat([chunks[i] for i in range(2 * world)], dim)


def positions(local_len: int, rank: int, world: int, layout: str = "zigzag") -> torch.Tensor:
    """Global positions of this rank's ``local_len`` tokens (what the position embedding must see)."""
    c = local_len // 2
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, world, layout)])


def block_counts(world: int, layout: str = "zigzag") -> list[int]:
    """Query-chunk x key-chunk blocks each rank computes for causal attention (a block is skipped when
    its keys all come after its queries): the work, per rank, that a ring step waits on."""
    all_chunks = range(2 * world)
    return [sum(k <= q for q in chunk_ids(r, world, layout) for k in all_chunks) for r in range(world)]


# --------------------------------------------------------------------------- one block, and the merge

def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query chunk over one key/value chunk, written out: its normalised output
    (B, H, c, D) and the log of its softmax denominator (B, H, c). ``causal`` masks keys after the query
    (the two chunks cover the same positions)."""
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, c, c)
    if causal:
        scores = scores.masked_fill(_upper(scores.shape[-1], scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, c)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def _upper(c: int, device) -> torch.Tensor:
    return torch.ones(c, c, dtype=torch.bool, device=device).triu(1)  # True above the diagonal: future keys


def merge(out, lse, block_out, block_lse, rescale: bool = True):
    """Merge two partial attentions over disjoint key sets (online softmax). ``rescale=False`` just adds
    the outputs, forgetting that each was normalised by its own denominator: the negative control."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)  # (B, H, c)
    if not rescale:
        return out + block_out, new
    return torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(block_lse - new).unsqueeze(-1) * block_out, new


# --------------------------------------------------------------------------- the ring

@dataclass
class RingStats:
    """What one rank did in one pass (forward or backward) of ring attention."""

    blocks: int = 0
    """Query-chunk x key-chunk blocks computed."""
    compute_s: float = 0.0
    """Seconds (wall clock) computing blocks."""
    compute_cpu_s: float = 0.0
    """CPU seconds of this rank's thread computing blocks: unlike the wall clock, not inflated when more
    ranks than cores share the machine."""
    wait_s: float = 0.0
    """Seconds blocked waiting for the ring's messages: communication that was *not* hidden."""
    bytes_sent: int = 0
    hops: list = field(default_factory=list)
    """Per ring step: (start, compute end, wait end) in seconds from the pass's start."""
    exchanges: list = field(default_factory=list)
    """Per exchange, in the order posted (the same on every rank): [posting started, posting returned, wait
    started, wait ended], read from ``time.monotonic``, which is system-wide (CLOCK_MONOTONIC on Linux):
    records of ranks on one machine can be set side by side, to tell waiting for a late peer from waiting
    for the bytes (``context_checks.measure_overlap``)."""


class _Exchange:
    """One ring hop of a tensor: sent to the next rank, its successor received from the previous one,
    posted as one ``batch_isend_irecv`` (paired, so NCCL's rendezvous cannot deadlock)."""

    def __init__(self, tensor: torch.Tensor, group, stats: RingStats) -> None:
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.received = torch.empty_like(tensor)
        self.times = [time.monotonic(), None, None, None]
        stats.exchanges.append(self.times)
        ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (r + 1) % n), group),
               dist.P2POp(dist.irecv, self.received, dist.get_global_rank(group, (r - 1) % n), group)]
        self.requests = dist.batch_isend_irecv(ops)
        self.times[1] = time.monotonic()
        stats.bytes_sent += tensor.numel() * tensor.element_size()

    def wait(self, stats: RingStats) -> torch.Tensor:
        start, self.times[2] = time.perf_counter(), time.monotonic()
        for request in self.requests:
            request.wait()
        stats.wait_s += time.perf_counter() - start
        self.times[3] = time.monotonic()
        return self.received


class RingAttention(torch.autograd.Function):
    """Causal ring attention over ``group``: q, k, v are this rank's (B, H, 2c, D) shards in ``layout``;
    returns this rank's (B, H, 2c, D) output. Forward and backward are written by hand (see the module
    docstring); ``stats`` (a pair of :class:`RingStats`) receives what forward and backward did."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout="zigzag", overlap=True, rescale=True, stats=None):
        fwd = stats[0] if stats else RingStats()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        scale = q.shape[-1] ** -0.5
        mine, q_chunks = chunk_ids(r, n, layout), q.chunk(2, dim=2)
        acc = [(None, None), (None, None)]
        kv = torch.stack([k, v]).contiguous()  # (2, B, H, 2c, D): one message per hop
        start = time.perf_counter()
        for step in range(n):
            src, hop_start = (r - step) % n, time.perf_counter() - start
            pending = _Exchange(kv, group, fwd) if step < n - 1 and overlap else None  # next block, in flight now
            t0, c0 = time.perf_counter(), time.thread_time()
            k_chunks, v_chunks = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for i, qi in enumerate(mine):
                for j, kj in enumerate(chunk_ids(src, n, layout)):
                    if kj <= qi:  # keys after the queries are all masked: skip the block
                        block = block_attention(q_chunks[i], k_chunks[j], v_chunks[j], scale, causal=kj == qi)
                        acc[i] = merge(*acc[i], *block, rescale=rescale)
                        fwd.blocks += 1
            fwd.compute_s += time.perf_counter() - t0
            fwd.compute_cpu_s += time.thread_time() - c0
            computed = time.perf_counter() - start
            if step < n - 1:
                kv = (pending or _Exchange(kv, group, fwd)).wait(fwd)
            fwd.hops.append((hop_start, computed, time.perf_counter() - start))
        out = torch.cat([acc[0][0], acc[1][0]], dim=2)  # (B, H, 2c, D)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)  # stored (B, 2c, H, D), as SDPA's: heads merge as a view
        lse = torch.cat([acc[0][1], acc[1][1]], dim=2)  # (B, H, 2c)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.overlap = group, layout, overlap
        ctx.stats = stats[1] if stats else RingStats()
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        bwd, group, layout = ctx.stats, ctx.group, ctx.layout
        n, r = dist.get_world_size(group), dist.get_rank(group)
        scale = q.shape[-1] ** -0.5
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # (B, H, 2c): rowsum(dO * O), the softmax's backward term
        dq = torch.zeros_like(q)
        mine = chunk_ids(r, n, layout)
        q_c, do_c, lse_c, d_c, dq_c = (t.chunk(2, dim=2) for t in (q, dout, lse, delta, dq))
        kv, grads_in = torch.stack([k, v]).contiguous(), None
        start = time.perf_counter()
        for step in range(n):
            src, hop_start = (r - step) % n, time.perf_counter() - start
            pending = _Exchange(kv, group, bwd) if step < n - 1 and ctx.overlap else None
            t0, c0 = time.perf_counter(), time.thread_time()
            dkv = torch.zeros_like(kv)  # this rank's contribution to the visiting block's dK, dV
            k_c, v_c, dk_c, dv_c = kv[0].chunk(2, 2), kv[1].chunk(2, 2), dkv[0].chunk(2, 2), dkv[1].chunk(2, 2)
            for i, qi in enumerate(mine):
                for j, kj in enumerate(chunk_ids(src, n, layout)):
                    if kj > qi:
                        continue
                    scores = q_c[i] @ k_c[j].transpose(-2, -1) * scale  # (B, H, c, c)
                    if kj == qi:
                        scores = scores.masked_fill(_upper(scores.shape[-1], scores.device), float("-inf"))
                    p = torch.exp(scores - lse_c[i].unsqueeze(-1))  # the final probabilities, block by block
                    dv_c[j].add_(p.transpose(-2, -1) @ do_c[i])
                    ds = p * (do_c[i] @ v_c[j].transpose(-2, -1) - d_c[i].unsqueeze(-1))  # (B, H, c, c)
                    dq_c[i].add_(ds @ k_c[j] * scale)
                    dk_c[j].add_(ds.transpose(-2, -1) @ q_c[i] * scale)
                    bwd.blocks += 1
            bwd.compute_s += time.perf_counter() - t0
            bwd.compute_cpu_s += time.thread_time() - c0
            computed = time.perf_counter() - start
            if grads_in is not None:  # the partial dK, dV that travelled here with this block
                dkv = dkv + grads_in.wait(bwd)
            grads_in = _Exchange(dkv, group, bwd)  # on to the next rank, with the block; the last hop brings it home
            if step < n - 1:
                kv = (pending or _Exchange(kv, group, bwd)).wait(bwd)
            bwd.hops.append((hop_start, computed, time.perf_counter() - start))
        dkv = grads_in.wait(bwd)  # this rank's own block, having visited every rank
        return dq, dkv[0], dkv[1], None, None, None, None, None


def ring_attention(q, k, v, group, layout: str = "zigzag", overlap: bool = True, rescale: bool = True,
                   stats: tuple[RingStats, RingStats] | None = None) -> torch.Tensor:
    """Causal attention of this rank's (B, H, 2c, D) shards over the whole sequence (see :class:`RingAttention`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if q.shape[2] % 2:
        raise ValueError(f"each rank holds two chunks of the sequence: its length {q.shape[2]} must be even")
    return RingAttention.apply(q, k, v, group, layout, overlap, rescale, stats)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention written out over the whole sequence (the reference the ring must reproduce)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    scores = scores.masked_fill(_upper(scores.shape[-1], scores.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# --------------------------------------------------------------------------- the GPT, context parallel

class RingSelfAttention(torch.nn.Module):
    """The GPT's causal self-attention on this rank's positions, attending over the whole sequence by
    ring attention. Keeps the original ``qkv`` and ``proj`` layers (same parameters, same names).

    It wraps a whole attention or a tensor-parallel one
    (:class:`~ddpkit.parallel.tensor.ParallelSelfAttention`) alike: the heads are independent, so the
    ring runs over the cp group on whichever heads ``qkv`` gives this rank, and the row-parallel ``proj``
    sums the tp ranks' heads afterwards. Context and tensor parallelism split different axes (positions,
    heads) and compose without either knowing of the other."""

    def __init__(self, full, group, layout: str = "zigzag") -> None:
        super().__init__()
        self.n_heads = getattr(full, "local_heads", None) or full.n_heads  # this rank's heads under tp
        self.qkv, self.proj = full.qkv, full.proj
        self.group, self.layout = group, layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # T: this rank's positions
        q, k, v = self.qkv(x).chunk(3, dim=2)  # 3 x (B, T, C) or, under tp, 3 x (B, T, C/tp)
        hs = q.shape[-1] // self.n_heads
        q, k, v = (t.view(B, T, self.n_heads, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.group, self.layout)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def parallelize_context(model: torch.nn.Module, group, layout: str = "zigzag") -> torch.nn.Module:
    """Context parallelism for a :class:`~ddpkit.models.TinyGPT`, in place: each rank then takes its
    shard of the tokens (:func:`shard_sequence`, dim 1) and returns the logits of those positions. Every
    attention becomes ring attention; the position embedding is looked up at the shard's global
    positions (a forward pre-hook). Parameters stay whole on every rank and each rank's gradients cover
    its own positions only: average them over the context-parallel group (as DDP would, over dp x cp)."""
    from ddpkit.models import TinyGPT

    if not isinstance(model, TinyGPT):
        raise ValueError("context parallelism splits the GPT's sequence: use --model gpt")
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if model.pos_emb.num_embeddings % (2 * n):
        raise ValueError(f"context parallelism over {n} ranks needs a sequence length divisible by {2 * n}, "
                         f"got {model.pos_emb.num_embeddings}")
    for block in model.blocks:
        block.attn = RingSelfAttention(block.attn, group, layout)
    model.pos_emb.register_forward_pre_hook(
        lambda module, args: (positions(args[0].numel(), r, n, layout).to(args[0].device),))
    return model
