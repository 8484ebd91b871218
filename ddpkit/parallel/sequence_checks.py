"""Megatron sequence parallelism on real ranks, checked and measured: functions for ``ddpkit.launch``
(notebook 17, tests).

* :func:`check_against_unsplit`: the tensor + sequence parallel GPT against the whole GPT, and the
  collectives one step issues;
* :func:`measure_block`: the bytes one block keeps for backward on a rank, whole, tensor parallel and
  tensor + sequence parallel, against :func:`~ddpkit.parallel.sequence.activation_formula`;
* :func:`check_against_dtensor`: ours against DTensor's ``SequenceParallel`` and its input/output layouts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.parallel.sequence import (
    BYTES,
    CALLS,
    SequenceParallelAttention,
    SequenceParallelMLP,
    activation_formula,
    paper_formula,
    parallelize_sequence,
    sequence_shard,
    sync_sequence_parallel_grads,
)


def check_against_unsplit(ctx, cfg, batch: int = 4, sync: bool = True) -> dict:
    """The tp + sp GPT (split over the world) and the whole GPT on the same tokens (a function for
    ``ddpkit.launch``): largest output and gradient differences (``sync=False`` skips the gradient sum of
    the sequence-parallel parameters: the negative control), and the collectives of one forward and one
    backward against plain tensor parallelism's."""
    from ddpkit.models import build_model, loss_fn
    from ddpkit.parallel import tensor

    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    whole = build_model(cfg)
    out_whole = whole(tokens)
    loss_fn(out_whole, tokens).backward()
    split = parallelize_sequence(build_model(cfg), dist.group.WORLD)
    CALLS.clear(), BYTES.clear()
    out_split = split(tokens)
    loss_fn(out_split, tokens).backward()
    if sync:
        sync_sequence_parallel_grads(split, dist.group.WORLD)
    calls, nbytes = dict(CALLS), dict(BYTES)
    grads = tensor.full_state(split, {n: p.grad for n, p in split.named_parameters()})
    diffs = {n: float((grads[n] - p.grad).abs().max()) for n, p in whole.named_parameters()}
    return {"output_diff": float((out_split - out_whole).abs().max()), "grad_diff": max(diffs.values()),
            "worst_param": max(diffs, key=diffs.get),
            "calls": {f"{d} {op}": n for (d, op), n in calls.items()},
            "bytes": {f"{d} {op}": n for (d, op), n in nbytes.items()}}


def measure_block(ctx, batch: int, seq_len: int, d_model: int, n_heads: int) -> dict:
    """Bytes one transformer block saves for backward on this rank, whole, tensor parallel and tensor +
    sequence parallel over the world (a function for ``ddpkit.launch``), with the formula for each."""
    from ddpkit.models import Block
    from ddpkit.parallel import tensor
    from ddpkit.parallel.memory import activation_bytes

    torch.manual_seed(0)
    group, t = dist.group.WORLD, ctx.world_size
    x = torch.randn(batch, seq_len, d_model)
    out = {}
    for mode in ("none", "tp", "sp"):
        block = Block(d_model, n_heads)
        if mode == "tp":
            block.attn, block.mlp = tensor.ParallelSelfAttention(block.attn, group), tensor.ParallelMLP(block.mlp, group)
        if mode == "sp":
            block.attn, block.mlp = SequenceParallelAttention(block.attn, group), SequenceParallelMLP(block.mlp, group)
        inputs = (sequence_shard(x, group) if mode == "sp" else x).clone().requires_grad_(True)
        out[mode] = {"measured": activation_bytes(block, inputs),
                     "formula": activation_formula(seq_len, batch, d_model, n_heads, t, mode),
                     "paper_fp16": paper_formula(seq_len, batch, d_model, n_heads, t, mode)}
    return out


class _NormMLP(nn.Module):
    """The second half of a block, ``x + mlp(ln(x))``: what PyTorch's sequence-parallel example splits."""

    def __init__(self, ln: nn.LayerNorm, mlp: nn.Module) -> None:
        super().__init__()
        self.ln, self.mlp = ln, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


def check_against_dtensor(ctx, batch: int = 2, seq_len: int = 16, d_model: int = 32) -> dict:
    """Ours and PyTorch's own, ``SequenceParallel`` on the LayerNorm, ``ColwiseParallel(input_layouts=
    Shard(1))`` and ``RowwiseParallel(output_layouts=Shard(1))`` on the MLP, on the same sequence shard
    (a function for ``ddpkit.launch``): output, input-gradient and parameter-gradient differences, and
    the placement DTensor gives the LayerNorm's gradient before any sum."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor import Shard
    except ImportError:  # torch before 2.5 keeps it private
        from torch.distributed._tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from ddpkit.models import Block
    from ddpkit.parallel import tensor

    torch.manual_seed(0)
    group = dist.group.WORLD
    full = Block(d_model, 4)
    ours = _NormMLP(full.ln2, SequenceParallelMLP(full.mlp, group))
    for p in ours.ln.parameters():
        p.sequence_parallel = True
    theirs = _NormMLP(Block(d_model, 4).ln2, Block(d_model, 4).mlp)
    theirs.load_state_dict({"ln." + k: v for k, v in full.ln2.state_dict().items()}
                           | {"mlp." + k: v for k, v in full.mlp.state_dict().items()})
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    parallelize_module(theirs.ln, mesh, SequenceParallel())
    parallelize_module(theirs.mlp[0], mesh, ColwiseParallel(input_layouts=Shard(1)))
    parallelize_module(theirs.mlp[2], mesh, RowwiseParallel(output_layouts=Shard(1)))
    shard = sequence_shard(torch.randn(batch, seq_len, d_model), group)
    x_ours, x_theirs = shard.clone().requires_grad_(True), shard.clone().requires_grad_(True)
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    y_ours.pow(2).mean().backward()
    y_theirs.pow(2).mean().backward()
    placement = type(theirs.ln.weight.grad.placements[0]).__name__  # Partial: a sum still owed
    sync_sequence_parallel_grads(ours, group)
    mine = tensor.full_state(ours, {n: p.grad for n, p in ours.named_parameters()})
    grads = {n: p.grad.full_tensor() for n, p in theirs.named_parameters()}  # Partial -> summed
    return {"output_diff": float((y_ours - y_theirs).detach().abs().max()),
            "input_grad_diff": float((x_ours.grad - x_theirs.grad).abs().max()),
            "grad_diff": max(float((mine[n] - g).abs().max()) for n, g in grads.items()),
            "ln_grad_placement": placement}
