"""Expert parallelism: the experts on different ranks, the tokens moved to them by all-to-all.

With E experts over ``ep`` ranks, rank r holds experts ``[r E/ep, (r+1) E/ep)`` and the router (which
every rank keeps whole). Each rank routes its own tokens (one capacity group per rank), then:

1. **split sizes first**: how many rows it will send to each expert is known only after routing, and
   differs from rank to rank, so the ranks exchange those counts (a small ``all_to_all_single`` of E
   integers per rank) before the tokens: a receiver must know how many rows arrive from whom;
2. **dispatch**: ``all_to_all_single`` with uneven ``input_split_sizes`` (rows this rank sends to each
   rank, sorted by expert, hence contiguous per destination) and ``output_split_sizes`` (rows it
   receives from each rank, from step 1);
3. each local expert runs on its rows;
4. **combine**: the reverse all-to-all (the split sizes swapped) brings each row home, where it is
   weighted by its gate and summed into its token's output.

Both all-to-alls carry gradients: the backward of an all-to-all is the all-to-all with the split sizes
swapped (:class:`AllToAll`; ``torch.distributed.nn.functional.all_to_all_single`` does the same and is
deprecated in newer torch). Each rank sends and receives k x tokens x (ep-1)/ep rows of C values when
routing is balanced, twice per layer in forward and twice in backward; ``comm.fit_alpha_beta`` on
measured all-to-alls predicts their time (:func:`all_to_all_seconds`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.parallel.comm import AlphaBeta, fit_alpha_beta
from ddpkit.parallel.experts import AddAuxiliaryLoss, Experts, MoE, route


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows with uneven splits; backward sends the gradients back the
    same way, with the split sizes swapped."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return AllToAll.apply(grad.contiguous(), input_splits, output_splits, ctx.group), None, None, None


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """(E,) rows this rank sends to each expert -> (ep, E/ep) rows it will receive, per source rank and
    local expert (collective)."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(dist.get_world_size(group), -1)


class ExpertParallelMoE(nn.Module):
    """A :class:`~ddpkit.parallel.experts.MoE` with its experts split over ``group``: the router whole,
    this rank's E/ep experts (same parameter names, a slice of each stacked weight). Forward takes this
    rank's tokens. ``exchange_splits=False`` skips step 1 and assumes each rank receives what it sends
    (the negative control); ``aux_scale`` multiplies the auxiliary loss.

    Training it inside data parallelism: the router (like every replicated parameter) is averaged over
    the data-parallel ranks; an expert's gradient already sums every rank's tokens (they reached it
    through the all-to-all), so with each rank's loss a mean over its own tokens it must be divided by
    ep the same way, and reduced only over the replicas of that expert (same expert-parallel index)."""

    def __init__(self, full: MoE, group, exchange_splits: bool = True, aux_scale: float = 1.0) -> None:
        super().__init__()
        self.group, self.exchange_splits, self.aux_scale = group, exchange_splits, aux_scale
        self.ep, rank = dist.get_world_size(group), dist.get_rank(group)
        num_experts, d_model, hidden = full.experts.w1.shape
        if num_experts % self.ep:
            raise ValueError(f"ep {self.ep} must divide the number of experts ({num_experts})")
        self.num_experts, self.local = num_experts, num_experts // self.ep
        self.k, self.capacity_factor, self.aux_coef = full.k, full.capacity_factor, full.aux_coef
        self.router = full.router
        self.experts = Experts(self.local, d_model, hidden)
        first = rank * self.local
        with torch.no_grad():
            for name, p in self.experts.named_parameters():
                p.copy_(getattr(full.experts, name)[first:first + self.local])
        self.stats: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, C): this rank's tokens, one capacity group
        routing = route(flat, self.router.weight, self.k, self.capacity_factor)
        order, counts = routing.order()  # rows sorted by expert, so by destination rank
        send_splits = counts.view(self.ep, self.local).sum(1).tolist()
        if self.exchange_splits:
            received = exchange_counts(counts, self.group)  # (ep, E/ep)
        else:
            received = counts.view(self.ep, self.local)  # a guess: what I send is what I get
        recv_splits = received.sum(1).tolist()
        start = time.perf_counter()
        rows = AllToAll.apply(flat[routing.token[order]], recv_splits, send_splits, self.group)  # dispatch
        dispatch_s = time.perf_counter() - start
        local_expert = torch.arange(self.local).repeat(self.ep).repeat_interleave(received.flatten())
        by_expert = torch.argsort(local_expert, stable=True)  # arrived by source rank; the experts want them by expert
        done = self.experts(rows[by_expert], received.sum(0).tolist())
        back = torch.empty_like(done).index_copy(0, by_expert, done)  # source order again
        out = AllToAll.apply(back, send_splits, recv_splits, self.group)  # combine: each row home
        y = torch.zeros_like(flat).index_add(0, routing.token[order], out * routing.gate[order].unsqueeze(1))
        row_bytes = flat.shape[1] * flat.element_size()
        me = dist.get_rank(self.group)
        self.stats = {"routed": routing.routed.tolist(), "kept": counts.tolist(), "dropped": int((~routing.kept).sum()),
                      "capacity": routing.capacity, "send_splits": send_splits, "recv_splits": recv_splits,
                      "dispatch_bytes": sum(n for r, n in enumerate(send_splits) if r != me) * row_bytes,
                      "received_per_local_expert": received.sum(0).tolist(),
                      "aux_loss": float(routing.aux_loss.detach()), "dispatch_s": dispatch_s}
        if self.aux_coef and torch.is_grad_enabled():
            y = AddAuxiliaryLoss.apply(y, self.aux_scale * self.aux_coef * routing.aux_loss)
        return y.view_as(x)


def all_to_all_seconds(link: AlphaBeta, bytes_to_others: float) -> float:
    """The alpha-beta model of one all-to-all in which a rank sends ``bytes_to_others`` to the other
    ranks (fitted, like ``link``, on measured all-to-alls): ``alpha + bytes / bandwidth``."""
    return link.seconds(bytes_to_others)


# --------------------------------------------------------------------------- checks a notebook and the tests run on real ranks

def check_against_single(ctx, tokens: int = 48, d_model: int = 16, num_experts: int = 4, k: int = 2,
                         capacity_factor: float | None = 1.0, exchange_splits: bool = True,
                         ep_capacity: bool = True, seed: int = 0) -> dict:
    """Expert parallelism over the world against the single-process :class:`MoE` (a function for
    ``ddpkit.launch``): the reference runs every rank's tokens through every expert, one capacity group
    per rank, on every rank; each rank compares its own tokens' outputs and input gradients, its experts'
    gradients, and the router's gradient summed over ranks. ``exchange_splits=False`` and
    ``ep_capacity=False`` are the negative controls (no split-size exchange; no capacity in the split run)."""
    group, ep, r = dist.group.WORLD, ctx.world_size, ctx.rank
    torch.manual_seed(seed)
    full = MoE(d_model, num_experts, k, capacity_factor, aux_coef=1e-2, groups=ep)
    torch.manual_seed(seed)
    split = ExpertParallelMoE(MoE(d_model, num_experts, k, capacity_factor, aux_coef=1e-2), group,
                              exchange_splits, aux_scale=1 / ep)  # summed over ranks: the groups' mean, as the reference
    if not ep_capacity:
        split.capacity_factor = None
    g = torch.Generator().manual_seed(seed + 1)
    x_all, dy_all = torch.randn(ep, tokens, d_model, generator=g), torch.randn(ep, tokens, d_model, generator=g)
    x_ref = x_all.clone().requires_grad_(True)
    (full(x_ref) * dy_all).sum().backward()
    x_mine = x_all[r].clone().requires_grad_(True)
    (split(x_mine) * dy_all[r]).sum().backward()
    y_ref = full(x_all.clone())[r].detach()  # the reference again, for this rank's outputs
    y_mine = split(x_all[r].clone()).detach()
    router = split.router.weight.grad.clone()
    dist.all_reduce(router, group=group)
    first = r * split.local
    expert_diff = max(float((getattr(split.experts, n).grad - getattr(full.experts, n).grad[first:first + split.local]).abs().max())
                      for n in ("w1", "b1", "w2", "b2"))
    return {"output_diff": float((y_mine - y_ref).abs().max()),
            "input_grad_diff": float((x_mine.grad - x_ref.grad[r]).abs().max()),
            "expert_grad_diff": expert_diff, "router_grad_diff": float((router - full.router.weight.grad).abs().max()),
            "stats": split.stats, "reference": full.stats}


def measure_all_to_all(ctx, sizes: list[int], repeats: int = 3, rounds: int = 20) -> list[list[dict]]:
    """Seconds of an even ``all_to_all_single`` in which each rank sends ``size`` bytes to every other
    rank: ``rounds`` independent measurements, each the fastest of ``repeats`` calls per size (the slowest
    rank's time), taken one round after another so that a burst of load on a busy machine spoils a few
    rounds, not every sample of one size. Each round is a set of points an alpha-beta model is fitted to;
    :func:`fit_rounds` fits them and says how often the fit holds."""
    group, ep = dist.group.WORLD, ctx.world_size
    sends = [torch.ones(ep * max(1, size // 4)) for size in sizes]
    recvs = [torch.empty_like(send) for send in sends]
    best = [[float("inf")] * len(sizes) for _ in range(rounds)]
    for r in range(rounds):
        for i, (send, recv) in enumerate(zip(sends, recvs)):
            for _ in range(repeats):
                dist.barrier(group=group)
                start = time.perf_counter()
                dist.all_to_all_single(recv, send, group=group)
                best[r][i] = min(best[r][i], time.perf_counter() - start)
    best = torch.tensor(best, dtype=torch.float64)
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)  # a call is as slow as its slowest rank
    return [[{"bytes_to_others": (ep - 1) * send.numel() // ep * 4, "seconds": float(best[r, i])}
             for i, send in enumerate(sends)] for r in range(rounds)]


def fit_rounds(rounds: list[list[dict]], margin: float = 0.4, confidence: float = 0.99, fit=fit_alpha_beta) -> dict:
    """Fit ``alpha + bytes / bandwidth`` to each round of :func:`measure_all_to_all` and ask how well each
    fit predicts that round's largest all-to-all: ``errors`` (|predicted / measured - 1| per round) and a
    sign test (:func:`ddpkit.timing.verdict`) of them against ``margin``: ``"below"`` when the model holds
    in more rounds than chance allows, ``"above"`` when it fails in more, ``"unclear"`` when this machine,
    at this load, cannot tell. Also the fit of the fastest time per size over every round (``link``,
    ``points``), the cleanest measurement there is. ``fit(nbytes, seconds)`` makes the model (another one
    is the negative control: a latency alone fails the same checks)."""
    from ddpkit import timing

    errors = []
    for points in rounds:
        model = fit([p["bytes_to_others"] for p in points], [p["seconds"] for p in points])
        errors.append(abs(model.seconds(points[-1]["bytes_to_others"]) / points[-1]["seconds"] - 1))
    best = [{"bytes_to_others": column[0]["bytes_to_others"], "seconds": min(p["seconds"] for p in column)}
            for column in zip(*rounds)]
    link = fit([p["bytes_to_others"] for p in best], [p["seconds"] for p in best])
    return {"verdict": timing.verdict(errors, margin, confidence), "errors": errors, "margin": margin,
            "points": best, "link": link}


def check_all_to_all_against_torch(ctx, d_model: int = 3) -> dict:
    """Our :class:`AllToAll` and ``torch.distributed.nn.functional.all_to_all_single`` on the same uneven
    splits (rank r sends r + j + 1 rows to rank j): outputs and input gradients, bitwise."""
    import warnings

    from torch.distributed.nn.functional import all_to_all_single

    group, ep, r = dist.group.WORLD, ctx.world_size, ctx.rank
    send_splits = [r + j + 1 for j in range(ep)]
    recv_splits = [j + r + 1 for j in range(ep)]  # what rank j sends to me
    rows = torch.randn(sum(send_splits), d_model, generator=torch.Generator().manual_seed(r))
    ours_in, theirs_in = rows.clone().requires_grad_(True), rows.clone().requires_grad_(True)
    ours = AllToAll.apply(ours_in, recv_splits, send_splits, group)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in newer torch, still there
        theirs = all_to_all_single(rows.new_empty(sum(recv_splits), d_model), theirs_in, recv_splits, send_splits, group)
    weights = torch.arange(ours.numel(), dtype=rows.dtype).view_as(ours)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    return {"output_equal": torch.equal(ours, theirs), "grad_equal": torch.equal(ours_in.grad, theirs_in.grad)}
