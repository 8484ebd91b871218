"""Tensor parallelism from scratch: split each layer's matrices across the ranks of the tp group.

A linear layer ``y = x W^T + b`` with ``W`` of shape (out, in) splits two ways (Shoeybi et al., 2019,
"Megatron-LM"):

* **column-parallel**: each rank keeps ``out/tp`` rows of ``W`` (output features); with the whole ``x``
  it computes its slice of ``y``. No communication in forward. In backward each rank's ``dL/dx`` is only
  the part that flowed through its slice, so the ranks' contributions must be **summed**;
* **row-parallel**: each rank keeps ``in/tp`` columns of ``W``; given its slice of ``x`` it computes a
  partial ``y`` that must be **summed** over ranks (then ``b`` is added once).

A column-parallel layer followed by a row-parallel one (an MLP: up-projection, GELU, down-projection;
attention: q/k/v per head, then the output projection) needs no communication in between, because
the column layer's output slice is exactly the row layer's input slice. So each pair costs **one
all-reduce in forward and one in backward**, done by two conjugate functions named after the paper:

* ``f`` (:class:`CopyToTP`): identity in forward, all-reduce of the gradient in backward; before the pair;
* ``g`` (:class:`ReduceFromTP`): all-reduce in forward, identity in backward; after it.

A transformer block has two such pairs (attention and MLP): 2 all-reduces per block in forward and 2 in
backward, every one of the full activation (B, T, C): which is why tensor parallelism stays inside a
node, on its fastest links. Parameters keep the unsplit model's names (``blocks.0.mlp.0.weight``), so
:meth:`TensorParallelLinear.to_full` and :meth:`TensorParallelLinear.to_local` move state between this
layout and the unsplit one: a checkpoint does not depend on the tp degree.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.models import TinyGPT
from ddpkit.parallel.comm import all_gather_into_tensor

CALLS: Counter = Counter()  # all-reduces issued by f and g, by direction: what notebook 12 counts


class CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: forward is the identity; backward all-reduces the gradient over the tp group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may share the incoming buffer
        dist.all_reduce(grad, group=ctx.group)
        CALLS["backward"] += 1
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: forward all-reduces (sums the partial outputs); backward is the identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        CALLS["forward"] += 1
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather(local: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The whole tensor from every tp rank's slice along ``dim`` (collective)."""
    size = dist.get_world_size(group)
    moved = local.detach().movedim(dim, 0).contiguous()
    out = torch.empty((size * moved.shape[0], *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    all_gather_into_tensor(out, moved, group)
    return out.movedim(0, dim)


class TensorParallelLinear(nn.Module):
    """A slice of an ``nn.Linear``: ``column`` keeps a block of output rows, ``row`` a block of input
    columns. ``blocks`` > 1 splits each of that many equal parts separately (a fused q/k/v weight: each
    rank keeps its heads' rows of q, of k and of v)."""

    def __init__(self, full: nn.Linear, style: str, group, blocks: int = 1) -> None:
        super().__init__()
        if style not in ("column", "row"):
            raise ValueError(f"style must be column or row, got {style!r}")
        self.style, self.group, self.blocks = style, group, blocks
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.weight = nn.Parameter(self.to_local("weight", full.weight.detach()).clone())
        self.bias = None if full.bias is None else nn.Parameter(self.to_local("bias", full.bias.detach()).clone())

    def _dim(self, name: str) -> int | None:
        """The dimension along which a parameter is split (None: replicated, the row layer's bias)."""
        if self.style == "column":
            return 0
        return 1 if name == "weight" else None

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the unsplit parameter (or of its optimizer moment)."""
        dim = self._dim(name)
        if dim is None:
            return full
        parts = full.chunk(self.blocks, dim)  # q, k, v when blocks = 3
        return torch.cat([p.chunk(self.tp, dim)[self.rank] for p in parts], dim)

    def to_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The unsplit parameter from every rank's slice (collective over the tp group)."""
        dim = self._dim(name)
        if dim is None:
            return local.detach()
        gathered = _gather(local, dim, self.group).chunk(self.tp, dim)  # rank r's [q_r, k_r, v_r]
        per_rank = [g.chunk(self.blocks, dim) for g in gathered]
        return torch.cat([torch.cat([r[b] for r in per_rank], dim) for b in range(self.blocks)], dim)

    def chunked(self, name: str, local: torch.Tensor):
        """``local`` (this rank's slice of a parameter, or of its optimizer moment) as the chunks of the
        unsplit tensor it covers: one block of rows or columns, or ``blocks`` of them (no copy)."""
        from ddpkit.parallel.chunks import Chunked

        dim = self._dim(name)
        if dim is None:
            return local  # replicated
        shape = list(local.shape)
        shape[dim] *= self.tp
        block, part = shape[dim] // self.blocks, local.shape[dim] // self.blocks  # q, k, v; this rank's part of each
        pieces = []
        for b in range(self.blocks):
            offsets = [0] * local.dim()
            offsets[dim] = b * block + self.rank * part
            pieces.append((tuple(offsets), local.narrow(dim, b * part, part)))
        return Chunked(shape, pieces, local.dtype, local.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "column":
            return F.linear(CopyToTP.apply(x, self.group), self.weight, self.bias)  # (..., out/tp)
        y = ReduceFromTP.apply(F.linear(x, self.weight), self.group)  # partial sums -> the whole output
        return y if self.bias is None else y + self.bias


class ParallelSelfAttention(nn.Module):
    """Causal self-attention with the heads split over the tp group: q/k/v column-parallel (each rank
    its heads), attention local to the rank, the output projection row-parallel."""

    def __init__(self, full, group) -> None:
        super().__init__()
        tp = dist.get_world_size(group)
        self.local_heads = full.n_heads // tp
        self.qkv = TensorParallelLinear(full.qkv, "column", group, blocks=3)
        self.proj = TensorParallelLinear(full.proj, "row", group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)  # 3 x (B, T, C/tp): this rank's heads
        hs = q.shape[-1] // self.local_heads
        q, k, v = (t.view(B, T, self.local_heads, hs).transpose(1, 2) for t in (q, k, v))  # (B, h/tp, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h/tp, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C): summed over ranks


class ParallelMLP(nn.Sequential):
    """Up-projection column-parallel, GELU on the slice, down-projection row-parallel."""

    def __init__(self, full: nn.Sequential, group) -> None:
        super().__init__(TensorParallelLinear(full[0], "column", group), nn.GELU(),
                         TensorParallelLinear(full[2], "row", group))


def check_divisible(model: TinyGPT, tp: int) -> None:
    """Refuse a degree that does not split the heads and the widths evenly."""
    attn = model.blocks[0].attn
    width = model.blocks[0].mlp[0].out_features
    if attn.n_heads % tp or width % tp:
        raise ValueError(f"tp {tp} must divide the heads ({attn.n_heads}) and the MLP width ({width})")


def parallelize(model: nn.Module, group, parts: tuple[str, ...] = ("attn", "mlp")) -> nn.Module:
    """Split every transformer block of a :class:`~ddpkit.models.TinyGPT` in place (its attention and its
    MLP, or only the ``parts`` named); embeddings, norms and the head stay whole (replicated on every tp
    rank). The model must hold the same weights on every rank (it does: built from the seed)."""
    if not isinstance(model, TinyGPT):
        raise ValueError("tensor parallelism splits the GPT's attention heads and MLP: use --model gpt")
    check_divisible(model, dist.get_world_size(group))
    for block in model.blocks:
        if "attn" in parts:
            block.attn = ParallelSelfAttention(block.attn, group)
        if "mlp" in parts:
            block.mlp = ParallelMLP(block.mlp, group)
    return model


def split_modules(model: nn.Module) -> dict[str, TensorParallelLinear]:
    """The split layers by name (``blocks.0.mlp.0``)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, TensorParallelLinear)}


def full_state(model: nn.Module, per_param: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors keyed by parameter name, in this rank's layout -> the unsplit layout (collective)."""
    split = split_modules(model)
    out = {}
    for name, tensor in per_param.items():
        owner, _, leaf = name.rpartition(".")
        out[name] = split[owner].to_full(leaf, tensor) if owner in split else tensor.detach()
    return out


def chunked_state(model: nn.Module, per_param: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors keyed by parameter name, in this rank's layout -> the same memory described as chunks of
    the unsplit tensors (``chunks.py``): what a dcp checkpoint writes and fills, with no gather."""
    split = split_modules(model)
    out = {}
    for name, tensor in per_param.items():
        owner, _, leaf = name.rpartition(".")
        out[name] = split[owner].chunked(leaf, tensor) if owner in split else tensor
    return out


def local_state(model: nn.Module, per_param: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors keyed by parameter name, in the unsplit layout -> this rank's slices."""
    split = split_modules(model)
    out = {}
    for name, tensor in per_param.items():
        owner, _, leaf = name.rpartition(".")
        out[name] = split[owner].to_local(leaf, tensor) if owner in split else tensor
    return out


def grad_norm_squared(model: nn.Module, group) -> torch.Tensor:
    """The unsplit model's squared gradient norm: split parameters' parts summed over the tp group,
    replicated ones counted once."""
    split_ids = {id(p) for m in split_modules(model).values() for n, p in m.named_parameters() if m._dim(n) is not None}
    device = next(p.grad.device for p in model.parameters() if p.grad is not None)  # NCCL reduces on the GPU
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for p in model.parameters():
        if p.grad is not None:
            value = p.grad.detach().double().pow(2).sum()
            if id(p) in split_ids:
                sharded += value
            else:
                replicated += value
    dist.all_reduce(sharded, group=group)
    return sharded + replicated


# --------------------------------------------------------------------------- checks a notebook and the tests run on real ranks

def split_linear_demo(ctx, out_features: int = 6, in_features: int = 4) -> dict:
    """One ``nn.Linear`` split by columns and by rows over the world (a function for ``ddpkit.launch``):
    which rank holds which weight element, and the split layer's output and input gradient against the
    whole layer's."""
    torch.manual_seed(0)
    full = nn.Linear(in_features, out_features).to(ctx.device)
    x = torch.randn(3, in_features).to(ctx.device).requires_grad_(True)
    full(x).sum().backward()
    out = {}
    for style in ("column", "row"):
        layer = TensorParallelLinear(full, style, dist.group.WORLD)
        owner = layer.to_full("weight", torch.full_like(layer.weight, float(ctx.rank)))
        x_local = x.detach().clone().requires_grad_(True)
        # a row-parallel layer takes this rank's slice of the input features (what a column layer produced)
        inputs = x_local if style == "column" else x_local.chunk(ctx.world_size, 1)[ctx.rank]
        y = layer(inputs)
        y.sum().backward()
        grad = x_local.grad if style == "column" else _gather(x_local.grad.chunk(ctx.world_size, 1)[ctx.rank], 1, dist.group.WORLD)
        y_full = _gather(y.detach(), 1, dist.group.WORLD) if style == "column" else y.detach()  # column: slices of y
        out[style] = {"owner": owner.tolist(), "local_shape": list(layer.weight.shape),
                      "output_diff": float((y_full - full(x).detach()).abs().max()),
                      "input_grad_diff": float((grad - x.grad).abs().max())}
    return out


def check_against_unsplit(ctx, cfg, batch: int = 4) -> dict:
    """The tp GPT (split over the world) and the whole GPT on the same tokens (a function for
    ``ddpkit.launch``): largest output and gradient differences, and the all-reduces f and g issued in
    forward and in backward."""
    from ddpkit.models import build_model, loss_fn

    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len)).to(ctx.device)
    whole = build_model(cfg).to(ctx.device)
    out_whole = whole(tokens)
    loss_fn(out_whole, tokens).backward()
    split = parallelize(build_model(cfg).to(ctx.device), dist.group.WORLD)
    CALLS.clear()
    out_split = split(tokens)
    forward_calls = CALLS["forward"]
    loss_fn(out_split, tokens).backward()
    grads = full_state(split, {n: p.grad for n, p in split.named_parameters()})
    return {"output_diff": float((out_split - out_whole).abs().max()),
            "grad_diff": max(float((grads[n] - p.grad).abs().max()) for n, p in whole.named_parameters()),
            "forward_all_reduces": forward_calls, "backward_all_reduces": CALLS["backward"],
            "local_params": sum(p.numel() for p in split.parameters()),
            "whole_params": sum(p.numel() for p in whole.parameters())}


def check_against_dtensor(ctx, cfg, batch: int = 4) -> dict:
    """Our MLP split and PyTorch's own, DTensor ``ColwiseParallel`` / ``RowwiseParallel``, applied to the
    same GPT's MLPs (a function for ``ddpkit.launch``): output and gradient differences, and whether
    both keep the same local shapes. (Our fused q/k/v weight needs a per-head split that a plain
    ``ColwiseParallel`` would not make, so the attention is compared with the whole model instead.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from ddpkit.models import build_model, loss_fn

    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len)).to(ctx.device)
    ours = parallelize(build_model(cfg).to(ctx.device), dist.group.WORLD, parts=("mlp",))
    out_ours = ours(tokens)
    loss_fn(out_ours, tokens).backward()
    theirs = build_model(cfg).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in theirs.blocks:  # each layer directly: older torch resolves dotted plan keys differently
        parallelize_module(block.mlp[0], mesh, ColwiseParallel())
        parallelize_module(block.mlp[2], mesh, RowwiseParallel())
    out_theirs = theirs(tokens)
    loss_fn(out_theirs, tokens).backward()
    ours_grads = full_state(ours, {n: p.grad for n, p in ours.named_parameters()})
    theirs_grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in theirs.named_parameters()}
    local = {n: tuple(p.to_local().shape) for n, p in theirs.named_parameters() if hasattr(p, "to_local")}
    mine = dict(ours.named_parameters())
    return {"output_diff": float((out_ours - out_theirs).abs().max()),
            "grad_diff": max(float((ours_grads[n] - g).abs().max()) for n, g in theirs_grads.items()),
            "same_local_shapes": all(tuple(mine[n].shape) == shape for n, shape in local.items()),
            "dtensor_params": len(local)}
