"""Context parallelism in the trainer: every sequence split over a cp group, DDP over the whole world.

``world = dp x cp``. Context-parallel peers take the **same** samples (their data-parallel rank is the
same) and each keeps a share of every sequence's positions: two of its 2 x cp chunks, zig-zag, so that
the causal work is even (:func:`~ddpkit.parallel.context.shard_sequence`). Every attention becomes ring
attention over the cp group and the position embedding looks up the shard's global positions
(:func:`~ddpkit.parallel.context.parallelize_context`); everything else in the GPT works position by
position. Parameters stay whole on every rank.

Why the gradients are averaged over dp x cp, the whole world here: a rank's loss is the mean over its
samples of the mean over its positions; the shards are equal, so the mean of the cp peers' losses is
the loss over whole sequences, and the mean over the dp replicas that of the global batch. Averaging
each rank's gradient over all dp x cp ranks (DDP over the world) is therefore the gradient of the
global batch's loss, as under DDP without context parallelism. The loss the trainer reports is each
micro-batch's per-sample losses averaged over the cp group in the same way.

State is the unsplit model's (same names, same whole tensors), so a checkpoint resumes with or without
context parallelism, on any world size.

With ``--tp`` too (:class:`ContextTensorParallelStrategy`, ``world = dp x cp x tp``), each replica's
blocks are first split over its tp group, then every attention becomes ring attention over the cp group
on this rank's heads. The positions are split over cp, the heads and MLP columns over tp. DDP then
averages over the dp x cp ranks that hold the same slices (the same tp coordinate), for the reason
above; tp peers hold different slices and are never averaged. State is tensor parallelism's: the
unsplit model's names, each rank's slices described as chunks, so the checkpoint resumes on any layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.parallel.context import parallelize_context, shard_sequence
from ddpkit.parallel.ddp import DDPStrategy
from ddpkit.parallel.tensor import parallelize
from ddpkit.parallel.tensor_strategy import TensorParallelStrategy


class ContextParallelStrategy(DDPStrategy):
    """Ring attention over the cp group, DDP over the world (see the module docstring)."""

    name = "ddp"

    @property
    def group(self):
        return self.ctx.mesh.get_group("cp")

    @property
    def ddp_group(self):
        """The ranks DDP averages gradients over: dp x cp, which with tp = pp = 1 is the world."""
        return self.ctx.world_group

    def shard(self, batch: dict) -> dict:
        """This rank's positions of a micro-batch's inputs and targets (the sample ids stay whole)."""
        n, r = self.ctx.dims.cp, self.ctx.dims.coords(self.ctx.rank)["cp"]
        return {**batch, "inputs": shard_sequence(batch["inputs"], r, n, 1),
                "targets": shard_sequence(batch["targets"], r, n, 1)}

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self.raw = parallelize_context(model, self.group)
        return DDP(self.raw, device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
                   process_group=self.ddp_group, gradient_as_bucket_view=True)

    def _averaged(self, run_micro_batch):
        """``run_micro_batch`` on this rank's positions, its recorded loss sum then averaged over cp."""
        def run(batch: dict, loss_scale: float = 1.0) -> None:
            run_micro_batch(self.shard(batch), loss_scale)
            sums = run_micro_batch.sums
            total = sums[-1].detach().clone()
            dist.all_reduce(total, group=self.group)
            sums[-1] = total / self.ctx.dims.cp
        run.sums = run_micro_batch.sums
        return run

    def prepare(self, model, run_micro_batch, example: dict) -> None:
        super().prepare(model, self._averaged(run_micro_batch), example)

    def forward_backward(self, model, micro_batches: list[dict], run_micro_batch) -> None:
        super().forward_backward(model, micro_batches, self._averaged(run_micro_batch))

    def eval_loss(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The mean loss over whole sequences: each rank's over its positions, averaged over cp (collective)."""
        from ddpkit.models import loss_fn

        batch = self.shard({"inputs": inputs, "targets": targets})
        with torch.no_grad():
            loss = loss_fn(model(batch["inputs"]), batch["targets"]).detach().reshape(1).double()
        dist.all_reduce(loss, group=self.group)
        return float(loss) / self.ctx.dims.cp


class ContextTensorParallelStrategy(ContextParallelStrategy, TensorParallelStrategy):
    """Tensor parallelism inside each replica, ring attention over cp on each rank's heads, DDP over
    dp x cp (see the module docstring). Clipping and state come from :class:`TensorParallelStrategy`."""

    _dp_cp_group = None

    @property
    def ddp_group(self):
        """This rank's dp x cp peers: every rank with its tp coordinate (built in :meth:`wrap`)."""
        return self._dp_cp_group

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        dims = self.ctx.dims
        by_tp = [[r for r in range(dims.world_size) if dims.coords(r)["tp"] == t] for t in range(dims.tp)]
        # collective: every rank creates every group, in the same order
        self._dp_cp_group, _ = dist.new_subgroups_by_enumeration(by_tp)
        self.raw = parallelize_context(parallelize(model, self.ctx.tp_group), self.group)
        return DDP(self.raw, device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
                   process_group=self.ddp_group, gradient_as_bucket_view=True)
