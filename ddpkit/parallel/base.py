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
5. :meth:`Strategy.comm_timer` gives a :class:`~ddpkit.metrics.CommTimer` that measures the
   strategy's gradient communication.

This base class is the single-replica behaviour (no communication at all), which is also what every
strategy does on a data-parallel world of one.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

from ddpkit.metrics import CommTimer
from ddpkit.runtime import RankContext


class Strategy:
    """See the module docstring. ``ctx`` may be None for code that runs outside a job (a notebook cell)."""

    name = "single"

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

    def comm_timer(self, model: torch.nn.Module) -> CommTimer:
        """A timer of this strategy's gradient communication (none here: it reads zero)."""
        return CommTimer(self.ctx.device if self.ctx else None)
