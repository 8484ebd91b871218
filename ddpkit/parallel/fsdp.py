"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state all sharded (ZeRO stage 3).

Each parameter becomes a ``DTensor`` sharded along its first dimension over the data-parallel ranks,
so a rank stores 1/N of every parameter, its gradient and (because the optimizer is built over the
sharded parameters) its AdamW moments. The whole parameters exist only briefly:

* before a module's forward (and again before its backward) an **all-gather** rebuilds its
  parameters, which are freed right after;
* after its backward a **reduce-scatter** averages the gradients and leaves each rank its shard.

Sharding is applied per block, then to the root (the embeddings and head that are left), so a block's
full parameters are alive only around its own forward and backward; that is what makes a model larger
than one device fit. "Only one block at a time" would be too strong: the root is *not* resharded after
forward (``reshard_after_forward=None`` means False for the root, per ``fully_shard``'s docstring, since
backward needs it first), and FSDP2 prefetches the next block's all-gather while the current one
computes, so the peak holds the root, the current block and the next one.
The price is communication: parameters are gathered in forward and again in backward, about 1.5x
DDP's bytes. That communication runs inside FSDP2's own hooks, so the trainer's ``comm_s`` (which a
DDP comm hook or ZeRO's optimizer measures) reads 0 here: the time is counted in ``forward_s`` and
``backward_s``.

Two knobs of ``fully_shard`` reach the trainer:

* ``reshard_after_forward`` (``--reshard-after-forward`` / ``--no-reshard-after-forward``), given to
  every block: True frees a block's gathered parameters after its forward and gathers them again in
  backward (ZeRO stage 3); False keeps them gathered until its backward is done, so backward gathers
  nothing and the step holds every block's whole parameters at once (the parameter memory of ZeRO
  stage 2). Left out, FSDP2's default applies (True for the blocks). The numbers computed are the
  same either way: only when parameters are gathered changes.
* a 2-D mesh (:class:`HSDPStrategy`, ``--strategy hsdp``): "parameters are sharded across the 1st dim
  and replicated across the 0th dim (HSDP) with ``(Replicate(), Shard(0))`` placement" (``fully_shard``'s
  docstring). Gradients are reduce-scattered within a shard group, then all-reduced across the replica
  groups; the all-gathers stay inside a shard group (on a cluster: one node's fast links).

``fully_shard`` lives in ``torch.distributed.fsdp`` from torch 2.6 and in
``torch.distributed._composable.fsdp`` before; both are the same FSDP2. On the CPU (gloo) it runs
from torch 2.7: before, it needs CUDA streams (2.5: "FSDP requires CUDA for streams"; 2.6 fails on a
CPU stream), so there :func:`check_supported` refuses it with that reason before anything starts.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from ddpkit.errors import UserError
from ddpkit.parallel.base import Strategy
from ddpkit.runtime import RankContext

MIN_CPU_TORCH = (2, 7)  # the first release whose FSDP2 runs on CPU tensors (checked: 2.6 fails, 2.7.1 works)


def cpu_supported(version: str | None = None) -> bool:
    """Whether this torch's FSDP2 runs on the CPU (with gloo)."""
    major, minor = (int(x) for x in (version or torch.__version__).split("+")[0].split(".")[:2])
    return (major, minor) >= MIN_CPU_TORCH


def check_supported(device_type: str) -> None:
    """Refuse FSDP2 where this torch cannot run it, with the reason and the ways out."""
    if device_type == "cpu" and not cpu_supported():
        raise UserError(f"strategy fsdp2 on the CPU needs torch >= {'.'.join(map(str, MIN_CPU_TORCH))} (FSDP2 in torch "
                        f"{torch.__version__.split('+')[0]} runs on CUDA only): use --strategy zero1, a GPU per rank, "
                        f"or a newer torch")


def fully_shard_fn():
    """``fully_shard`` wherever this torch keeps it."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded one by one before the root: a GPT's blocks, an MLP's linear layers."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


class FSDPStrategy(Strategy):
    """FSDP2 over the data-parallel mesh axis: per unit, then the root."""

    name = "fsdp2"

    def __init__(self, ctx: RankContext | None = None, reshard_after_forward: bool | None = None) -> None:
        super().__init__(ctx)
        self.reshard_after_forward = reshard_after_forward

    def mesh(self):
        """The mesh ``fully_shard`` shards over: the layout's dp axis."""
        return self.ctx.mesh["dp"] if self.ctx.mesh is not None else None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        check_supported(self.ctx.device.type)
        fully_shard = fully_shard_fn()
        mesh = self.mesh()
        unit_options = {} if self.reshard_after_forward is None else {"reshard_after_forward": self.reshard_after_forward}
        for unit in shard_units(model):
            fully_shard(unit, mesh=mesh, **unit_options)
        fully_shard(model, mesh=mesh)  # the root keeps FSDP2's default: backward needs it first
        return model

    def sharding(self, model: torch.nn.Module) -> dict:
        """The mesh each parameter is sharded over and the placements of the first one, as printed."""
        mesh = self.mesh()
        first = next(p for p in model.parameters() if hasattr(p, "placements"))
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        return {"mesh": dict(zip(names, mesh.mesh.shape)), "placements": [repr(p) for p in first.placements],
                "reshard_after_forward": self.reshard_after_forward}

    @contextlib.contextmanager
    def _no_sync(self, model: torch.nn.Module):
        model.set_requires_gradient_sync(False)  # gradients accumulate unsharded, no reduce-scatter
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def no_sync(self, model: torch.nn.Module) -> ContextManager:
        return self._no_sync(model)

    @property
    def overflow_group(self):
        return self.ctx.dp_group  # each rank's gradients are a shard: an overflow shows in one shard only

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # sums squares over shards
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class HSDPStrategy(FSDPStrategy):
    """FSDP2 on a 2-D ``(replicate, shard)`` mesh of the whole world: shard within a group of ``shard``
    consecutive ranks, replicate across ``replicate`` groups (see the module docstring). Each rank still
    sees its own samples: its data-parallel rank is its world rank, as under DDP."""

    name = "hsdp"

    def __init__(self, ctx: RankContext | None = None, reshard_after_forward: bool | None = None,
                 replicate: int = 1, shard: int | None = None) -> None:
        super().__init__(ctx, reshard_after_forward)
        self.replicate = replicate
        self.shard = shard if shard is not None else (ctx.world_size // replicate if ctx else 1)
        self._mesh = None

    def mesh(self):
        if self._mesh is None:  # collective: every rank builds it, in wrap
            from torch.distributed.device_mesh import init_device_mesh

            if self.replicate * self.shard != self.ctx.world_size:
                raise ValueError(f"hsdp replicate x shard = {self.replicate} x {self.shard} does not match the "
                                 f"world size {self.ctx.world_size}")
            self._mesh = init_device_mesh(self.ctx.device.type, (self.replicate, self.shard),
                                          mesh_dim_names=("replicate", "shard"))
        return self._mesh
