"""The ``dcp`` writer: every rank writes its own shards with ``torch.distributed.checkpoint`` (DCP).

A ``full`` checkpoint is one file written by rank 0 after gathering everything to it: simple, but
its size and time grow with the model and one rank does all the I/O. DCP instead has **every rank
write what it owns**, plus a ``.metadata`` file (written by rank 0) that records, for every tensor,
its full shape and which chunk of it lies at which offset of which file. Loading is planned against
that map: a rank asks for the slices *it* now needs, whatever layout wrote them. That is **resharding**:
a checkpoint written by 4 ranks with DDP loads on 2 ranks with FSDP2, and the reverse. FSDP2 hands DCP
DTensors; ZeRO-1, tensor- and pipeline-parallel ranks hand it the chunks they hold
(``parallel/chunks.py``): no rank gathers what another holds, to save or to load.

The folder protocol is the one every ddpkit checkpoint follows (``checkpoint.py``): rank 0 makes a
temporary folder, every rank writes into it, rank 0 adds ``extra.pt`` (sampler position, every rank's
RNG states, optimizer hyper-parameters, identity) and a manifest with the sha256 of every file,
written last, then renames the folder into place. A crash at any instant leaves a folder that is
never read.

Data, not code: DCP stores only tensors here (anything else would be pickled, and DCP loads pickled
values with full unpickling); ``extra.pt`` is read with ``weights_only=True``; and DCP's own
``.metadata`` (a pickle of its chunk map) is read with an unpickler that builds nothing but DCP's
metadata classes and torch's sizes and dtypes (:class:`SafeReader`).

``async_save`` (:class:`AsyncSave`) writes in a background thread while training goes on. Its
background collectives must run on a process group of their own: on the default group they would
interleave with training's collectives, and gloo pairs messages by order, so the two streams corrupt
each other or crash.
"""

from __future__ import annotations

import io
import pickle
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ddpkit import checkpoint
from ddpkit.checkpoint import CheckpointError
from ddpkit.files import file_sha256
from ddpkit.parallel.chunks import Chunked, dcp_takes_chunks, require_chunks

EXTRA_FILE = checkpoint.EXTRA_FILE
METADATA_FILE = checkpoint.DCP_METADATA


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch sizes, dtypes, layouts and plain containers; refuses the rest."""

    def find_class(self, module: str, name: str):
        if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
            value = super().find_class(module, name)
            if isinstance(value, type):  # DCP's dataclasses and enums, never a function
                return value
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP metadata file")


_ALLOWED = {("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
            ("torch.serialization", "_get_layout")}  # _get_layout: a layout from its name


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with a metadata unpickler that cannot run code."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / METADATA_FILE
        try:
            return _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"refusing {path}: {exc} (a checkpoint is data, not code)") from None


def _world(ctx):
    return ctx.world_group if ctx.is_distributed else None


def _tensors(model_state: dict, optimizer_state: dict) -> dict:
    """What DCP stores: tensors only, keyed by parameter name."""
    return {"model": model_state, "optimizer": optimizer_state["state"]}


def _agree_on_folder(ctx, root: str, step: int) -> Path:
    tmp = [str(checkpoint.prepare(root, step)) if ctx.is_main else None]
    if ctx.is_distributed:
        dist.broadcast_object_list(tmp, src=0, group=ctx.world_group)
    return Path(tmp[0])


def seal(ctx, root: str, step: int, tmp: Path, extra: dict, meta: dict, keep_last: int) -> Path | None:
    """Rank 0: write ``extra.pt``, hash every file, publish the folder. Returns it (None elsewhere)."""
    if not ctx.is_main:
        return None
    files = {EXTRA_FILE: checkpoint.write_torch(tmp / EXTRA_FILE, extra)}
    for path in sorted(tmp.iterdir()):
        if path.name not in files:
            files[path.name] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    return checkpoint.publish(root, step, tmp, files, meta, keep_last, writer="dcp")


def save(ctx, root: str, step: int, model_state: dict, optimizer_state: dict, extra: dict, meta: dict,
         keep_last: int = 3, group=None) -> Path | None:
    """Write a dcp checkpoint (collective: every rank calls with its own, possibly sharded, state).
    ``optimizer_state`` is keyed by parameter name; its ``param_groups`` go to ``extra.pt``. ``group``: the
    process group the writes and the final wait run on (the trainer's has the save's own timeout)."""
    group = group if group is not None else _world(ctx)
    require_chunks(model_state)
    tmp = _agree_on_folder(ctx, root, step)
    try:  # DCP reports any rank's write error on every rank
        dcp.save(_tensors(model_state, optimizer_state), storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                 process_group=group)
        final = seal(ctx, root, step, tmp, {**extra, "param_groups": optimizer_state["param_groups"]}, meta, keep_last)
    except (OSError, RuntimeError, CheckpointException) as exc:
        raise checkpoint.save_failed(root, step, tmp, exc) from exc
    if ctx.is_distributed:
        dist.barrier(group=group)
    return final


def load(ctx, path: str | Path, model_state: dict, optimizer_state: dict) -> dict:
    """Read a dcp checkpoint into this rank's templates (collective). ``model_state`` and
    ``optimizer_state["state"]`` must hold tensors of this run's layout (sharded or not, all of the model
    or only what this rank holds): DCP fills them in place, reading whichever slices of whichever files
    this rank's chunks need. Returns the same ``saved`` dict a full checkpoint gives (model, optimizer,
    scaler, sampler, rng, meta, train) for what this rank holds: ``model`` and the optimizer's ``state``
    and ``param_groups`` name this rank's parameters; ``model_names`` names every parameter the
    checkpoint holds."""
    path = Path(path)
    if ctx.is_main and (problem := checkpoint.verify(path)):
        raise CheckpointError(f"checkpoint {path.name} does not verify: {problem}")
    tensors = _tensors(model_state, optimizer_state)
    require_chunks(tensors)
    reader = SafeReader(str(path))
    dcp.load(tensors, storage_reader=reader, process_group=_world(ctx))
    checkpoint.warn_if_advisories(stacklevel=3)
    extra = torch.load(path / EXTRA_FILE, map_location="cpu", weights_only=True)
    held = set(tensors["optimizer"])
    groups = [{**g, "params": [name for name in g["params"] if name in held]} for g in extra.pop("param_groups")]
    names = sorted(key[len("model."):] for key in reader.read_metadata().state_dict_metadata if key.startswith("model."))
    return {**extra, "model": tensors["model"], "model_names": names,
            "optimizer": {"state": tensors["optimizer"], "param_groups": groups}}


def is_dcp(path: str | Path) -> bool:
    """Whether a checkpoint folder was written by the dcp writer (its manifest says so)."""
    return checkpoint.read_manifest(path).get("writer") == "dcp"


class _SnapshotWriter(dcp.FileSystemWriter):
    """DCP's file writer for a state that is already a private snapshot: DCP's own staging step (a
    second copy of everything) is skipped."""

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass


class AsyncSave:
    """``dcp.async_save`` with the folder protocol: training continues while the shards are written.

    ``start`` snapshots the state into buffers kept from one save to the next (a copy is needed:
    training changes the tensors in place; reusing the buffers avoids fresh allocations) and hands it
    to DCP's background thread, whose collectives use :attr:`group`, a gloo group of its own. The
    folder is sealed (hashes, manifest, rename) once the write has finished, by :meth:`wait`: before the
    next save, and at the end.
    """

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.group = dist.new_group(backend="gloo") if ctx.is_distributed else None  # collective
        self.pending = None
        self._buffers = None

    def start(self, root: str, step: int, model_state: dict, optimizer_state: dict, extra: dict, meta: dict,
              keep_last: int = 3) -> float:
        """Begin a save; returns the seconds training was held up (the snapshot and the hand-over)."""
        started = time.perf_counter()
        self.wait()  # the buffers are free again only when the previous write is done
        tmp = _agree_on_folder(self.ctx, root, step)
        self._buffers = _snapshot(_tensors(model_state, optimizer_state), self._buffers)
        require_chunks(self._buffers)
        if self.ctx.device.type == "cuda":  # the copies into page-locked memory run asynchronously
            torch.cuda.current_stream(self.ctx.device).synchronize()
        future = dcp.async_save(self._buffers, storage_writer=_SnapshotWriter(str(tmp), sync_files=True),
                                process_group=self.group)
        extra = {**extra, "param_groups": optimizer_state["param_groups"]}
        self.pending = (future, root, step, tmp, extra, meta, keep_last)
        return time.perf_counter() - started

    def wait(self) -> Path | None:
        """Wait for the pending save and seal it."""
        if self.pending is None:
            return None
        future, root, step, tmp, extra, meta, keep_last = self.pending
        self.pending = None
        future.result()  # rank 0's finishes last: DCP's coordinator writes .metadata after every rank's shards
        return seal(self.ctx, root, step, tmp, extra, meta, keep_last)


def _snapshot(tree, buffers=None):
    """A host copy of every tensor in ``tree``, into ``buffers`` (the previous snapshot) where shapes
    allow. A tensor on a GPU is copied to page-locked host memory (device to host, asynchronously: wait
    for the stream before reading it). A DTensor, like a :class:`~ddpkit.parallel.chunks.Chunked`, becomes
    the chunk this rank holds, on the host: what DCP writes for it either way."""
    if isinstance(tree, dict):
        return {k: _snapshot(v, buffers.get(k) if isinstance(buffers, dict) else None) for k, v in tree.items()}
    if not torch.is_tensor(tree):
        return tree
    if hasattr(tree, "to_local") and not dcp_takes_chunks():  # an older torch: DCP's own way, a DTensor on the host
        return tree.detach().to("cpu")
    if isinstance(tree, Chunked) or hasattr(tree, "to_local"):
        sources = tree.pieces if isinstance(tree, Chunked) else \
            [(tuple(c.offsets), tree.to_local()) for c in tree.__create_chunk_list__()]
        previous = buffers.pieces if isinstance(buffers, Chunked) and len(buffers.pieces) == len(sources) else None
        pieces = [(offsets, _host_copy(piece, previous[i][1] if previous else None))
                  for i, (offsets, piece) in enumerate(sources)]
        return Chunked(tree.shape, pieces, tree.dtype, "cpu")
    return _host_copy(tree, buffers)


def _host_copy(tensor: torch.Tensor, buffer) -> torch.Tensor:
    tensor = tensor.detach()
    reusable = type(buffer) is torch.Tensor and buffer.shape == tensor.shape and buffer.dtype == tensor.dtype
    if not reusable:
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    return buffer.copy_(tensor, non_blocking=tensor.is_cuda)


def folder_bytes(path: str | Path) -> int:
    """Bytes of every file in a checkpoint folder."""
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def async_save_beside_training(ctx, root: str, own_group: bool, steps: int = 200, numel: int = 4_000_000) -> int:
    """Start ``dcp.async_save`` of a ``numel``-element tensor, then all-reduce a small tensor ``steps``
    times as training would, checking every result (a function for ``ddpkit.launch``). With
    ``own_group`` the save's collectives run on a new gloo group; without, on the default group that
    training uses, where gloo matches the two streams' messages in the wrong order: expect a crash
    or a timeout. Returns the number of correct all-reduces."""
    group = dist.new_group(backend="gloo") if own_group else None
    future = dcp.async_save({"w": torch.randn(numel)}, storage_writer=dcp.FileSystemWriter(root), process_group=group)
    for step in range(steps):
        t = torch.ones(1000)
        dist.all_reduce(t)
        if t[0].item() != ctx.world_size:
            raise RuntimeError(f"all_reduce returned {t[0].item()} instead of {ctx.world_size} at step {step}")
    future.result()
    return steps
