"""What one rank holds of a tensor, as rectangular chunks of the whole: the language DCP reshards in.

A sharded strategy keeps parts of tensors. ZeRO-1 keeps a flat range of every parameter's optimizer
moments (in a 2-D weight it may start and end in the middle of a row); tensor parallelism keeps a
block of rows or columns (three blocks of rows of a fused q/k/v weight: this rank's heads of q, of k
and of v); a pipeline stage keeps whole tensors, of its own layers only. A DCP checkpoint describes
every tensor as **chunks**: an offset and a size inside the whole tensor (``ChunkStorageMetadata``).
So a rank can tell DCP exactly what it holds, and nothing has to be gathered:

* :class:`Chunked` is a tensor of the whole shape that owns no storage: only its pieces, each a view
  of this rank's live state at an offset. DCP asks it, through the protocol that ``DTensor`` also
  implements (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``), which
  chunks this rank writes, and which slices a load must fill. Saving writes the pieces; loading
  fills them **in place**, from whatever chunks another layout wrote (``create_read_items_for_chunk_list``
  intersects the two).
* :func:`flat_range_chunks` cuts a flat range of a row-major tensor into rectangles.
* :func:`gather_to_main` builds whole tensors on rank 0 only (for a ``full`` checkpoint: every other
  rank sends its pieces and allocates nothing); :func:`fill_from_full` copies whole tensors into the
  pieces (loading a ``full`` checkpoint).
"""

from __future__ import annotations

import functools
import math
from typing import Iterable

import torch
import torch.distributed as dist

from ddpkit.errors import UserError

Offsets = tuple[int, ...]


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5 keeps it here
        from torch.distributed._tensor import DTensor
    return DTensor


@functools.cache
def dcp_takes_chunks() -> bool:
    """Whether this torch's DCP asks a tensor subclass for its chunks (the protocol DTensor implements).
    Asked of DCP itself, with a one-chunk :class:`Chunked`: DTensor has the protocol's methods in torch
    releases whose DCP never calls them on other classes (2.4 checks ``isinstance(x, _Checkpointable)``)."""
    from torch.distributed.checkpoint import planner_helpers

    probe = Chunked((2,), [((0,), torch.zeros(2))], torch.float32)
    try:
        items = planner_helpers._create_write_items("probe", probe)
    except Exception:  # noqa: BLE001 - DCP treated it as a plain tensor and touched it
        return False
    return len(items) == 1 and tuple(items[0].index.offset) == (0,)


def require_chunks(tree) -> None:
    """Refuse, with the ways out, to hand DCP a :class:`Chunked` tensor where it cannot take one."""
    if isinstance(tree, dict):
        for value in tree.values():
            require_chunks(value)
    elif isinstance(tree, Chunked) and not dcp_takes_chunks():
        raise UserError(f"a dcp checkpoint of this strategy writes each rank's chunks, which torch "
                        f"{torch.__version__.split('+')[0]}'s torch.distributed.checkpoint cannot take: use "
                        f"--checkpoint-format full or a newer torch")


class Chunked(torch.Tensor):
    """A tensor of ``shape`` of which this rank holds ``pieces``: ``(offsets, tensor)`` pairs, each
    tensor a view of live state (possibly none at all). A description for DCP, not something to compute
    with: any operation on it raises."""

    @staticmethod
    def __new__(cls, shape: Iterable[int], pieces: list[tuple[Offsets, torch.Tensor]], dtype: torch.dtype,
                device: torch.device | str = "cpu") -> "Chunked":
        self = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=torch.device(device))
        self.pieces = [(tuple(int(o) for o in offsets), piece) for offsets, piece in pieces]
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise TypeError(f"{func} on a Chunked tensor: it only describes which chunks this rank holds")

    def __repr__(self) -> str:
        return f"Chunked(shape={list(self.shape)}, pieces={[(o, list(p.shape)) for o, p in self.pieces]})"

    # ---------------------------------------------------------------- the protocol DCP calls

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), piece.shape),
                                                      properties=TensorProperties.create_from_tensor(piece),
                                                      size=self.shape))
                for offsets, piece in self.pieces]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(offsets), piece.shape) for offsets, piece in self.pieces]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for offsets, piece in self.pieces:
            if offsets == tuple(index.offset):
                return piece
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {list(index.offset)}")


def flat_range_chunks(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[Offsets, tuple[int, ...]]]:
    """Rectangles (offsets, sizes) that cover elements ``start`` .. ``stop - 1`` of a row-major tensor of
    ``shape``, in memory order: a partial first row, whole rows, a partial last row (recursively)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    inside = [((first, *o), (1, *s)) for o, s in flat_range_chunks(shape[1:], start - first * row, stop - first * row)]
    if first == last:
        return inside
    out = []
    if start % row:
        out += [((first, *o), (1, *s)) for o, s in flat_range_chunks(shape[1:], start % row, row)]
        first += 1
    whole = stop // row  # rows first .. whole - 1 are covered entirely
    if whole > first:
        out.append(((first, *[0] * (len(shape) - 1)), (whole - first, *shape[1:])))
    if stop % row:
        out += [((whole, *o), (1, *s)) for o, s in flat_range_chunks(shape[1:], 0, stop % row)]
    return out


def flat_chunked(flat: torch.Tensor, shape: tuple[int, ...], start: int) -> Chunked:
    """``flat`` holds elements ``start`` .. ``start + flat.numel() - 1`` of a tensor of ``shape`` (row-major):
    the same memory as that tensor's chunks (views, no copy)."""
    pieces, position = [], 0
    for offsets, sizes in flat_range_chunks(tuple(shape), start, start + flat.numel()):
        n = math.prod(sizes)
        pieces.append((offsets, flat[position:position + n].view(sizes)))
        position += n
    return Chunked(shape, pieces, flat.dtype, flat.device)


def pieces_of(value: torch.Tensor) -> list[tuple[Offsets, torch.Tensor]]:
    """A state value's pieces: a :class:`Chunked`'s own, or a plain tensor as one piece at the origin."""
    if isinstance(value, Chunked):
        return value.pieces
    return [((0,) * value.dim(), value)]


def region(full: torch.Tensor, offsets: Offsets, sizes) -> torch.Tensor:
    """The view of ``full`` that a chunk covers."""
    for dim, (o, s) in enumerate(zip(offsets, sizes)):
        full = full.narrow(dim, o, s)
    return full


@torch.no_grad()
def fill_from_full(state: dict, full: dict) -> None:
    """Copy whole tensors (a ``full`` checkpoint's, keyed like ``state``) into ``state``'s pieces, in place."""
    for key, value in state.items():
        if isinstance(value, dict):
            fill_from_full(value, full[key])
            continue
        source = torch.as_tensor(full[key])
        for offsets, piece in pieces_of(value):
            piece.copy_(region(source, offsets, piece.shape).to(piece.device))


def flatten(state: dict, prefix: tuple = ()) -> dict[tuple, torch.Tensor]:
    """Nested dicts of tensors -> one dict keyed by paths (tuples of keys: parameter names hold dots)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def unflatten(flat: dict[tuple, torch.Tensor]) -> dict:
    """The reverse of :func:`flatten`."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


@torch.no_grad()
def gather_to_main(ctx, state: dict[tuple, torch.Tensor]) -> dict[tuple, torch.Tensor]:
    """Whole tensors on rank 0, on the CPU, from the pieces every rank holds (collective over the world;
    ``state`` is flat: :func:`flatten`). Other ranks get ``{}`` and allocate nothing: each chunk is sent
    once, by the lowest rank that holds it, straight from its live memory; rank 0 receives one tensor's
    chunks at a time, each into a buffer of its own size."""
    mine = {key: (list(value.shape), value.dtype, [(o, list(p.shape)) for o, p in pieces_of(value)])
            for key, value in state.items()}
    everyone = [mine]
    if ctx.is_distributed:
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine, group=ctx.world_group)
    owner: dict[tuple, int] = {}
    for rank, held in enumerate(everyone):
        for key, (_, _, chunks) in held.items():
            for offsets, _ in chunks:
                owner.setdefault((key, tuple(offsets)), rank)
    out = {}
    for key in sorted({k for held in everyone for k in held}):
        shape, dtype, _ = next(held[key] for held in everyone if key in held)
        whole = torch.empty(shape, dtype=dtype) if ctx.is_main else None
        sends, receives = [], []
        for rank, held in enumerate(everyone):
            for offsets, sizes in (held[key][2] if key in held else []):
                if owner[(key, tuple(offsets))] != rank:
                    continue  # a lower rank holds the same chunk and sends it
                if rank == ctx.rank:
                    piece = dict(pieces_of(state[key]))[tuple(offsets)]
                    if ctx.is_main:
                        region(whole, offsets, sizes).copy_(piece)
                    else:
                        sends.append(dist.P2POp(dist.isend, piece.contiguous(), 0, group=ctx.world_group))
                elif ctx.is_main:
                    buffer = torch.empty(sizes, dtype=dtype, device=ctx.device)
                    receives.append((offsets, buffer, dist.P2POp(dist.irecv, buffer, rank, group=ctx.world_group)))
        ops = sends + [op for _, _, op in receives]
        if ops:  # a send and its receive are posted in one batch each: nothing waits on an unposted peer
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for offsets, buffer, _ in receives:
            region(whole, offsets, buffer.shape).copy_(buffer)
        if ctx.is_main:
            out[key] = whole
    return out


def adam_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[dict]:
    """AdamW's state of ``params`` (their moments and step counters), created as a fresh AdamW would
    (zeros, step 0) where no step has run yet: the tensors a dcp load fills in place."""
    out = []
    for p in params:
        entry = optimizer.state[p]
        if not entry:
            entry["step"] = torch.zeros((), dtype=torch.float32)  # AdamW's own initial state
            entry["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            entry["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out.append(entry)
    return out


def set_hyperparameters(optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> None:
    """The saved groups' hyper-parameters (lr, betas, ...) into the optimizer's one group."""
    for key, value in saved_groups[0].items():
        if key != "params" and key in optimizer.param_groups[0]:
            optimizer.param_groups[0][key] = value
