"""Tensor parallelism in the trainer: each data-parallel replica is split over a tp group, DDP across.

Every transformer block of the GPT is split over the ranks of this rank's tp group
(:func:`~ddpkit.parallel.tensor.parallelize`); DDP averages the gradients across replicas over the dp
group. The gradient norm for clipping is the unsplit model's: the split parameters' squares summed
over the tp group, the replicated ones counted once.

State is saved in the unsplit model's layout, keyed by its parameter names, so a checkpoint resumes on
any tp degree, or none. A split parameter (and each of its AdamW moments) is described as the chunks
of the unsplit tensor that this rank's slice covers (:meth:`~ddpkit.parallel.tensor.TensorParallelLinear.chunked`):
a ``dcp`` checkpoint holds each rank's slices, written by one replica, and nothing is gathered.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddpkit.parallel.base import _param_names
from ddpkit.parallel.chunks import adam_state
from ddpkit.parallel.ddp import DDPStrategy, wrap_ddp
from ddpkit.parallel.held_state import MOMENTS, HeldState, param_groups
from ddpkit.parallel.tensor import chunked_state, grad_norm_squared, parallelize


class TensorParallelStrategy(HeldState, DDPStrategy):
    """tp inside each replica, DDP across replicas (see the module docstring)."""

    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        self.raw = parallelize(model, self.ctx.tp_group)
        return wrap_ddp(self.raw, self.ctx)

    def build_optimizer(self, model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        self.optimizer = super().build_optimizer(model, lr, weight_decay)
        return self.optimizer

    @property
    def overflow_group(self):
        return self.ctx.world_group  # tp peers hold different gradients (DDP makes dp peers' equal)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        total = grad_norm_squared(self.raw, self.ctx.tp_group).sqrt().float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.raw.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device))
        return total

    def model_names(self, model) -> list[str]:
        return list(self.raw.state_dict())

    def held_state(self, model, optimizer) -> tuple[dict, dict]:
        model_state = chunked_state(self.raw, dict(self.raw.state_dict()))
        if optimizer is None:
            return model_state, {}
        names = _param_names(self.raw)
        entries = adam_state(optimizer, [p for p in self.raw.parameters() if p.requires_grad])
        state = {name: {k: (chunked_state(self.raw, {name: v})[name] if k in MOMENTS else v) for k, v in entry.items()}
                 for name, entry in zip(names, entries)}  # each moment has its parameter's layout
        return model_state, {"state": state, "param_groups": param_groups(optimizer, names)}
