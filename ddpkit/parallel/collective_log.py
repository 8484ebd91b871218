"""Count the collectives a library issues through ``torch.distributed``, by phase, dtype, bytes and group.

:class:`CollectiveLog` wraps the functions FSDP2 calls (``all_gather_into_tensor`` and its newer name
``all_gather_single``, ``reduce_scatter_tensor`` / ``reduce_scatter_single``, ``all_reduce``) while it
is active, and records each call's phase (set by the caller), the dtype and size of what this rank
sends, and the size of its group. It counts the outermost call only, so a function implemented through
another is counted once. It sees calls made as ``dist.NAME(...)`` at call time, which is how FSDP2's
``_fsdp_collectives`` calls them; DTensor's functional collectives bypass these functions (torch's
``CommDebugMode`` counts those).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch.distributed as dist

COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_reduce")
KIND = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
        "all_reduce": "all_reduce"}


class CollectiveLog:
    """Records every collective FSDP2 (or anything else) issues through ``torch.distributed`` while active.

    ``phase`` is set by the caller (``with log.during("forward"): ...``); each record is a dict
    ``{"phase", "op", "dtype", "numel", "bytes", "group_size"}`` where ``bytes`` is what this rank
    sends in (its input). Works only on functions looked up as ``dist.NAME`` at call time, which is how
    FSDP2 calls them.
    """

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.phase = "setup"
        self._depth = 0
        self._saved: dict = {}

    def __enter__(self) -> "CollectiveLog":
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    @contextmanager
    def during(self, phase: str):
        self.phase = phase
        try:
            yield self
        finally:
            self.phase = "idle"

    def mark(self, event: str, **info) -> None:
        """Put a non-collective event (a module's forward starting, say) in order among the records."""
        self.records.append({"phase": self.phase, "op": event, **info})

    def _wrap(self, name, fn):
        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            if self._depth == 0:
                bound = signature.bind(*args, **kwargs).arguments
                sent = next(bound[k] for k in ("input_tensor", "input", "tensor") if k in bound)
                group = bound.get("group")
                self.records.append({"phase": self.phase, "op": KIND[name], "dtype": str(sent.dtype).replace("torch.", ""),
                                     "numel": sent.numel(), "bytes": sent.numel() * sent.element_size(),
                                     "group_size": dist.get_world_size(group)})
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def count(self, op: str, phase: str | None = None) -> int:
        return sum(r["op"] == op and (phase is None or r["phase"] == phase) for r in self.records)

    def step_records(self, op: str) -> list[dict]:
        """The records of ``op`` issued by forward, backward or the optimizer (not between steps)."""
        return [r for r in self.records if r["op"] == op and r["phase"] in ("forward", "backward", "optimizer")]
