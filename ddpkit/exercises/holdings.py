"""What a rank keeps alive, counted by the grader from the outside of the learner's objects.

Walking from the learner's optimizer or wrapper misses what it hides elsewhere: in a closure, a default
argument, a class attribute, a module global, another module, a thread. So the count starts from the
garbage collector instead, which tracks every tensor (and every container) wherever it is referenced
from Python. :func:`baseline`, taken before the learner's object exists, freezes what is alive then
(``gc.freeze``: the grader's model, its data, torch's own objects) out of the collector's lists; after
the learner's code ran, :func:`held_bytes` counts every tensor created since, each storage once by its
bytes, plus NumPy arrays, byte buffers and long lists of floats that the objects created since, or any
module, hold. The grader names tensors to leave out (the parameters, their gradients, its own data) and
tensors whose values a kept buffer may copy (the flat parameters, the flat gradients: keeping a buffer
of them is a layout choice, not state).

The learner's code is refused the collector's lists (:mod:`ddpkit.exercises.confine`); the grader calls
them here, after the learner's code has returned. Code that freezes or unfreezes the collector's objects
itself changes the frozen count, which :func:`held_bytes` checks.
"""

from __future__ import annotations

import gc
import sys

import torch

LIST_MIN = 64  # a list or tuple of at least this many floats counts as data (8 bytes each)
BUFFER_MIN = 1024  # bytes, bytearrays and arrays from this size on


class Tampered(Exception):
    """The collector's frozen objects changed between the baseline and the count."""


def warm_up() -> None:
    """Run what an optimizer's first step imports lazily (torch's compiler stack and what it pulls in), so
    that the modules it loads are there before the baseline, not counted after it."""
    layer = torch.nn.Linear(2, 2)
    for optimizer in (torch.optim.AdamW(layer.parameters()), torch.optim.SGD(layer.parameters(), lr=0.1)):
        torch.nn.functional.cross_entropy(layer(torch.ones(3, 2)), torch.tensor([0, 1, 0])).backward()
        optimizer.step()
        optimizer.zero_grad()


def baseline(keep: list = ()) -> dict:
    """Freeze what is alive now; remember the storages of ``keep`` (the grader's own tensors, whose views
    the learner's code may make: a view is not new memory). The sandbox ran :func:`warm_up` before it
    forked: what an optimizer imports lazily is there already."""
    gc.freeze()
    kinds: dict = {}
    return {"frozen": gc.get_freeze_count(), "storages": {_storage(t)[0] for t in keep if _is_tensor(t, kinds)},
            "module_data": {id(item) for item in _module_values() if _data_bytes(item)}}


def held_bytes(since: dict, leave_out: list = (), copies: tuple = ()) -> int:
    """Bytes alive now that were not at ``since``: storages of tensors made since (less ``leave_out``'s and
    those holding a copy of one of ``copies``, a flat vector, at any offset, padding zeros allowed), and
    the arrays, buffers and float lists described in the module docstring."""
    gc.collect()
    if gc.get_freeze_count() > since["frozen"]:  # frozen objects can die, but none may join them
        raise Tampered("the garbage collector's frozen objects changed while the learner's code ran")
    objects = gc.get_objects()  # everything tracked since the baseline (the rest is frozen)
    kinds: dict = {}
    skip = set(since["storages"]) | {_storage(t)[0] for t in leave_out if _is_tensor(t, kinds)}
    flat = [c.detach().reshape(-1).float() for c in copies if c.numel()]
    seen, total, counted = set(), 0, set(since["module_data"])  # data modules held before: not the learner's
    for obj in objects:
        if _is_tensor(obj, kinds):
            ptr, nbytes = _storage(obj)
            if ptr in skip or ptr in seen or not nbytes:
                continue
            seen.add(ptr)
            values = _values(obj)
            if values is not None and any(_copies(values, c) for c in flat):
                continue
            total += nbytes
        else:  # what the objects made since the baseline hold
            total += _count(obj, counted)
            for item in gc.get_referents(obj):
                total += _count(item, counted)
    for item in _module_values():  # and what any module holds
        total += _count(item, counted)
    return total


def _module_values() -> list:
    return [item for module in list(sys.modules.values()) for item in list(getattr(module, "__dict__", {}).values())]


def _count(item, counted: set) -> int:
    size = _data_bytes(item)
    if size and id(item) not in counted:
        counted.add(id(item))
        return size
    return 0


def _is_tensor(obj, kinds: dict) -> bool:
    kind = type(obj)
    found = kinds.get(kind)
    if found is None:
        found = kinds[kind] = issubclass(kind, torch.Tensor)
    return found


def _storage(tensor) -> tuple[int, int]:
    """(data pointer, bytes) of a tensor's storage."""
    with torch._C.DisableTorchFunctionSubclass():  # a subclass's own methods do not run here
        try:
            storage = torch.Tensor.untyped_storage(tensor)
            return storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            return id(tensor), 0


def _values(tensor) -> torch.Tensor | None:
    """All of a floating-point tensor's storage, as one flat float32 vector (None for other dtypes)."""
    with torch._C.DisableTorchFunctionSubclass():
        try:
            dtype = tensor.dtype
            storage = torch.Tensor.untyped_storage(tensor)
            if not dtype.is_floating_point or storage.nbytes() % torch.empty((), dtype=dtype).element_size():
                return None
            return torch.empty(0, dtype=dtype).set_(storage).float()
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            return None


def _copies(values: torch.Tensor, ref: torch.Tensor) -> bool:
    """Is ``values`` a slice of ``ref`` (padded with zeros past its end)?"""
    n = values.numel()
    if n == 0:
        return True
    if n > ref.numel() + n // 2:
        return False
    padded = torch.cat([ref, torch.zeros(n)])
    starts = (padded[:ref.numel()] == values[0]).nonzero().flatten()[:64].tolist()
    return any(torch.equal(padded[s:s + n], values) for s in starts)


_KINDS: dict = {}  # type -> "array", "buffer", "sequence" or "" (not data): asked once per type


def _kind(kind) -> str:
    found = _KINDS.get(kind)
    if found is None:
        module, name = getattr(kind, "__module__", ""), getattr(kind, "__name__", "")
        found = _KINDS[kind] = ("array" if (module, name) == ("numpy", "ndarray") else
                                "buffer" if kind in (bytes, bytearray) or (module, name) == ("array", "array") else
                                "sequence" if kind in (list, tuple) else "")
    return found


def _data_bytes(item) -> int:
    kind = _kind(type(item))
    if not kind:
        return 0
    if kind == "array":
        return int(item.nbytes) if item.base is None and item.nbytes >= BUFFER_MIN else 0
    if kind == "buffer":
        size = len(item) * getattr(item, "itemsize", 1)
        return size if size >= BUFFER_MIN else 0
    if len(item) >= LIST_MIN and all(type(x) is float for x in item):
        return 8 * len(item)
    return 0
