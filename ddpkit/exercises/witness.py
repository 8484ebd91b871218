"""What the learner's code really runs, seen from inside the process that runs it.

* :func:`watch`: the implementations an exercise must not use (the kit's own answer, the PyTorch
  feature it rebuilds) are made to report every call. Each function's code is swapped for a small
  trampoline that raises the audit event ``ddpkit.forbidden`` and then runs the original; the process's
  :func:`~ddpkit.exercises.confine.install_guard` records the event. The function object itself keeps its
  identity, so every alias, re-export, subclass, ``functools.partial``, thread, callback or ``exec``'d
  caller reaches the trampoline; the learner's code may not swap the code back, read it, or import the
  module again (the guard refuses all three). It is done in the process that runs the learner's code
  before that code is loaded, and the grader's own code calls none of them there afterwards: any call
  is the learner's.
* :class:`Collectives`: a ``TorchDispatchMode`` that records every ``c10d`` operation (``allreduce_``,
  ``send``, ``recv_``, ``broadcast_``...) with its bytes. Every way to reach a collective from Python
  (``dist.all_reduce``, an alias, the process group's own ``allreduce``, functional collectives, a
  ``batch_isend_irecv``) goes through the dispatcher; a blocking ``send`` is one ``send`` operation, not
  two. Each operation's completion time is recorded from its work's future. (A dispatch mode belongs to
  the thread that entered it.)
* :func:`watch_files`: ``fsync`` and friends report the file they forced to disk; renames are seen by the
  guard from the ``os.rename`` audit event, which every way of renaming raises.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import time
import types
import warnings
from typing import Any

import torch

SUBMISSION_MODULE = "submission"  # the learner's code runs as this module inside the sandbox


def resolve(ref: str) -> Any | None:
    """``"package.module:Qual.name"`` to the object, or None where this torch or ddpkit lacks it."""
    module_name, _, qualname = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj


def functions_of(obj: Any) -> list[types.FunctionType]:
    """The Python functions behind ``obj``: a function and every function it wraps, or a class's own
    methods (static, class and plain)."""
    found: list[types.FunctionType] = []
    if inspect.isclass(obj):
        for value in vars(obj).values():
            value = getattr(value, "__func__", value)
            if inspect.isfunction(value):
                found += functions_of(value)
        return found
    obj = getattr(obj, "__func__", obj)
    seen = set()
    while inspect.isfunction(obj) and id(obj) not in seen:
        seen.add(id(obj))
        found.append(obj)
        obj = getattr(obj, "__wrapped__", None)
    return found


@functools.lru_cache(maxsize=None)
def _trampoline(nfree: int) -> types.CodeType:
    """``def f(*args, **kwargs): AUDIT(EVENT, LABEL, args[0]); return ORIGINAL(*args, **kwargs)`` with ``nfree``
    unused free variables (a function's new code must have as many as its closure has cells). The four
    names are string constants here, replaced by the objects themselves in each copy."""
    names = [f"_cell{i}" for i in range(nfree)]
    source = "def _outer():\n" + "".join(f"    {n} = None\n" for n in names)
    source += "    def _watched(*args, **kwargs):\n"
    if names:
        source += "        if False:\n            " + ", ".join(names) + "\n"
    source += "        '__AUDIT__'('__EVENT__', '__LABEL__', args[0] if args else None)\n"
    source += "        return '__ORIGINAL__'(*args, **kwargs)\n"
    source += "    return _watched\n"
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "'str' object is not callable": it will be a function
        exec(compile(source, __file__, "exec"), namespace)
    return namespace["_outer"]().__code__


def _watch_one(fn: types.FunctionType, label: str, event: str = "ddpkit.forbidden") -> None:
    original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    original.__kwdefaults__, original.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    code = _trampoline(len(fn.__code__.co_freevars))
    values = {"__AUDIT__": sys.audit, "__EVENT__": event, "__LABEL__": label, "__ORIGINAL__": original}
    fn.__code__ = code.replace(co_consts=tuple(values.get(c, c) if type(c) is str else c for c in code.co_consts),
                               co_name=fn.__code__.co_name, co_qualname=fn.__code__.co_qualname)


def watch(forbidden: dict[str, str]) -> tuple[frozenset[str], frozenset[int]]:
    """Make every function of the implementations ``{ref: sentence}`` raise ``ddpkit.forbidden`` with its
    sentence when called; return (their module files, the functions' ids) for the guard."""
    files, ids = set(), set()
    for ref, label in forbidden.items():
        obj = resolve(ref)
        for fn in functions_of(obj) if obj is not None else []:
            if getattr(fn, "_ddpkit_watched", False):
                continue
            files.add(fn.__code__.co_filename)
            _watch_one(fn, label)
            fn._ddpkit_watched = True
            ids.add(id(fn))
    return frozenset(files), frozenset(ids)


def watch_threads() -> tuple[frozenset[str], frozenset[int]]:
    """``threading.Thread.start`` raises ``ddpkit.thread`` (with the thread) before it starts one, and the
    new thread raises ``ddpkit.thread_run`` (with itself) before it runs its target: the guard marks a
    thread started while the learner's code was running as the learner's, whatever function it runs (a
    thread pool's worker included). Returns (files, ids) as :func:`watch` does."""
    import threading

    start, bootstrap = threading.Thread.start, threading.Thread._bootstrap_inner
    _watch_one(start, "thread", "ddpkit.thread")
    _watch_one(bootstrap, "thread", "ddpkit.thread_run")
    return frozenset({start.__code__.co_filename}), frozenset({id(start), id(bootstrap)})


def watch_files() -> None:
    """``os.fsync``, ``os.fdatasync`` and ``os.sync`` (and their ``posix`` originals) raise ``ddpkit.fsync``
    with the file forced to disk, or ``ddpkit.sync``; installed before the learner's code is loaded, so
    ``from os import fsync`` gets them too. ``pathlib`` and ``shutil`` go through them."""
    import os
    import posix

    def wrap_fd(original):
        def wrapper(fd, *args, **kwargs):
            result = original(fd, *args, **kwargs)
            number = fd if isinstance(fd, int) else fd.fileno()
            try:
                sys.audit("ddpkit.fsync", os.readlink(f"/proc/self/fd/{number}"))
            except OSError:
                sys.audit("ddpkit.fsync", "?")
            return result
        return wrapper

    original_sync = os.sync

    def sync():
        original_sync()
        sys.audit("ddpkit.sync")

    fsync, fdatasync = wrap_fd(os.fsync), wrap_fd(os.fdatasync)
    for module in (os, posix):
        module.fsync, module.fdatasync, module.sync = fsync, fdatasync, sync


def unsynced_renames(events: list[list[str]]) -> list[str]:
    """Targets renamed into place before their source file was forced to disk (no fsync of it, no sync),
    from the guard's ``file`` events in order: ``["fsync", path]``, ``["sync"]``, ``["rename", src, dst]``."""
    synced, bad = set(), []
    for parts in events:
        if parts[0] == "sync":
            synced.add("*")
        elif parts[0] == "fsync" and len(parts) > 1:
            synced.add(parts[1])
        elif parts[0] == "rename" and len(parts) > 2:
            if parts[1] not in synced and "*" not in synced:
                bad.append(parts[2])
            synced.discard(parts[1])
            synced.discard("*")
    return bad


class Collectives:
    """Records every c10d operation issued while active (see the module docstring)."""

    def __init__(self) -> None:
        self.ops: list[dict] = []
        self._mode = None

    def __enter__(self) -> "Collectives":
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops

        class _Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                started = time.perf_counter()
                out = func(*args, **(kwargs or {}))
                if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
                    name = func.__name__.split(".")[0].rstrip("_")
                    record = {"op": name, "bytes": _tensor_bytes(args), "launched": started, "done": None}
                    ops.append(record)
                    work = out[-1] if isinstance(out, tuple) and out else None
                    if isinstance(work, torch.ScriptObject):
                        _on_completion(work, record)
                return out

        self._mode = _Recorder()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def names(self) -> list[str]:
        return [op["op"] for op in self.ops]

    def sent_bytes(self) -> int:
        return sum(op["bytes"] for op in self.ops if op["op"] == "send")


def _tensor_bytes(args) -> int:
    total = 0
    for arg in args:
        if isinstance(arg, torch.Tensor):
            total += arg.numel() * arg.element_size()
        elif isinstance(arg, (list, tuple)):
            total += _tensor_bytes(arg)
    return total


def _on_completion(work, record: dict) -> None:
    """Stamp ``record["done"]`` when the work's future completes (in the backend's thread)."""
    try:
        from torch.distributed.distributed_c10d import Work

        future = Work.unbox(work).get_future()
        future.then(lambda _: record.__setitem__("done", time.perf_counter()))
    except Exception:  # noqa: BLE001 - an older torch without Work.unbox: completion times stay unknown
        pass


COLLECTIVE_OPS = frozenset({"allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
                            "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
                            "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce", "gather", "scatter",
                            "alltoall", "alltoall_base", "all_reduce", "all_gather_into_tensor",
                            "reduce_scatter_tensor", "all_to_all_single", "broadcast_"})
