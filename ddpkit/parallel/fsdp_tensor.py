"""Tensor parallelism inside FSDP2: each replica split over a tp group, every slice sharded over dp.

``world = dp x tp``. The GPT's blocks are split over this rank's tp group by the kit's own tensor
parallelism (:func:`~ddpkit.parallel.tensor.parallelize`: q/k/v and the MLP's up-projection by
output rows, the output projections by input columns); then ``fully_shard`` shards every tensor a
rank holds over the ``dp`` axis of the same ``(dp, tp)`` mesh. So a rank stores ``1/dp`` of its
``1/tp`` slice of every block matrix (and ``1/dp`` of the replicated embeddings, norms and head).
This is torchtitan's 2-D recipe (tensor parallel inside, FSDP2 across replicas); torchtitan splits
with DTensor's ``ColwiseParallel`` / ``RowwiseParallel`` (:func:`~ddpkit.parallel.fsdp_depth.run_tp_fsdp`
does so on a plain MLP). Here the split is the kit's own, because the GPT's fused q/k/v weight needs
a per-head split that ``ColwiseParallel`` does not make, and because the kit describes its slices in
the unsplit model's layout, which keeps checkpoints independent of the layout.

A step: FSDP2 all-gathers a block's slices over dp before its forward (and again in backward, unless
``reshard_after_forward`` is False), Megatron's ``f`` and ``g`` all-reduce activations over tp inside
it, and after its backward FSDP2 reduce-scatters the slices' gradients over dp (averaging the
replicas' gradients, as DDP's all-reduce does).

**State.** After ``fully_shard`` (and :func:`reshard`) each parameter is a ``DTensor`` on the dp mesh, ``Shard(0)`` of this
rank's tp slice: the local tensor is rows ``[start, stop)`` of the slice, ``torch.chunk``'s split
(``ceil(rows/dp)`` rows per dp rank, the last ones fewer or none). :func:`shard_chunks` describes
those rows as chunks of the *unsplit* tensor (:class:`~ddpkit.parallel.chunks.Chunked`), for the
parameter and for each of its AdamW moments, which have its layout. So a ``dcp`` checkpoint holds the
unsplit model's tensors, written chunk by chunk with nothing gathered, and resumes under any strategy
and layout (DDP, FSDP2 without tp, another tp degree); a ``full`` one gathers whole tensors to rank 0.

**Clipping.** The unsplit model's gradient norm: the squares of the split parameters' local
gradient shards summed over the whole world (each (dp, tp) rank holds a distinct piece), those of the
replicated ones over dp only (the tp peers hold the same piece).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.parallel.base import _param_names
from ddpkit.parallel.chunks import Chunked, adam_state
from ddpkit.parallel.fsdp import FSDPStrategy
from ddpkit.parallel.held_state import MOMENTS, HeldState, param_groups
from ddpkit.parallel.tensor import parallelize, split_modules


def local_rows(tensor: torch.Tensor, dp: int, dp_rank: int) -> tuple[torch.Tensor, int]:
    """``(local shard, first row)`` of a ``Shard(0)`` DTensor over ``dp`` ranks (a plain tensor: itself, 0)."""
    if not hasattr(tensor, "to_local"):
        return tensor, 0
    rows = tensor.shape[0]
    per_rank = -(-rows // dp)  # torch.chunk's split: ceil(rows / dp)
    return tensor.to_local(), min(dp_rank * per_rank, rows)


def shard_chunks(local: torch.Tensor, start: int, slice_shape: tuple[int, ...], split_dim: int | None,
                 tp: int, tp_rank: int, blocks: int = 1) -> Chunked:
    """Rows ``[start, start + len(local))`` of this rank's tp slice (of shape ``slice_shape``) as chunks
    of the unsplit tensor. ``split_dim`` is the dimension tensor parallelism split (None: replicated
    over tp); a fused weight split by rows in ``blocks`` parts (q, k, v) has each part's rows apart."""
    full = list(slice_shape)
    if split_dim is not None:
        full[split_dim] *= tp
    stop = start + (local.shape[0] if local.dim() else 0)
    pieces = []
    if local.dim() == 0 or local.shape[0] == 0:
        pieces = [] if local.dim() else [((), local)]
    elif split_dim is None:
        pieces = [((start, *[0] * (local.dim() - 1)), local)]
    elif split_dim == 1:  # the slice's columns are columns tp_rank * cols .. of the whole
        pieces = [((start, tp_rank * slice_shape[1], *[0] * (local.dim() - 2)), local)]
    else:  # rows: each of the blocks' parts sits at its own place in the whole
        part, block = slice_shape[0] // blocks, full[0] // blocks
        for b in range(blocks):
            lo, hi = max(start, b * part), min(stop, (b + 1) * part)
            if lo < hi:
                row = b * block + tp_rank * part + (lo - b * part)
                pieces.append(((row, *[0] * (local.dim() - 1)), local.narrow(0, lo - start, hi - lo)))
    return Chunked(full, pieces, local.dtype, local.device)


def reshard(model: nn.Module) -> None:
    """Register every FSDP2 unit's sharded parameters again. A forward without backward (the loss probe a
    checkpoint records) leaves the root gathered, since the root is not resharded after forward; its
    registered parameters are then whole plain tensors, not the ``DTensor`` shards the optimizer keys
    its state by."""
    for module in model.modules():
        if hasattr(module, "reshard") and hasattr(module, "unshard"):  # an FSDPModule
            module.reshard()


class FSDPTensorParallelStrategy(HeldState, FSDPStrategy):
    """tp inside each replica, FSDP2 over the dp axis (see the module docstring)."""

    name = "fsdp2"

    def wrap(self, model: nn.Module) -> nn.Module:
        self.raw = parallelize(model, self.ctx.tp_group)
        return super().wrap(self.raw)

    def build_optimizer(self, model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        self.optimizer = super().build_optimizer(model, lr, weight_decay)
        return self.optimizer

    @property
    def overflow_group(self):
        return self.ctx.world_group  # every rank holds a different piece of the gradients

    def _layout(self) -> dict[str, tuple[int | None, int]]:
        """Parameter name -> (the dimension tp split, or None; the number of fused parts)."""
        out = {}
        for owner, module in split_modules(self.raw).items():
            for leaf, _ in module.named_parameters(recurse=False):
                out[f"{owner}.{leaf}"] = (module._dim(leaf), module.blocks if module._dim(leaf) == 0 else 1)
        return out

    def _chunked(self, name: str, tensor: torch.Tensor, layout: dict) -> Chunked:
        split_dim, blocks = layout.get(name, (None, 1))
        local, start = local_rows(tensor, self.ctx.dims.dp, self.ctx.dp_rank)
        return shard_chunks(local, start, tuple(tensor.shape), split_dim, self.ctx.dims.tp,
                            self.ctx.dims.coords(self.ctx.rank)["tp"], blocks)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        layout = self._layout()
        grads = [(name, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                 for name, p in self.raw.named_parameters() if p.grad is not None]
        split = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for name, grad in grads:
            value = grad.detach().double().pow(2).sum()
            if layout.get(name, (None, 1))[0] is None:
                replicated += value
            else:
                split += value
        dist.all_reduce(split, group=self.ctx.world_group)  # every (dp, tp) rank: a distinct piece
        dist.all_reduce(replicated, group=self.ctx.dp_group)  # tp peers hold the same piece
        total = (split + replicated).sqrt().float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for _, grad in grads:
            grad.mul_(coef.to(grad.device))
        return total

    def model_names(self, model) -> list[str]:
        return [name for name, _ in self.raw.named_parameters()]

    def held_state(self, model, optimizer) -> tuple[dict, dict]:
        reshard(self.raw)
        layout = self._layout()
        model_state = {name: self._chunked(name, p, layout) for name, p in self.raw.named_parameters()}
        if optimizer is None:
            return model_state, {}
        names = _param_names(self.raw)
        entries = adam_state(optimizer, [p for p in self.raw.parameters() if p.requires_grad])
        state = {name: {k: (self._chunked(name, v, layout) if k in MOMENTS else v) for k, v in entry.items()}
                 for name, entry in zip(names, entries)}  # each moment has its parameter's layout
        return model_state, {"state": state, "param_groups": param_groups(optimizer, names)}
