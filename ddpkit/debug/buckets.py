"""How DDP groups gradients into buckets, and what the bucket size costs: the rule, checked on real ranks.

DDP does not all-reduce each gradient on its own: it copies gradients into **buckets** and launches one
all-reduce per bucket as soon as every gradient in it is ready, while backward goes on with the earlier
layers. ``bucket_cap_mb`` (MiB, 25 by default) sets the size a bucket is closed at. Small buckets start
communicating early and overlap more with backward, but pay a fixed cost per all-reduce; large buckets
pay it rarely but wait longer (one bucket for the whole model cannot start before backward ends).

What torch 2.13 does (``torch/nn/parallel/distributed.py`` and ``torch/csrc/distributed/c10d/reducer.cpp``):

* the first iteration runs with a single bucket (unless ``find_unused_parameters`` or ``static_graph``):
  the order in which gradients become ready is not known before a backward has run;
* after it, the reducer rebuilds the buckets in the order the gradients became ready (``rebuild_buckets``):
  a bucket is closed as soon as it holds at least its limit, so a bucket can overshoot the limit by up to
  one parameter. The limits are ``[first_bucket_bytes_cap, bucket_bytes_cap]``: the first bucket, which
  holds the gradients ready first (an MLP's last layers), has its own limit, the others the cap;
* the first bucket's limit is the **first-bucket rule**, in ``_BucketCapacityConfig.create``::

      # First bucket optimization: use smaller size when using defaults
      # to reduce latency for early-computed gradients
      first_bucket_bytes_cap = (
          dist._DEFAULT_FIRST_BUCKET_BYTES if is_using_default else bucket_bytes_cap
      )

  ``dist._DEFAULT_FIRST_BUCKET_BYTES`` is 1 MiB (1048576); ``is_using_default`` is True when
  ``bucket_cap_mb`` was left unset. So with the default the first all-reduce starts after 1 MiB of
  gradients, not 25; a ``bucket_cap_mb`` you set applies to every bucket, the first included.

:func:`planned_sizes` computes the buckets from that rule; :func:`built_buckets` reads the ones DDP built
from its logging data (``rebuilt_bucket_sizes``); they must be equal. :func:`sweep` measures step time
and the overlapped fraction (see :mod:`ddpkit.debug.timeline`) against ``bucket_cap_mb``, as Stanford
CS336's assignment 2 benchmarks it.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.debug import timeline

MIB = 1024 * 1024


def planned_sizes(param_bytes: list[int], cap_bytes: int, first_cap_bytes: int) -> list[int]:
    """Bucket sizes in bytes for gradients of ``param_bytes`` (in the order they become ready): greedy, a
    bucket closes once it holds at least its limit; the first bucket's limit is ``first_cap_bytes``."""
    sizes, current = [], 0
    for nbytes in param_bytes:
        current += nbytes
        if current >= (first_cap_bytes if not sizes else cap_bytes):
            sizes.append(current)
            current = 0
    return sizes + ([current] if current else [])


def mlp(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def first_bucket_cap(model: DDP) -> int:
    """The first bucket's limit in bytes, as this DDP holds it (torch 2.13: ``_bucket_config``)."""
    config = getattr(model, "_bucket_config", None)
    if config is None:
        raise RuntimeError(f"torch {torch.__version__}'s DDP keeps no _bucket_config: this lesson reads the "
                           "first-bucket rule from torch 2.13's DistributedDataParallel")
    return config.first_bucket_bytes_cap


def built_buckets(ctx, caps: list[float | None], width: int = 256, depth: int = 6, batch: int = 16) -> list[dict]:
    """For each ``bucket_cap_mb`` in ``caps`` (None: DDP's default): wrap the MLP in DDP, run three
    backward passes (the buckets are rebuilt before the second forward; DDP's logging data has them once
    a backward has run on them), and report DDP's buckets next to the planned ones."""
    rows = []
    x = torch.randn(batch, width)
    for cap in caps:
        model = DDP(mlp(width, depth), bucket_cap_mb=cap, process_group=ctx.dp_group)
        for _ in range(3):
            model(x).square().mean().backward()
        data = model._get_ddp_logging_data()
        ready_order = [p.numel() * p.element_size() for p in reversed(list(model.parameters()))]
        built = [int(s) for s in str(data["rebuilt_bucket_sizes"]).split(",")]
        rows.append({"bucket_cap_mb": cap, "cap_bytes": model.bucket_bytes_cap, "first_cap_bytes": first_bucket_cap(model),
                     "built": built, "first_iteration": [int(s) for s in str(data["bucket_sizes"]).split(",")],
                     "planned": planned_sizes(ready_order, model.bucket_bytes_cap, first_bucket_cap(model)),
                     "planned_without_first_rule": planned_sizes(ready_order, model.bucket_bytes_cap, model.bucket_bytes_cap),
                     "param_bytes": sum(ready_order)})
    return rows


def sweep(ctx, caps: list[float | None], steps: int = 20, warmup: int = 3, width: int = 1024, depth: int = 8,
          batch: int = 64, profiled: int = 3) -> list[dict]:
    """Step time and overlapped fraction against ``bucket_cap_mb``, on this rank.

    One DDP model per cap (same weights), one step of each in turn, so that a noisy machine slows all
    alike; then ``profiled`` steps of each under ``torch.profiler`` for the overlapped fraction (the
    profiler slows the steps, so they are not timed)."""
    models = {cap: DDP(mlp(width, depth), bucket_cap_mb=cap, process_group=ctx.dp_group) for cap in caps}
    opts = {cap: torch.optim.SGD(m.parameters(), lr=1e-3) for cap, m in models.items()}
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(ctx.rank))

    def step(cap):
        models[cap](x).square().mean().backward()
        opts[cap].step()
        opts[cap].zero_grad()

    times: dict = {cap: [] for cap in caps}
    for i in range(warmup + steps):
        for cap in caps:
            dist.barrier(group=ctx.dp_group)  # every rank starts the step together: time the step, not the skew
            started = time.perf_counter()
            step(cap)
            if i >= warmup:
                times[cap].append(time.perf_counter() - started)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for cap in caps:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(profiled):
                    step(cap)
            path = os.path.join(folder, f"rank{ctx.rank}.trace.json")
            prof.export_chrome_trace(path)
            spans = timeline.intervals(path)
            data = models[cap]._get_ddp_logging_data()
            rows.append({"bucket_cap_mb": cap, "step_s": times[cap],
                         "overlapped_fraction": timeline.overlapped_fraction(spans["compute"], spans["comm"]),
                         "comm_s_per_step": sum(b - a for a, b in spans["comm"]) / profiled,
                         "buckets": len(str(data["rebuilt_bucket_sizes"]).split(","))})
    return rows
