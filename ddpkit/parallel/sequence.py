"""Megatron sequence parallelism: tensor parallelism's all-reduce split in two, around LayerNorm.

Tensor parallelism (``tensor.py``) splits the matrices of a block, but not what sits between its two
column/row pairs: the LayerNorms (and, in models that have it, dropout) run on the whole (B, T, C)
activation, identically on every tp rank, and every rank **stores** their inputs for backward.
Korthikanti et al., 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198) notice that these operations are independent along the sequence, so each tp rank
can run them on its own T/t positions, and that an all-reduce is a reduce-scatter followed by an
all-gather. So they replace Megatron's ``f`` and ``g`` by

* ``g`` (before a column-parallel layer): **all-gather** the sequence shards into the whole sequence
  in forward, **reduce-scatter** the input gradient in backward (:class:`GatherLinear`);
* ``g-bar`` (after a row-parallel layer): **reduce-scatter** the partial sums, so that each rank gets
  the summed output of its own T/t positions only, and **all-gather** in backward
  (:class:`ReduceScatterToSequence`).

Between the pairs the residual stream stays split along the sequence: each rank holds, and saves for
backward, 1/t of the LayerNorm inputs and outputs. The forward moves the same bytes as tensor
parallelism (an all-reduce of M costs 2(t-1)/t x M per rank, a reduce-scatter plus an all-gather
(t-1)/t x M each). As in the paper, the column layer keeps only its input shard and all-gathers it
again in backward to form the weight gradient, one more all-gather per column layer in backward: that
is what makes *every* stored activation 1/t.

Activation bytes per block (s positions, b sequences, h width, a heads), counted the paper's way:

* whole block: ``sbh (34 + 5as/h)`` in the paper (2-byte activations, 1-byte dropout masks, the s x s
  softmax stored). Here, fp32 (4 bytes), no dropout, and PyTorch's fused CPU attention kernel (a
  FlashAttention-style kernel that keeps the softmax's log-sum-exp, ``a s b`` values, instead of the
  s x s matrix), the same 16 activations of size sbh remain: ``4 sbh x 16 + 4 sb (4 + a)`` bytes (the
  4 sb are the two LayerNorms' mean and 1/std);
* tensor parallel: ``sbh (10 + 24/t + 5as/(ht))`` in the paper; here ``4 sbh (4 + 12/t) + 4 sb (4 + a/t)``:
  the LayerNorm inputs (2) and the inputs of the two column-parallel layers (2) are replicated;
* tensor + sequence parallel: ``sbh/t (34 + 5as/h)``; here everything divided by t.

:func:`activation_formula` gives these three numbers and the notebook checks them against bytes
measured with ``saved_tensors_hooks``. Parameters that act on the split sequence but are replicated
(LayerNorm weights, row-parallel biases) get only their shard's gradient on each rank: they carry
``sequence_parallel = True`` (Megatron's attribute name) and :func:`sync_sequence_parallel_grads`
sums their gradients over the tp group, as Megatron does before the optimizer step.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.models import TinyGPT
from ddpkit.parallel.comm import BUS_FACTOR, all_gather_into_tensor, reduce_scatter_tensor
from ddpkit.parallel.tensor import TensorParallelLinear, check_divisible

CALLS: Counter = Counter()  # ("forward"|"backward", "all_gather"|"reduce_scatter"|"all_reduce") -> calls
BYTES: Counter = Counter()  # the same keys -> bytes each rank put on the wire (nccl-tests' bus factors)


def _count(direction: str, op: str, nbytes: int, group) -> None:
    CALLS[direction, op] += 1
    BYTES[direction, op] += int(BUS_FACTOR[op](dist.get_world_size(group)) * nbytes)


def gather_sequence(x: torch.Tensor, group, direction: str = "forward") -> torch.Tensor:
    """(B, T/t, C) shards -> (B, T, C), rank r's shard at positions [r T/t, (r+1) T/t) (collective)."""
    t = dist.get_world_size(group)
    local = x.detach().transpose(0, 1).contiguous()  # (T/t, B, C): collectives concatenate along dim 0
    out = torch.empty((t * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into_tensor(out, local, group)
    _count(direction, "all_gather", out.numel() * out.element_size(), group)
    return out.transpose(0, 1)  # (B, T, C)


def reduce_scatter_sequence(x: torch.Tensor, group, direction: str = "forward") -> torch.Tensor:
    """(B, T, C) partial sums on every rank -> this rank's (B, T/t, C) positions, summed over ranks."""
    t = dist.get_world_size(group)
    whole = x.detach().transpose(0, 1).contiguous()  # (T, B, C)
    out = torch.empty((whole.shape[0] // t, *whole.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, whole, group)
    _count(direction, "reduce_scatter", whole.numel() * whole.element_size(), group)
    return out.transpose(0, 1)  # (B, T/t, C)


def sequence_shard(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's T/t positions of a (B, T, C) tensor that every rank holds whole."""
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)]


class ScatterToSequence(torch.autograd.Function):
    """Enter the split region: forward keeps this rank's positions (no communication); backward
    all-gathers the gradient, since every rank's replicated input fed all the shards."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return sequence_shard(x, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.group, "backward").contiguous(), None


class GatherFromSequence(torch.autograd.Function):
    """Leave the split region into replicated computation (the final norm and head, the same on every
    rank): all-gather in forward; backward keeps this rank's positions of the (identical) gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_sequence(x, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return sequence_shard(grad, ctx.group).contiguous(), None


class ReduceScatterToSequence(torch.autograd.Function):
    """The paper's ``g-bar``, after a row-parallel layer: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.group, "backward").contiguous(), None


class GatherLinear(torch.autograd.Function):
    """The paper's ``g`` fused with the column-parallel matmul: all-gather the sequence shards, then
    ``y = x W^T + b``. Saves only the shard; backward all-gathers it again for ``dW`` and reduce-scatters
    ``dx`` (each rank's ``dx`` covers the whole sequence but only its own output features)."""

    @staticmethod
    def forward(ctx, shard, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(shard, weight)
        return F.linear(gather_sequence(shard, group), weight, bias)  # (B, T, out/t)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        whole = gather_sequence(shard, ctx.group, "backward")  # (B, T, in): the extra all-gather
        grad_input = reduce_scatter_sequence(grad.matmul(weight), ctx.group, "backward")  # (B, T/t, in)
        grad_weight = grad.flatten(0, -2).t().matmul(whole.flatten(0, -2))  # (out/t, in)
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


class SequenceParallelLinear(TensorParallelLinear):
    """A tensor-parallel linear layer whose activations outside the pair are split along the sequence:
    ``column`` takes (B, T/t, in) shards and gives (B, T, out/t); ``row`` takes (B, T, in/t) and gives
    (B, T/t, out). Same parameters, names and slicing as :class:`~ddpkit.parallel.tensor.TensorParallelLinear`."""

    def __init__(self, full: nn.Linear, style: str, group, blocks: int = 1) -> None:
        super().__init__(full, style, group, blocks)
        if style == "row" and self.bias is not None:
            self.bias.sequence_parallel = True  # added to each rank's positions only: its gradient is partial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "column":
            return GatherLinear.apply(x, self.weight, self.bias, self.group)
        y = ReduceScatterToSequence.apply(F.linear(x, self.weight), self.group)  # (B, T/t, out)
        return y if self.bias is None else y + self.bias


class SequenceParallelAttention(nn.Module):
    """Causal self-attention, heads split over the tp group, its input and output split along the sequence."""

    def __init__(self, full, group) -> None:
        super().__init__()
        self.local_heads = full.n_heads // dist.get_world_size(group)
        self.qkv = SequenceParallelLinear(full.qkv, "column", group, blocks=3)
        self.proj = SequenceParallelLinear(full.proj, "row", group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3C/t): the whole sequence, this rank's heads
        B, T, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=2)  # 3 x (B, T, C/t)
        hs = q.shape[-1] // self.local_heads
        q, k, v = (t.view(B, T, self.local_heads, hs).transpose(1, 2) for t in (q, k, v))  # (B, h/t, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h/t, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T/t, C)


class SequenceParallelMLP(nn.Sequential):
    """Up-projection column-parallel (gathering the sequence), GELU, down-projection row-parallel (scattering it)."""

    def __init__(self, full: nn.Sequential, group) -> None:
        super().__init__(SequenceParallelLinear(full[0], "column", group), nn.GELU(),
                         SequenceParallelLinear(full[2], "row", group))


def parallelize_sequence(model: nn.Module, group) -> nn.Module:
    """Tensor + sequence parallelism for a :class:`~ddpkit.models.TinyGPT`, in place: every block's
    attention and MLP split as in ``tensor.parallelize``, the residual stream between them split along
    the sequence. The embeddings' output is split on entry to the first block and gathered again before
    the final norm (forward pre-hooks), so the model still maps (B, T) tokens to (B, T, V) logits,
    the same on every tp rank. After backward, call :func:`sync_sequence_parallel_grads`."""
    if not isinstance(model, TinyGPT):
        raise ValueError("sequence parallelism splits the GPT's blocks: use --model gpt")
    t = dist.get_world_size(group)
    check_divisible(model, t)
    for block in model.blocks:
        block.attn = SequenceParallelAttention(block.attn, group)
        block.mlp = SequenceParallelMLP(block.mlp, group)
        for p in (*block.ln1.parameters(), *block.ln2.parameters()):
            p.sequence_parallel = True

    def enter(module, args):
        if args[0].shape[1] % t:
            raise ValueError(f"sequence parallelism over {t} ranks needs a sequence length divisible by {t}, "
                             f"got {args[0].shape[1]}")
        return (ScatterToSequence.apply(args[0], group),)

    model.blocks[0].register_forward_pre_hook(enter)
    model.ln_f.register_forward_pre_hook(lambda module, args: (GatherFromSequence.apply(args[0], group),))
    return model


def sync_sequence_parallel_grads(model: nn.Module, group) -> int:
    """Sum over the tp group the gradients of the replicated parameters that saw only this rank's
    positions (one flat all-reduce). Returns how many parameters it synchronised."""
    params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if params:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        _count("backward", "all_reduce", flat.numel() * flat.element_size(), group)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p.grad))
    return len(params)


def activation_formula(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none", nbytes: int = 4) -> int:
    """Bytes one block of the kit's GPT saves for backward on one rank (see the module docstring):
    ``mode`` is ``none`` (the whole block), ``tp`` (tensor parallel over t) or ``sp`` (tensor + sequence
    parallel over t). ``nbytes`` per value (4 for fp32)."""
    if mode == "none" or t == 1:
        return nbytes * (16 * s * b * h + (4 + a) * s * b)
    if mode == "tp":
        return nbytes * (4 * s * b * h + 12 * s * b * h // t + 4 * s * b + a * s * b // t)
    if mode == "sp":
        return nbytes * (16 * s * b * h + (4 + a) * s * b) // t
    raise ValueError(f"mode must be none, tp or sp, got {mode!r}")


def paper_formula(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none") -> float:
    """The paper's bytes per layer (2-byte activations, 1-byte dropout masks, the s x s softmax stored)."""
    if mode == "none" or t == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if mode == "tp":
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    if mode == "sp":
        return s * b * h / t * (34 + 5 * a * s / h)
    raise ValueError(f"mode must be none, tp or sp, got {mode!r}")

