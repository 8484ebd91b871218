"""The parallel layout: how the world's ranks split into data-, context-, tensor- and pipeline-parallel groups.

``world = dp x cp x tp x pp``. Think of the ranks as a 3-D grid (a *device mesh*) with axes ``pp``
(pipeline stages, outermost), ``dp`` (data-parallel replicas) and ``tp`` (tensor-parallel shards,
innermost, so that tensor-parallel peers are neighbours: on a GPU cluster, the same node and its fast
links). A rank's coordinates on the grid say which samples it sees (its ``dp`` index: tensor- and
pipeline-parallel peers see the **same** samples), which slice of each layer it holds (``tp``) and
which layers (``pp``). Context-parallel peers (``cp``, between ``dp`` and ``tp``) also see the same
samples, each a share of every sequence's positions. The global batch is ``micro x accum x dp``, not ``x world``.

torchtitan calls the same object ``ParallelDims``; it is built once from the config, validated, and
turned into a :class:`torch.distributed.device_mesh.DeviceMesh`, whose per-axis process groups are
what every collective names (``mesh.get_group("dp")``). Building it needs no process group, so it can
be unit-tested on its own; the mesh needs one.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("pp", "dp", "cp", "tp")  # mesh axes, outermost first


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the three parallel axes. ``ParallelDims.from_world(8, tp=2)`` gives dp=4."""

    dp: int = 1
    """Data-parallel replicas: each sees its own share of every global batch."""
    tp: int = 1
    """Tensor-parallel shards: each holds a slice of every layer's matrices."""
    pp: int = 1
    """Pipeline stages: each holds a contiguous range of layers."""
    cp: int = 1
    """Context-parallel shards: each holds a share of every sequence's positions."""

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{axis} must be a whole number >= 1, got {size!r}")

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> "ParallelDims":
        """The layout of ``world_size`` ranks with the given tp, pp and cp; dp is what is left."""
        if tp < 1 or pp < 1 or cp < 1:
            raise ValueError(f"tp, pp and cp must be >= 1, got tp={tp}, pp={pp}, cp={cp}")
        if world_size % (tp * pp * cp):
            raise ValueError(f"world size {world_size} is not divisible by tp x pp x cp = {tp} x {pp} x {cp}: "
                             f"use a world size that is a multiple of {tp * pp * cp}")
        return cls(dp=world_size // (tp * pp * cp), tp=tp, pp=pp, cp=cp)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axes, outermost first: ``cp`` only where it splits anything (the mesh stays 3-D
        otherwise, as it was before context parallelism, with no process groups of one rank more)."""
        return tuple(a for a in AXES if a != "cp" or self.cp > 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes in mesh order (pp, dp, [cp,] tp)."""
        return tuple(getattr(self, a) for a in self.axes)

    def coords(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits on the grid, by the mesh's :attr:`axes`: row-major over (pp, dp, [cp,] tp),
        as DeviceMesh lays it out."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        pp, rest = divmod(rank, self.dp * self.cp * self.tp)
        dp, rest = divmod(rest, self.cp * self.tp)
        cp, tp = divmod(rest, self.tp)
        return {axis: {"pp": pp, "dp": dp, "cp": cp, "tp": tp}[axis] for axis in self.axes}

    def build_mesh(self, device_type: str):
        """The device mesh over the current process group (every rank calls it: it is collective)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.axes)

    def describe(self) -> str:
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp}" + (f" x cp {self.cp}" if self.cp > 1 else "")
