"""The strategy interface: the few calls through which the trainer meets a parallelism strategy.

A strategy decides how the model, its gradients and its optimizer state are split across the
data-parallel ranks (DDP replicates all three; ZeRO shards the optimizer state; FSDP shards all
three) and how the micro-batches of one step are run (a pipeline schedule interleaves them across
stages). The trainer never asks *which* strategy it has; it calls, in this order:

1. :meth:`Strategy.wrap` the model (DDP, FSDP, ...), then :meth:`Strategy.build_optimizer` for it;
2. (a resume loads state through ``torch.distributed.checkpoint.state_dict``, strategy-agnostic);
3. :meth:`Strategy.prepare` once, with an example batch, before the first step;
4. every step, :meth:`Strategy.forward_backward` over the micro-batches, skipping gradient sync
   (:meth:`Strategy.no_sync`) for all but the last, then :meth:`Strategy.clip_grad_norm_` and the
   optimizer step;
5. :meth:`Strategy.eval_loss` is the loss on a fixed batch (checked after a restore), and
   :meth:`Strategy.comm_timer` gives a :class:`~ddpkit.metrics.CommTimer` that measures the
   strategy's gradient communication;
6. :meth:`Strategy.state_dicts` / :meth:`Strategy.load_state_dicts` move the whole model and optimizer
   state in and out, keyed by parameter name, whatever the sharding (what a ``full`` checkpoint holds);
   :meth:`Strategy.state_bytes` measures what this rank holds.

This base class is the single-replica behaviour (no communication at all), which is also what every
strategy does on a data-parallel world of one.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from ddpkit.metrics import CommTimer
from ddpkit.runtime import RankContext


class Strategy:
    """See the module docstring. ``ctx`` may be None for code that runs outside a job (a notebook cell)."""

    name = "single"
    measure_comm = True  # time gradient communication per step (the trainer turns it off when no one reads it)

    def __init__(self, ctx: RankContext | None = None) -> None:
        self.ctx = ctx

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as the training loop will call it."""
        return model

    def build_optimizer(self, model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """AdamW over the parameters this rank updates."""
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def prepare(self, model: torch.nn.Module, run_micro_batch: Callable[..., None], example: dict) -> None:
        """Anything to settle before the first real step. ``run_micro_batch(batch, loss_scale=1.0)`` runs
        forward and backward of one micro-batch with its loss multiplied by ``loss_scale``."""

    def no_sync(self, model: torch.nn.Module) -> ContextManager:
        """A context in which backward accumulates gradients locally without communicating."""
        return contextlib.nullcontext()

    def forward_backward(self, model: torch.nn.Module, micro_batches: list[dict],
                         run_micro_batch: Callable[[dict], None]) -> None:
        """Forward and backward over one step's micro-batches; only the last one synchronises gradients.

        Forward *and* backward of the others run inside :meth:`no_sync`: DDP decides in forward whether
        the coming backward will all-reduce, so a forward outside ``no_sync`` still communicates.
        """
        for k, batch in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.no_sync(model):
                run_micro_batch(batch)

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (a sharded strategy must reduce the norm across shards)."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    @property
    def overflow_group(self):
        """The ranks that must agree whether a step's fp16 gradients overflowed, or None when every rank
        already sees the same gradients (DDP: they are averaged before the scaler looks)."""
        return None

    def agree_on_overflow(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        """After ``scaler.unscale_``: every rank of :attr:`overflow_group` skips the step if any of them
        found an inf or a NaN: the found-inf flags are all-reduced (with MAX; torch's ``ShardedGradScaler``,
        made for FSDP, all-reduces them with SUM in its ``unscale_``, to the same effect). A rank that holds only part of the gradients (a tp shard, a
        pipeline stage, a ZeRO or FSDP shard) sees only part of an overflow: alone, one rank would skip
        the step while another applied it, the replicated weights would part, and the loss scales
        would drift apart, so that a stage would unscale with a scale its gradients were not scaled by."""
        group = self.overflow_group
        if not scaler.is_enabled() or group is None or not self.ctx.is_distributed:
            return
        found = list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        flag = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for found_inf in found:
            flag = torch.maximum(flag, found_inf.to(self.ctx.device))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        for found_inf in found:
            found_inf.copy_(flag)

    def eval_loss(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The model's mean loss on one batch, without gradients, the same on every rank (collective where
        the model is split: every rank calls it). ``model`` is the unwrapped model."""
        from ddpkit.models import loss_fn

        with torch.no_grad():
            return float(loss_fn(model(inputs), targets))

    def comm_timer(self, model: torch.nn.Module) -> CommTimer:
        """A timer of this strategy's gradient communication (none here: it reads zero)."""
        return CommTimer(self.ctx.device if self.ctx else None)

    # ---------------------------------------------------------------- state in and out

    def state_dicts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    rank0_only: bool = True) -> tuple[dict, dict]:
        """Full model and optimizer state dicts keyed by parameter name (collective: every rank calls).
        ``rank0_only`` lets the other ranks return empty dicts where that saves work."""
        from ddpkit.state import model_and_optimizer

        return model_and_optimizer(model, optimizer, rank0_only)

    def load_state_dicts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                         model_state: dict, optimizer_state: dict | None) -> None:
        """Put full state dicts (from :meth:`state_dicts` of *any* strategy) back; optimizer None = weights only."""
        from ddpkit.state import load_model_and_optimizer

        load_model_and_optimizer(model, optimizer, model_state, optimizer_state)

    def sharded_state_dicts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """This rank's model and optimizer state as DCP saves it: keyed by parameter name, each tensor
        as this rank holds it (a DTensor shard under FSDP; the whole tensor when replicated). Also the
        template a dcp load fills in place, so the optimizer state is created if no step has run yet."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(model, optimizer)

    def load_sharded_state_dicts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                                 model_state: dict, optimizer_state: dict | None) -> None:
        """Put back what :meth:`sharded_state_dicts` gave, once a dcp load has filled it."""
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_state_dict,
        )

        if optimizer is None:
            set_model_state_dict(model, model_state)
        else:
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)

    def sharding(self, model: torch.nn.Module) -> dict | None:
        """How FSDP2 lays the parameters out (its mesh, a parameter's placements), or None where it does not."""
        return None

    grad_bytes = 0
    """Bytes of gradients this rank held in its first step (they have the same shapes every step)."""

    def observe_gradients(self, model: torch.nn.Module) -> None:
        """Called every step while gradients exist; counts their bytes once, so the step pays nothing after."""
        if not self.grad_bytes:
            self.grad_bytes = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)

    def optimizer_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of optimizer state held on this rank."""
        return sum(tensor_bytes(v) for entry in optimizer.state.values() for v in entry.values() if torch.is_tensor(v))

    def state_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """What this rank holds, measured: parameters, gradients (as held in a step), optimizer state."""
        return {"params": sum(tensor_bytes(p) for p in model.parameters()),
                "grads": self.grad_bytes, "optimizer": self.optimizer_bytes(optimizer)}


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for ``tensor`` (a DTensor's local shard only)."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def _param_names(model: torch.nn.Module) -> list[str]:
    """Parameter names in ``model.parameters()`` order: the order an optimizer built from it numbers them."""
    return [name for name, p in model.named_parameters() if p.requires_grad]
