"""Mixture of experts: a router sends each token to k of E expert MLPs, within a capacity.

A dense transformer block runs every token through the same MLP. A mixture-of-experts (MoE) layer
holds E MLPs (the **experts**) and a **router**, a linear map from the token to E logits; each token
goes to the k experts with the highest router probability and its output is their outputs weighted by
the **gates** (Shazeer et al., 2017; GShard, Lepikhin et al., 2020, arXiv 2006.16668; Switch
Transformer, Fedus et al., 2021, arXiv 2101.03961). Parameters grow E-fold; compute per token grows
only k-fold.

* **Gates.** Switch (k = 1) weights the expert's output by its router probability; with k > 1 the k
  probabilities are renormalised to sum to 1 (GShard's top-2 gating, Mixtral).
* **Capacity.** To give every expert a fixed-size batch (a static shape, and a bounded all-to-all),
  each expert takes at most ``capacity = ceil(capacity_factor x k x tokens / E)`` assignments per
  group of tokens (Switch's "tokens per batch / experts x capacity factor" for k = 1; GShard splits the
  batch into groups and applies the capacity per group). Assignments are served in priority order, all
  first choices before any second choice, then by position (GShard's top-2 gating); the rest are
  **dropped**: the token skips that expert (the residual connection carries it on).
* **Load-balancing loss.** Without help the router collapses onto a few experts. Switch's auxiliary
  loss is ``E x sum_e f_e P_e``: ``f_e`` the fraction of the group's tokens whose first choice is e
  (counted before drops, as GShard's ``density_1``), ``P_e`` the mean router probability of e. It is 1
  when routing is uniform and grows with imbalance; only ``P_e`` carries a gradient. Averaged over
  groups and multiplied by ``aux_coef`` (Switch: 1e-2), it is added to the gradient by
  :class:`AddAuxiliaryLoss` (the trick of DeepSeek-V2's released model code): the layer stays a
  drop-in for the GPT's MLP, and the training loss the kit reports stays the language-model loss.

:class:`MoE` computes every expert in one process. ``expert_parallel.py`` puts the experts on
different ranks and moves the tokens with all-to-all; it is checked against this layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class AddAuxiliaryLoss(torch.autograd.Function):
    """Forward returns ``x`` unchanged; backward also sends a gradient of 1 into ``loss``: as if the
    scalar had been added to whatever loss ``x`` flows into."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_dtype = loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device)


def expert_capacity(tokens: int, experts: int, k: int, capacity_factor: float | None) -> int:
    """Assignments one expert takes per group (``None``: every assignment, nothing dropped)."""
    if capacity_factor is None:
        return tokens * k
    return math.ceil(capacity_factor * k * tokens / experts)


@dataclass
class Routing:
    """Where a group of N tokens goes. Assignments are in priority order: all first choices (token 0..N-1),
    then all second choices, ..."""

    expert: torch.Tensor
    """(N k,) the expert of each assignment."""
    token: torch.Tensor
    """(N k,) the token of each assignment."""
    gate: torch.Tensor
    """(N k,) its weight in the token's output (differentiable)."""
    kept: torch.Tensor
    """(N k,) False for an assignment dropped because its expert was full."""
    capacity: int
    aux_loss: torch.Tensor
    """The load-balancing loss, averaged over groups (differentiable)."""
    routed: torch.Tensor
    """(E,) assignments per expert before drops."""

    def order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept assignments sorted by expert (stable: priority order within an expert), and how many each
        expert got: the layout of the tokens handed to the experts, and of an all-to-all's send buffer."""
        kept = self.kept.nonzero().squeeze(1)
        order = kept[torch.argsort(self.expert[kept], stable=True)]
        return order, torch.bincount(self.expert[order], minlength=self.routed.numel())


def route(x: torch.Tensor, router: torch.Tensor, k: int, capacity_factor: float | None,
          groups: int = 1, drop: bool = True) -> Routing:
    """Route (N, C) tokens with router weight (E, C): top-k, gates, capacity per group (the tokens cut
    into ``groups`` equal consecutive groups), the auxiliary loss. ``drop=False`` ignores the capacity
    (the negative control)."""
    n, experts = x.shape[0], router.shape[0]
    probs = torch.softmax(x @ router.t(), dim=-1)  # (N, E)
    top_p, top_e = probs.topk(k, dim=-1)  # (N, k)
    gates = top_p / top_p.sum(-1, keepdim=True) if k > 1 else top_p
    expert = top_e.t().reshape(-1)  # choice-major: every first choice, then every second, ...
    token = torch.arange(n, device=x.device).repeat(k)
    size = n // groups
    cap = expert_capacity(size, experts, k, capacity_factor)
    group = token // size
    kept = torch.ones_like(expert, dtype=torch.bool)
    aux = x.new_zeros(())
    for g in range(groups):
        mine = (group == g).nonzero().squeeze(1)  # this group's assignments, still in priority order
        onehot = F.one_hot(expert[mine], experts)  # (M, E)
        position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place in its expert's queue
        if drop:
            kept[mine] = position < cap
        first = F.one_hot(top_e[g * size:(g + 1) * size, 0], experts).float().mean(0)  # f_e
        aux = aux + experts * (first * probs[g * size:(g + 1) * size].mean(0)).sum()  # E sum f_e P_e
    return Routing(expert, token, gates.t().reshape(-1), kept, cap, aux / groups,
                   torch.bincount(expert, minlength=experts))


class Experts(nn.Module):
    """E two-layer GELU MLPs (the GPT's MLP shape), their weights stacked: ``w1`` (E, C, H), ``b1`` (E, H),
    ``w2`` (E, H, C), ``b2`` (E, C). An expert-parallel rank holds a slice along the first dimension."""

    def __init__(self, num_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, d_model, hidden) * 0.02)
        self.b1 = nn.Parameter(torch.zeros(num_experts, hidden))
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, d_model) * 0.02)
        self.b2 = nn.Parameter(torch.zeros(num_experts, d_model))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by (local) expert, ``counts[e]`` of them for expert e -> each through its expert.
        An expert with no rows still runs (on zero rows): the output stays part of the autograd graph
        even when every expert here is idle, so that under expert parallelism this rank's backward
        still joins the all-to-alls its peers call."""
        outs = [F.gelu(part @ self.w1[e] + self.b1[e]) @ self.w2[e] + self.b2[e]
                for e, part in enumerate(rows.split(counts))]
        return torch.cat(outs)


class MoE(nn.Module):
    """A mixture-of-experts MLP: (B, T, C) -> (B, T, C), every expert in this process. ``groups``: the
    batch's tokens cut into that many groups, each with its own capacity (an expert-parallel run uses
    one group per rank). After each forward, :attr:`stats` holds tokens per expert and drops."""

    def __init__(self, d_model: int, num_experts: int = 4, k: int = 2, capacity_factor: float | None = 1.25,
                 aux_coef: float = 1e-2, hidden: int | None = None, groups: int = 1) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"top-k must be between 1 and the number of experts ({num_experts}), got {k}")
        self.k, self.capacity_factor, self.aux_coef, self.groups = k, capacity_factor, aux_coef, groups
        self.router = nn.Linear(d_model, num_experts, bias=False)
        nn.init.normal_(self.router.weight, std=0.02)
        self.experts = Experts(num_experts, d_model, hidden or 4 * d_model)
        self.stats: dict = {}
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, C)
        routing = route(flat, self.router.weight, self.k, self.capacity_factor, self.groups)
        order, counts = routing.order()
        out = self.experts(flat[routing.token[order]], counts.tolist()) * routing.gate[order].unsqueeze(1)
        y = torch.zeros_like(flat).index_add(0, routing.token[order], out)  # (N, C): weighted sum per token
        self.record(routing, counts)
        if self.aux_coef and torch.is_grad_enabled():
            y = AddAuxiliaryLoss.apply(y, self.aux_coef * routing.aux_loss)
        return y.view_as(x)

    def record(self, routing: Routing, kept_per_expert: torch.Tensor) -> None:
        self.aux_loss = routing.aux_loss.detach()
        self.stats = {"routed": routing.routed.tolist(), "kept": kept_per_expert.tolist(),
                      "dropped": int((~routing.kept).sum()), "capacity": routing.capacity,
                      "aux_loss": float(routing.aux_loss.detach())}


def moe_gpt(model: nn.Module, num_experts: int = 4, k: int = 2, capacity_factor: float | None = 1.25,
            aux_coef: float = 1e-2, seed: int = 0) -> nn.Module:
    """Replace every block's MLP of a :class:`~ddpkit.models.TinyGPT` by a :class:`MoE`, in place,
    initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    for block in model.blocks:
        d_model = block.mlp[0].in_features
        block.mlp = MoE(d_model, num_experts, k, capacity_factor, aux_coef, hidden=block.mlp[0].out_features)
    return model


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
