"""One optimizer step: forward, backward, gradient sync, clipping, update.

:func:`train_step` runs one step over ``grad_accum`` micro-batches:

* every micro-batch's loss is divided by ``grad_accum`` and the data-parallel strategy averages over
  replicas, so the step's gradient is the mean over the whole global batch: the same gradient as one
  big batch;
* the strategy runs the micro-batches and skips gradient sync for all but the last one (for DDP:
  forward **and** backward inside ``no_sync()``; see ``parallel/base.py``);
* AMP: ``bf16`` autocast needs no scaler (bf16 has fp32's exponent range); ``fp16`` needs
  ``GradScaler``, and gradients are **unscaled before clipping** (clipping scaled gradients clips at
  the wrong threshold). Where ranks hold different parts of the gradients (tensor or pipeline
  parallel, ZeRO-1, FSDP2) they agree whether any part overflowed before the scaler decides to skip
  the step (:meth:`~ddpkit.parallel.base.Strategy.agree_on_overflow`).

The step returns this rank's loss sum and sample ids. :func:`global_loss_sum` makes the global loss
every rank agrees on, each step (:class:`GlobalLossSum` is the same all-reduce for a loop that asks every
step, with its group and buffer found once); :func:`gather_sample_ids` collects the global sample ids (what
``data_sha256`` fingerprints) for a batch of steps at once, so the fingerprint costs no extra message
per step.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import torch
import torch.distributed as dist

from ddpkit.config import TrainConfig
from ddpkit.models import loss_fn
from ddpkit.parallel.base import Strategy
from ddpkit.runtime import RankContext

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PhaseTimer:
    """Accumulates wall time per phase: ``with timer("forward_s"): ...``. On a GPU it synchronises at
    phase ends (honest, not free). Phases may nest (a hook's ``data_s`` inside the step, the loss
    guard's ``sync_s`` inside ``optimizer_s``): each ``with`` times its own block.

    A plain class rather than ``contextlib.contextmanager``: a generator-based context costs about 5 us
    to enter and leave, and a step enters six of them (``benchmarks/trainer_overhead.py``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sync = device.type == "cuda"
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str) -> _Phase:
        return _Phase(self, phase)


class _Phase:
    """One timed block of a :class:`PhaseTimer`."""

    __slots__ = ("timer", "phase", "start")

    def __init__(self, timer: PhaseTimer, phase: str) -> None:
        self.timer, self.phase = timer, phase

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        timer = self.timer
        if timer.sync:
            torch.cuda.synchronize(timer.device)
        seconds = timer.seconds
        seconds[self.phase] = seconds.get(self.phase, 0.0) + time.perf_counter() - self.start


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of 0-based optimizer step ``step``: linear warm-up, then constant."""
    if cfg.warmup_steps == 0:
        return cfg.lr
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)


class MicroStep:
    """Forward and backward of one micro-batch, collecting its loss sum and sample ids: ``run(batch)``.

    The loss is the mean over the micro-batch divided by ``accum`` (so that the accumulated gradient is
    the mean over the step's samples), times ``loss_scale`` (0 for a warm-up pass). Its parts are
    methods of their own because a pipeline schedule runs them apart: a stage's forward and its
    backward at different times, the loss only on the last stage (``parallel/pipeline_strategy.py``).
    """

    def __init__(self, model: torch.nn.Module, scaler: torch.amp.GradScaler, cfg: TrainConfig,
                 device: torch.device, accum: int, timer: PhaseTimer, sums: list, ids: list) -> None:
        self.model, self.scaler, self.cfg, self.device = model, scaler, cfg, device
        self.accum, self.timer, self.sums, self.ids = accum, timer, sums, ids

    def __call__(self, batch: dict, loss_scale: float = 1.0) -> None:
        inputs, targets = self.to_device(batch)
        with self.timer("forward_s"), self.autocast():
            per_sample = loss_fn(self.model(inputs), targets, reduction="none")  # (B,)
            loss = self.loss(per_sample, loss_scale)
        self.backward(loss)
        self.record(per_sample.detach().sum(), batch)

    def to_device(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        with self.timer("h2d_s"):
            return (batch["inputs"].to(self.device, non_blocking=True),
                    batch["targets"].to(self.device, non_blocking=True))

    def autocast(self):
        """The config's mixed precision (bf16 or fp16 autocast), or nothing."""
        if self.cfg.amp == "off":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AMP_DTYPES[self.cfg.amp])

    def loss(self, per_sample: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor:
        """What backward starts from: the micro-batch mean / accum (x loss_scale)."""
        loss = per_sample.mean()
        if self.accum != 1:  # x / 1 == x exactly: skip the kernel
            loss = loss / self.accum
        if loss_scale != 1.0:
            loss = loss * loss_scale
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        with self.timer("backward_s"):
            self.scaler.scale(loss).backward()  # identity when the scaler is disabled

    def record(self, loss_sum: torch.Tensor, batch: dict) -> None:
        """Keep the micro-batch's loss sum (a tensor: read once per step) and its sample ids."""
        self.sums.append(loss_sum)
        self.ids.append(batch["index"])


def micro_step(model: torch.nn.Module, scaler: torch.amp.GradScaler, cfg: TrainConfig, device: torch.device,
               accum: int, timer: PhaseTimer, sums: list, ids: list) -> MicroStep:
    """A :class:`MicroStep`: a function that runs forward and backward of one micro-batch."""
    return MicroStep(model, scaler, cfg, device, accum, timer, sums, ids)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               micro_batches: list[dict], cfg: TrainConfig, device: torch.device,
               timer: PhaseTimer | None = None, strategy: Strategy | None = None,
               guard: Callable[[float, float], bool] | None = None) -> tuple[float, list[int]]:
    """One optimizer step. Returns (sum of per-sample losses on this rank, sample ids used here).

    ``strategy`` defaults to DDP's rule (``no_sync`` when the model is wrapped in DDP). ``guard(loss_sum,
    grad_norm)``, if given, is asked after backward whether to apply the step at all (``guard.py``).
    """
    if strategy is None:
        from ddpkit.parallel.ddp import DDPStrategy

        strategy = DDPStrategy()
    timer = timer or PhaseTimer(device)
    sums: list[torch.Tensor] = []
    ids: list[torch.Tensor] = []
    strategy.forward_backward(model, micro_batches, micro_step(model, scaler, cfg, device, len(micro_batches),
                                                               timer, sums, ids))
    with timer("optimizer_s"):
        scaler.unscale_(optimizer)  # before clipping: clip the true gradient, not the scaled one
        strategy.agree_on_overflow(scaler, optimizer)  # ranks holding parts of the gradients skip together
        norm = None
        if cfg.grad_clip > 0 or guard is not None:  # clipping at infinity measures the norm, changes nothing
            norm = strategy.clip_grad_norm_(model, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        if guard is None or guard(_loss_sum(sums), float(norm)):
            scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
        scaler.update()
        strategy.observe_gradients(model)
        optimizer.zero_grad(set_to_none=True)
    return _loss_sum(sums), ids[0].tolist() if len(ids) == 1 else [i for t in ids for i in t.tolist()]


def _loss_sum(sums: list[torch.Tensor]) -> float:
    """One host sync per step, summed in the same order and precision as it always was."""
    loss_sum = 0.0
    for s in sums:
        loss_sum += float(s)
    return loss_sum


def example_batch(cfg: TrainConfig) -> dict:
    """A one-sample batch of the right shapes and dtypes (zeros), for a warm-up pass."""
    if cfg.model == "mlp":
        return {"index": torch.tensor([-1]), "inputs": torch.zeros(1, cfg.input_width),
                "targets": torch.zeros(1, dtype=torch.long)}
    tokens = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    return {"index": torch.tensor([-1]), "inputs": tokens, "targets": tokens}


def global_loss_sum(ctx: RankContext, loss_sum: float) -> float:
    """The sum of every data-parallel rank's loss sum, the same on every rank (one all-reduce of one
    float64 over the data-parallel group: tensor- and pipeline-parallel peers hold the same samples)."""
    if ctx.dp_size == 1:
        return loss_sum
    total = torch.tensor([loss_sum], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total, group=ctx.dp_group)
    return float(total)


class GlobalLossSum:
    """:func:`global_loss_sum` for a loop that asks every step: the same all-reduce of one float64, with
    the data-parallel group (a device-mesh lookup) and the one-element buffer found and made once."""

    def __init__(self, ctx: RankContext) -> None:
        self.group = ctx.dp_group if ctx.dp_size > 1 else None
        self.total = torch.zeros(1, dtype=torch.float64, device=ctx.device)

    def __call__(self, loss_sum: float) -> float:
        if self.group is None:
            return loss_sum
        self.total.fill_(loss_sum)  # a float64 holds the Python float exactly, as torch.tensor([...]) did
        dist.all_reduce(self.total, group=self.group)
        return float(self.total)


def gather_sample_ids(ctx: RankContext, per_step: list[list[int]]) -> list[list[int]]:
    """The global sample ids of several steps at once (one all-gather for all of them): for each step,
    every data-parallel rank's ids, in rank order. What ``data_sha256`` folds in, a batch of steps at a time."""
    if ctx.dp_size == 1 or not per_step:
        return per_step
    mine = torch.tensor(per_step, dtype=torch.int64, device=ctx.device)  # (steps, ids per rank per step)
    everyone = [torch.empty_like(mine) for _ in range(ctx.dp_size)]
    dist.all_gather(everyone, mine, group=ctx.dp_group)
    return torch.cat(everyone, dim=1).tolist()
