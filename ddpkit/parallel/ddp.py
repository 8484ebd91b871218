"""Distributed data parallel: a full replica of the model on every rank, gradients averaged by all-reduce.

``torch.nn.parallel.DistributedDataParallel`` (DDP) broadcasts rank 0's parameters when it wraps the
model, then, during every ``backward``, divides each gradient by the number of replicas as it copies
it into its **bucket** (about 25 MiB each, filled in the order gradients become ready) and
all-reduces (SUM) each bucket as soon as it is full, so communication overlaps the rest of backward;
dividing first avoids overflow, "especially for FP16" (torch's ``default_hooks.py``). Every replica
then takes the same optimizer step and the replicas stay bitwise identical, with no further
communication.

``gradient_as_bucket_view=True``: gradients *are* slices of the all-reduce buckets, so one copy of
the gradients is alive instead of two and nothing is copied back out. The copy *in* is saved only while
``.grad`` survives between steps: with ``zero_grad(set_to_none=True)``, which the trainer uses, autograd
writes each gradient into fresh memory every backward and DDP copies it into its bucket (DDP's own
docstring says so under ``batched_grad_copy``; notebook 05 measures it). The gradients must not be
detached or replaced in place by user code.

One subtlety matters for exact resume. DDP starts with all parameters in **one** bucket, and after
the first backward of each process it **rebuilds** the buckets in the order gradients actually became
ready. The layout decides how gloo chunks the buffer, and so in which order it adds the replicas'
values: with 2 replicas a + b = b + a, but with 3 or more the sum of the same numbers in another order
can differ in the last bit. A process resumed at step 10 would run its first step with the initial
layout while the uninterrupted run had long rebuilt it, and the runs would drift apart by ~1e-7. So
:meth:`DDPStrategy.prepare` runs one synchronised backward of a zero loss (zero gradients, no
optimizer step) before training: every process, fresh or resumed, then trains every step with the
rebuilt layout.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.metrics import CommTimer
from ddpkit.parallel.base import Strategy
from ddpkit.runtime import RankContext


def wrap_ddp(model: torch.nn.Module, ctx: RankContext) -> torch.nn.Module:
    """DDP over the data-parallel group when there is more than one replica; the model itself otherwise."""
    if ctx.dp_size == 1:
        return model
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               process_group=ctx.dp_group, gradient_as_bucket_view=True)


class DDPStrategy(Strategy):
    """Replicate everything; average gradients with DDP's bucketed all-reduce."""

    name = "ddp"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return wrap_ddp(model, self.ctx)

    def prepare(self, model: torch.nn.Module, run_micro_batch: Callable[..., None], example: dict) -> None:
        """Settle DDP's bucket layout with one zero-gradient backward (see the module docstring)."""
        if not isinstance(model, DDP):
            return
        run_micro_batch(example, loss_scale=0.0)
        model.zero_grad(set_to_none=True)

    def no_sync(self, model: torch.nn.Module) -> ContextManager:
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()

    def comm_timer(self, model: torch.nn.Module) -> CommTimer:
        timer = CommTimer(self.ctx.device if self.ctx else None)
        return timer.register(model, measure=self.measure_comm) if isinstance(model, DDP) else timer
