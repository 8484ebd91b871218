"""What the learner's code really runs, seen from inside the process that runs it.

Two witnesses, both installed by the sandbox before the learner's code is imported, so that no alias
taken at import time escapes them:

* :class:`ForbiddenCalls`: a ``sys.settrace`` function that notices when a function of the kit's own
  answer (``ddpkit.parallel.comm.ring_all_reduce``...) or of the PyTorch feature an exercise rebuilds
  (``DistributedDataParallel.__init__``...) starts running **on behalf of the learner's code** (a frame
  of the submission is on the stack). It keys functions by file, name and first line, so a re-import,
  an alias or a subclass of the forbidden function is the same function; only the call event is
  traced, never lines.
* :class:`Collectives`: a ``TorchDispatchMode`` that records every ``c10d`` operation (``allreduce_``,
  ``send``, ``recv_``, ``broadcast_``...) with its bytes. Every way to reach a collective from Python
  (``dist.all_reduce``, an alias of it, the process group's own ``allreduce``, functional collectives,
  a ``batch_isend_irecv``) goes through the dispatcher, so none escapes it; a blocking ``send`` is one
  ``send`` operation, not two. Each operation's completion time is recorded from its work's future.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
import time
from typing import Any

import torch

SUBMISSION_MODULE = "submission"  # the learner's code runs as this module inside the sandbox


class Refused(Exception):
    """Raised in the learner's call stack when it reaches a forbidden implementation."""


def _code_objects(obj: Any) -> list:
    """Every function code object of a function, a method, or a class and its own methods."""
    if inspect.isclass(obj):
        found = []
        for value in vars(obj).values():
            value = inspect.unwrap(getattr(value, "__func__", value))
            if inspect.isfunction(value):
                found.append(value.__code__)
        return found
    obj = inspect.unwrap(getattr(obj, "__func__", obj))  # decorated collectives share their wrapper's code
    return [obj.__code__] if inspect.isfunction(obj) else []


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


def _key(code) -> tuple[str, str, int]:
    return (code.co_filename, code.co_name, code.co_firstlineno)


class ForbiddenCalls:
    """Notices calls, made by the learner's code, into the forbidden implementations ``{ref: label}``."""

    def __init__(self, forbidden: dict[str, str], learner_files: set[str], log: str | None = None) -> None:
        self.log = log  # every process (ranks are forked) appends what it saw here
        self.labels: dict[tuple[str, str, int], str] = {}
        for ref, label in forbidden.items():
            obj = resolve(ref)
            for code in _code_objects(obj) if obj is not None else []:
                self.labels[_key(code)] = label
        self.learner_files = set(learner_files)
        self.hits: list[str] = []

    def label_of(self, obj: Any) -> str | None:
        """The sentence for a contract object that *is* a forbidden implementation (or a partial of one, or
        a class built on one): the check calls it directly, so no frame of the learner's is on the stack."""
        obj = getattr(obj, "func", obj)  # functools.partial
        for cls in inspect.getmro(obj) if inspect.isclass(obj) else (obj,):
            for code in _code_objects(cls):
                label = self.labels.get(_key(code))
                if label is not None:
                    return label
        return None

    def _from_learner(self, frame) -> bool:
        while frame is not None:
            if frame.f_code.co_filename in self.learner_files:
                return True
            frame = frame.f_back
        return False

    def _trace(self, frame, event, arg):  # the global trace function: call events only
        if event == "call" and self.labels:
            label = self.labels.get(_key(frame.f_code))
            if label is not None and self._from_learner(frame.f_back) and label not in self.hits:
                self.hits.append(label)
                note(self.log, "forbidden", label)
        return None

    def install(self) -> None:
        sys.settrace(self._trace)
        threading.settrace(self._trace)

    def still_installed(self) -> bool:
        return sys.gettrace() == self._trace


def note(log: str | None, kind: str, text: str) -> None:
    """Append one finding to the sandbox's log of findings (shared by its ranks)."""
    if log:
        with open(log, "a") as handle:
            handle.write(f"{kind}\t{text}\n")


def findings(log: str) -> list[tuple[str, str]]:
    try:
        with open(log) as handle:
            return [tuple(line.rstrip("\n").split("\t", 1)) for line in handle if "\t" in line]
    except OSError:
        return []


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


FILE_LOG_ENV = "DDPKIT_FILE_LOG"  # where the file witness writes, while a check wants it


def install_file_witness() -> None:
    """Wrap ``os.fsync``, ``os.fdatasync``, ``os.sync``, ``os.replace`` and ``os.rename`` (before the learner's
    code is imported, so ``from os import fsync`` gets the wrapper too): while ``DDPKIT_FILE_LOG`` names a
    file, each call appends ``fsync <path>``, ``sync`` or ``rename <src> <dst>`` to it, in call order.
    ``pathlib``'s ``replace``/``rename`` and ``shutil.move`` go through these functions."""
    import os

    def log(line: str) -> None:
        path = os.environ.get(FILE_LOG_ENV)
        if path:
            with open(path, "a") as handle:
                handle.write(line + "\n")

    def wrap_fd(original):
        def wrapper(fd, *args, **kwargs):
            result = original(fd, *args, **kwargs)
            number = fd if isinstance(fd, int) else fd.fileno()
            try:
                log(f"fsync\t{os.readlink(f'/proc/self/fd/{number}')}")
            except OSError:
                log("fsync\t?")
            return result
        return wrapper

    def wrap_rename(original):
        def wrapper(src, dst, *args, **kwargs):
            result = original(src, dst, *args, **kwargs)
            log(f"rename\t{os.path.realpath(os.fsdecode(src))}\t{os.path.realpath(os.fsdecode(dst))}")
            return result
        return wrapper

    original_sync = os.sync

    def sync():
        original_sync()
        log("sync")

    os.fsync, os.fdatasync, os.sync = wrap_fd(os.fsync), wrap_fd(os.fdatasync), sync
    os.replace, os.rename = wrap_rename(os.replace), wrap_rename(os.rename)


def unsynced_renames(log_path: str) -> list[str]:
    """Targets renamed into place before their source file was forced to disk (no fsync of it, no sync)."""
    synced, bad = set(), []
    try:
        with open(log_path) as handle:
            lines = [line.rstrip("\n").split("\t") for line in handle]
    except OSError:
        return []
    for parts in lines:
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
