"""What communication costs, and why scaling efficiency falls: the alpha-beta model, per message.

**Per message.** Sending one message of M bytes over a link costs ``alpha + M / bandwidth``: a fixed
latency plus a time per byte (the Hockney model; nccl-tests' PERFORMANCE.md writes the same form,
"roughly equal to overhead + size / bw", for a whole collective's time). A **ring all-reduce** on N ranks is 2(N-1) such messages of M/N bytes one after
another (N-1 for its reduce-scatter, N-1 for its all-gather), so

    t_ring(M, N) = 2(N-1) x alpha + 2(N-1)/N x M / bandwidth.

A measured all-reduce is therefore *not* one message: on 2 ranks it is two. Fitting ``alpha + M / bw``
to whole 2-rank all-reduces and then reusing that alpha per message counts the latency twice
(:func:`fit_alpha_beta` describes a whole call; :func:`fit_ring` recovers the per-message link from
all-reduces of known world size).

**Two link classes.** Inside a node GPUs talk over NVLink; between nodes over the network, roughly an
order of magnitude slower per GPU (seed 003 says 10-100x; with one 200-400 Gb/s NIC per GPU, as on DGX
A100/H100 nodes, it is about 6-12x). Seed 003's own figures: 600 GB/s NVLink against 50 GB/s for 400
Gb/s InfiniBand, 12x; but the A100's 600 GB/s counts both directions, and a ring rank sends 2(N-1)/N x M
out while it receives as much in, so its send rate, 300 GB/s per direction, bounds it: 6x. A flat ring that
crosses nodes moves at its slowest hop, every step (:func:`ring_all_reduce_seconds` with ``inter``); a
hierarchical all-reduce (reduce-scatter inside each node, all-reduce across nodes on 1/g of the bytes,
all-gather inside) sends only 1/g of the bytes over the slow links (:func:`hierarchical_all_reduce_seconds`).

**Scaling efficiency** (:func:`scaling_efficiency`) is ideal time over actual time. *Weak* scaling keeps
each rank's batch (the global batch grows with N, DDP's usual case): the step is the slowest rank's
compute plus the communication not hidden behind backward. *Strong* scaling keeps the global batch:
each rank's compute shrinks as 1/N while the all-reduce does not, so efficiency falls much faster.
**Stragglers**: a synchronous step waits for the slowest of N ranks, and the expected maximum of N
draws grows with N (:func:`expected_max` for measured samples; :func:`exp_tail_max` for an exponential
tail, 1 + jitter x (H_N - 1)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AlphaBeta:
    """``t = alpha + nbytes / bandwidth``: a fixed cost per message plus a cost per byte."""

    alpha_s: float
    """Latency: the time of an empty message."""
    bandwidth: float
    """Bytes per second once the message is large."""

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.bandwidth


def _relative_lstsq(features: list[list[float]], seconds: list[float]) -> list[float]:
    """Non-negative-clamped least squares of ``t = features . x`` in relative error (every size counts,
    the small ones included, which an absolute fit would ignore next to the large ones)."""
    rows = torch.tensor([[f / t for f in fs] for fs, t in zip(features, seconds)], dtype=torch.float64)
    ones = torch.ones(len(seconds), 1, dtype=torch.float64)
    return torch.linalg.lstsq(rows, ones).solution.flatten().tolist()


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> AlphaBeta:
    """Fit ``t = a + M / b`` to whole calls of one operation: describes that call (a per *call*, not per
    message: for a ring all-reduce use :func:`fit_ring`)."""
    if len(nbytes) < 2:
        raise ValueError("fitting alpha and beta needs at least two message sizes")
    alpha, beta = _relative_lstsq([[1.0, m] for m in nbytes], seconds)
    return AlphaBeta(max(alpha, 0.0), 1.0 / max(beta, 1e-18))


def fit_ring(nbytes: list[float], seconds: list[float], world: int | list[int]) -> AlphaBeta:
    """The per-message link behind measured ring all-reduces of ``nbytes`` on ``world`` ranks (one world
    size for all, or one per measurement): least squares of t = 2(N-1) alpha + 2(N-1)/N M / bandwidth."""
    if len(nbytes) < 2:
        raise ValueError("fitting alpha and beta needs at least two message sizes")
    worlds = [world] * len(nbytes) if isinstance(world, int) else list(world)
    if min(worlds) < 2:
        raise ValueError("a ring all-reduce needs at least 2 ranks to send any message")
    alpha, beta = _relative_lstsq([[2 * (n - 1), 2 * (n - 1) / n * m] for m, n in zip(nbytes, worlds)], seconds)
    return AlphaBeta(max(alpha, 0.0), 1.0 / max(beta, 1e-18))


def ring_all_reduce_seconds(link: AlphaBeta, nbytes: float, world: int, inter: AlphaBeta | None = None,
                            per_node: int = 8) -> float:
    """A flat ring on ``world`` ranks: 2(N-1) messages of M/N bytes, one after another. With ``inter``
    (the link between nodes of ``per_node`` ranks) a ring that spans nodes waits for its slowest hop
    at every step, so every message costs the inter-node price."""
    if world == 1:
        return 0.0
    hop = inter if inter is not None and world > per_node else link
    return 2 * (world - 1) * hop.alpha_s + 2 * (world - 1) / world * nbytes / hop.bandwidth


def hierarchical_all_reduce_seconds(intra: AlphaBeta, inter: AlphaBeta, nbytes: float, world: int,
                                    per_node: int = 8) -> float:
    """Reduce-scatter inside each node (ring of g), all-reduce of the 1/g shard across the nodes (ring of
    world/g, each local rank over its own network link), all-gather inside the node."""
    g = min(world, per_node)
    nodes = math.ceil(world / g)
    inside = 2 * (g - 1) * intra.alpha_s + 2 * (g - 1) / g * nbytes / intra.bandwidth if g > 1 else 0.0
    return inside + ring_all_reduce_seconds(inter, nbytes / g, nodes)


def expected_max(samples: list[float], n: int) -> float:
    """E[max of n independent draws] from the empirical distribution of ``samples`` (exact):
    sum over sorted x_(i) of x_(i) [(i/k)^n - ((i-1)/k)^n]."""
    xs, k = sorted(samples), len(samples)
    return sum(x * ((i / k) ** n - ((i - 1) / k) ** n) for i, x in enumerate(xs, 1))


def exp_tail_max(n: int, jitter: float) -> float:
    """E[max of n] / mean for per-rank times 1 + jitter x (Exp(1) - 1): 1 + jitter x (H_n - 1)."""
    return 1.0 + jitter * (sum(1.0 / i for i in range(1, n + 1)) - 1.0)


def scaling_efficiency(link: AlphaBeta, nbytes: float, compute_s: float, world: int, overlap: float = 0.0,
                       inter: AlphaBeta | None = None, per_node: int = 8, jitter: float = 0.0,
                       scaling: str = "weak", hierarchical: bool = False) -> float:
    """Ideal over actual step time of data parallelism on ``world`` ranks. ``compute_s``: one rank's
    compute per step (weak scaling: the same on every world size; strong: the whole global batch on one
    rank, so each rank computes compute_s / N). The step waits for the slowest rank (``jitter``: an
    exponential tail, :func:`exp_tail_max`) and for the part of the all-reduce that is not hidden behind
    backward (``overlap`` = the hidden share)."""
    if scaling not in ("weak", "strong"):
        raise ValueError(f"scaling must be weak or strong, got {scaling!r}")
    per_rank = compute_s if scaling == "weak" else compute_s / world
    if hierarchical and inter is not None:
        comm = hierarchical_all_reduce_seconds(link, inter, nbytes, world, per_node) if world > 1 else 0.0
    else:
        comm = ring_all_reduce_seconds(link, nbytes, world, inter, per_node)
    step = per_rank * exp_tail_max(world, jitter) + (1 - overlap) * comm
    return per_rank / step


def compute_times(ctx, cfg, steps: int = 30) -> list[float]:
    """Seconds of each of ``steps`` forward + backward passes of ``cfg``'s model on one micro-batch, on
    every rank at once (a function for ``ddpkit.launch``): the compute a step waits for, and how much
    it varies from step to step and rank to rank."""
    import time

    from ddpkit.models import build_model, loss_fn

    model = build_model(cfg)
    gen = torch.Generator().manual_seed(ctx.rank)
    if cfg.model == "gpt":
        inputs = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_len), generator=gen)
        targets = inputs
    else:
        inputs = torch.randn(cfg.micro_batch_size, cfg.input_width, generator=gen)
        targets = torch.randint(0, cfg.num_classes, (cfg.micro_batch_size,), generator=gen)
    times = []
    for _ in range(steps + 2):  # two warm-up passes, not counted
        start = time.perf_counter()
        loss_fn(model(inputs), targets).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return times[2:]


def fit_table(table: dict[int, float], link: AlphaBeta, nbytes: float, compute_s: float, inter: AlphaBeta | None = None,
              per_node: int = 8, jitters: tuple[float, ...] | None = None) -> dict:
    """The hidden share of the all-reduce (0..1 by 0.01) and the stragglers' jitter (``jitters``; default
    0..0.3 by 0.005) whose weak-scaling curve comes closest to ``table`` ({ranks: efficiency}) in the
    worst case. Returns ``max_error``, ``overlap``, ``jitter`` and the model's ``curve``."""
    jitters = jitters if jitters is not None else tuple(k / 200 for k in range(61))
    best = None
    for hidden in range(101):
        for jitter in jitters:
            curve = {n: scaling_efficiency(link, nbytes, compute_s, n, hidden / 100, inter, per_node, jitter) for n in table}
            error = max(abs(curve[n] - table[n]) for n in table)
            if best is None or error < best["max_error"]:
                best = {"max_error": error, "overlap": hidden / 100, "jitter": jitter, "curve": curve}
    return best


def collective_bytes(ctx, cfg, strategy: str, steps: int = 2, reshard_after_forward: bool = True) -> dict:
    """Bytes this rank moves per training step under ``strategy`` ("ddp" or "fsdp2"), counted from the
    collectives themselves (a function for ``ddpkit.launch``), in nccl-tests' terms: an all-reduce of M
    bytes moves 2(N-1)/N x M, an all-gather or reduce-scatter of S bytes in all (N-1)/N x S. DDP's
    all-reduces are counted by a comm hook around PyTorch's default one; FSDP2's all-gathers and
    reduce-scatters by wrapping ``torch.distributed``'s functions it calls. ``reshard_after_forward=False``
    keeps each block's gathered parameters from forward to backward (no second all-gather, more memory)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from ddpkit.models import build_model, loss_fn
    from ddpkit.parallel import fsdp

    n = ctx.world_size
    counted = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    model = build_model(cfg)
    if strategy == "ddp":
        model = DistributedDataParallel(model)

        def counting_hook(state, bucket):
            counted["all_reduce"] += bucket.buffer().numel() * bucket.buffer().element_size()
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_hook)
    elif strategy == "fsdp2":
        fully_shard = fsdp.fully_shard_fn()
        for unit in fsdp.shard_units(model):
            fully_shard(unit, reshard_after_forward=reshard_after_forward)
        fully_shard(model)
        for name, kind, arg in (("all_gather_single", "all_gather", ("output_tensor", 0)),
                                ("all_gather_into_tensor", "all_gather", ("output_tensor", 0)),
                                ("reduce_scatter_single", "reduce_scatter", ("input", 1)),
                                ("reduce_scatter_tensor", "reduce_scatter", ("input", 1))):
            original = getattr(dist, name, None)
            if original is None:
                continue

            def counting(*args, _original=original, _kind=kind, _arg=arg, **kwargs):
                tensor = kwargs[_arg[0]] if _arg[0] in kwargs else args[_arg[1]]  # the whole gathered output / scattered input
                counted[_kind] += tensor.numel() * tensor.element_size()
                return _original(*args, **kwargs)

            setattr(dist, name, counting)
    else:
        raise ValueError(f"strategy must be ddp or fsdp2, got {strategy!r}")
    gen = torch.Generator().manual_seed(ctx.rank)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_len), generator=gen)
    for _ in range(steps):
        loss_fn(model(tokens), tokens).backward()
        model.zero_grad(set_to_none=True)
    moved = 2 * (n - 1) / n * counted["all_reduce"] + (n - 1) / n * (counted["all_gather"] + counted["reduce_scatter"])
    return {**{k: v / steps for k, v in counted.items()}, "moved_per_step": moved / steps}
