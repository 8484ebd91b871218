"""The training plane: forward, backward, gradient sync, optimizer step; and the loop around them.

:func:`train_step` is one optimizer step over ``grad_accum`` micro-batches:

* every micro-batch's loss is divided by ``grad_accum`` and DDP averages over ranks, so the step's
  gradient is the mean over the whole global batch: the same gradient as one big batch;
* all but the last micro-batch run forward **and** backward inside ``DDP.no_sync()``. DDP decides
  in *forward* whether the coming backward will all-reduce, so a forward outside ``no_sync`` still
  communicates even if its backward is inside;
* AMP: ``bf16`` autocast needs no scaler (bf16 has fp32's exponent range); ``fp16`` needs
  ``GradScaler``, and gradients are **unscaled before clipping** (clipping scaled gradients clips at
  the wrong threshold).

:func:`run` is the whole job on one rank: build, optionally resume, loop, checkpoint, summarise.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, default_collate

import ddpkit
from ddpkit import checkpoint, metrics
from ddpkit.config import TrainConfig
from ddpkit.data import MarkovTokens, ResumableDistributedSampler, TeacherClassification
from ddpkit.models import build_model, loss_fn
from ddpkit.runtime import RankContext, seed_everything

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PROBE_SAMPLES = 16
RESTORE_MODES = ("full", "weights")


class InjectedFailure(RuntimeError):
    """Raised by ``--fail-mode raise``: a deliberate, reproducible rank failure."""


class PhaseTimer:
    """Accumulates wall time per phase. On a GPU it synchronises at phase ends (honest, not free)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of 0-based optimizer step ``step``: linear warm-up, then constant."""
    if cfg.warmup_steps == 0:
        return cfg.lr
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)


def build_dataset(cfg: TrainConfig):
    if cfg.model == "mlp":
        return TeacherClassification(cfg.dataset_size, cfg.input_width, cfg.num_classes, cfg.seed,
                                     cfg.data_delay_s)
    return MarkovTokens(cfg.dataset_size, cfg.vocab_size, cfg.seq_len, cfg.seed, cfg.data_delay_s)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr_at(cfg, 0), weight_decay=cfg.weight_decay)


def wrap_ddp(model: torch.nn.Module, ctx: RankContext) -> torch.nn.Module:
    """DDP on more than one rank. ``gradient_as_bucket_view=True``: gradients *are* slices of the
    all-reduce buckets (no copy in or out, lower peak memory); they must not be detached or replaced
    in place by user code."""
    if not ctx.is_distributed:
        return model
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               gradient_as_bucket_view=True)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               micro_batches: list[dict], cfg: TrainConfig, device: torch.device,
               timer: PhaseTimer | None = None) -> tuple[float, list[int]]:
    """One optimizer step. Returns (sum of per-sample losses on this rank, sample ids used here)."""
    timer = timer or PhaseTimer(device)
    accum = len(micro_batches)
    loss_sum, sample_ids = 0.0, []
    for k, batch in enumerate(micro_batches):
        with timer("h2d_s"):
            inputs = batch["inputs"].to(device, non_blocking=True)
            targets = batch["targets"].to(device, non_blocking=True)
        last = k == accum - 1
        skip_sync = model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()
        with skip_sync:  # NEW: forward *and* backward inside, or the all-reduce still happens
            with timer("forward_s"), torch.autocast(device.type, dtype=AMP_DTYPES.get(cfg.amp),
                                                    enabled=cfg.amp != "off"):
                per_sample = loss_fn(model(inputs), targets, reduction="none")  # (B,)
                loss = per_sample.mean() / accum
            with timer("backward_s"):
                scaler.scale(loss).backward()  # identity when the scaler is disabled
        loss_sum += float(per_sample.detach().sum())
        sample_ids += batch["index"].tolist()
    with timer("optimizer_s"):
        scaler.unscale_(optimizer)  # before clipping: clip the true gradient, not the scaled one
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return loss_sum, sample_ids


def _gather_step(ctx: RankContext, loss_sum: float, sample_ids: list[int]) -> tuple[float, list[int]]:
    """Global loss sum and the global sample ids of this step, in one collective on every rank.

    One ``all_gather`` of ``[loss_sum, id, id, ...]`` in float64 (exact for ids below 2**53) instead of
    an ``all_reduce`` plus an ``all_gather``: on small steps each extra collective is visible.
    """
    if not ctx.is_distributed:
        return loss_sum, sample_ids
    mine = torch.tensor([loss_sum, *sample_ids], dtype=torch.float64, device=ctx.device)
    everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, mine)
    total = sum(float(t[0]) for t in everyone)
    return total, [int(i) for t in everyone for i in t[1:].tolist()]


def _straggle(ctx: RankContext, cfg: TrainConfig, step: int) -> None:
    """Fault injection, mode ``slow``: one rank spends longer on every step's input from ``fail_at_step`` on."""
    if cfg.fail_mode == "slow" and cfg.fail_at_step is not None and step >= cfg.fail_at_step \
            and ctx.rank == cfg.fail_rank:
        time.sleep(cfg.slow_step_s)


def _maybe_inject_failure(ctx: RankContext, cfg: TrainConfig, step: int, attempt: int) -> None:
    """Fault injection, once: only on the first attempt, so a restarted run can finish."""
    if cfg.fail_mode == "slow" or cfg.fail_at_step != step or ctx.rank != cfg.fail_rank or attempt != 0:
        return
    print(f"injecting failure ({cfg.fail_mode}) on rank {ctx.rank} after step {step}", flush=True)
    if cfg.fail_mode == "raise":
        raise InjectedFailure(f"injected failure after step {step} on rank {ctx.rank}")
    if cfg.fail_mode == "exit":
        os._exit(13)
    if cfg.fail_mode == "kill":  # what the OOM killer or a preempted node does: no exception, no exit code
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang: the other ranks block in the next collective until it times out
        time.sleep(1)


class _Loop:
    """The state of one rank's run, so that save/restore read as the list of what must survive."""

    def __init__(self, ctx: RankContext, cfg: TrainConfig) -> None:
        self.ctx, self.cfg = ctx, cfg
        seed_everything(cfg.seed)
        self.raw_model = build_model(cfg).to(ctx.device)
        self.optimizer = build_optimizer(self.raw_model, cfg)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.amp == "fp16")
        self.dataset = build_dataset(cfg)
        self.sampler = ResumableDistributedSampler(len(self.dataset), ctx.world_size, ctx.rank,
                                                   cfg.global_batch_size, cfg.seed)
        self.loader_gen = torch.Generator()  # keeps the DataLoader off the global RNG
        self.loader = DataLoader(self.dataset, batch_size=cfg.micro_batch_size, sampler=self.sampler,
                                 num_workers=cfg.num_workers, drop_last=True, generator=self.loader_gen,
                                 persistent_workers=cfg.num_workers > 0)
        self.step, self.consumed, self.data_sha256 = 0, 0, metrics.DATA_SHA256_START
        self._batches = None
        self._probe = None  # built on first use: a run that never saves or restores never loads it

    def probe_loss(self) -> float:
        """Loss of the model on a fixed batch, in fp32: saved with a checkpoint and reproduced after a
        restore (the loss-continuity check: the weights in memory are the weights that were saved)."""
        if self._probe is None:
            batch = default_collate([self.dataset[i] for i in range(min(PROBE_SAMPLES, len(self.dataset)))])
            self._probe = (batch["inputs"].to(self.ctx.device), batch["targets"].to(self.ctx.device))
        with torch.no_grad():
            return float(loss_fn(self.raw_model(self._probe[0]), self._probe[1]))

    def next_micro_batch(self) -> dict:
        """The next micro-batch; at an epoch boundary, an iterator for the next epoch from ``consumed``."""
        while True:
            if self._batches is None:
                self.sampler.set_consumed(self.consumed)
                self.loader_gen.manual_seed(self.cfg.seed * 1_000_003 + self.sampler.epoch)
                self._batches = iter(self.loader)
            try:
                return next(self._batches)
            except StopIteration:
                self._batches = None

    def state(self) -> dict:
        """Everything an exact resume needs, gathered from every rank (collective: all ranks call it)."""
        rngs = [checkpoint.rng_state()]
        if self.ctx.is_distributed:
            rngs = [None] * self.ctx.world_size
            dist.all_gather_object(rngs, checkpoint.rng_state())
        cfg = self.cfg
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "sampler": self.sampler.state_dict(),
            "train": {"step": self.step, "consumed_samples": self.consumed, "data_sha256": self.data_sha256,
                      "probe_loss": self.probe_loss()},
            "rng": rngs,
            "meta": {"config_digest": cfg.digest(), "semantics": cfg.semantics(), "world_size": cfg.world_size,
                     "global_batch_size": cfg.global_batch_size, "micro_batch_size": cfg.micro_batch_size,
                     "grad_accum": cfg.grad_accum, "torch_version": str(torch.__version__),
                     "ddpkit_version": ddpkit.__version__},
        }

    def restore(self, state: dict, saved_at_step: int, mode: str = "full") -> None:
        """Load ``state`` and check it. ``mode="weights"`` loads everything but the optimizer and scaler:
        the popular half-measure, kept so that its cost can be measured (the Adam moments restart)."""
        checkpoint.check_compatible(state["meta"], self.cfg)
        self.raw_model.load_state_dict(state["model"])
        if mode == "full":
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scaler.is_enabled() and state.get("scaler"):  # absent: check_restored says so below
                self.scaler.load_state_dict(state["scaler"])
        train = state["train"]
        self.step, self.consumed, self.data_sha256 = train["step"], train["consumed_samples"], train["data_sha256"]
        self.sampler.load_state_dict(state["sampler"])
        checkpoint.check_restored(state, self.optimizer if mode == "full" else None, self.cfg,
                                  lr_at(self.cfg, self.step - 1), saved_at_step, self.probe_loss())
        if state["meta"]["world_size"] == self.ctx.world_size:
            checkpoint.set_rng_state(state["rng"][self.ctx.rank])
        else:  # rank r of a new topology has no predecessor: reseed, deterministically
            seed_everything(self.cfg.seed + 1_000_003 * self.step + self.ctx.rank)

    def save(self, keep_last: int) -> tuple[float, int]:
        """Checkpoint now (all ranks call; rank 0 writes). Returns (seconds, bytes)."""
        started = time.perf_counter()
        state = self.state()
        nbytes = 0
        if self.ctx.is_main:
            path = checkpoint.save(self.cfg.checkpoint_dir, self.step, state, keep_last)
            nbytes = (path / checkpoint.STATE_FILE).stat().st_size
        if self.ctx.is_distributed:
            dist.barrier()  # nobody runs ahead of a checkpoint that is not yet durable
        return time.perf_counter() - started, nbytes


def _find_resume_point(ctx: RankContext, cfg: TrainConfig) -> str | None:
    """Rank 0 picks the newest good checkpoint and tells the others, so all ranks load the same one."""
    choice = [str(checkpoint.latest_good(cfg.checkpoint_dir) or "") if ctx.is_main else None]
    if ctx.is_distributed:
        dist.broadcast_object_list(choice, src=0)
    return choice[0] or None


def run(ctx: RankContext, cfg: TrainConfig, attempt: int = 0, restore: str = "full") -> dict:
    """Train on this rank; returns the run summary (every rank computes it, rank 0 writes it).

    ``restore="weights"`` resumes with the model weights, data position and RNG but a fresh optimizer:
    not a recovery plan, only a way to measure why not (notebook 06).
    """
    if restore not in RESTORE_MODES:
        raise ValueError(f"unknown restore mode {restore!r}: use one of {', '.join(RESTORE_MODES)}")
    started = time.perf_counter()
    cfg = cfg.replace(world_size=ctx.world_size)
    loop = _Loop(ctx, cfg)
    log = metrics.MetricsLogger(ctx, cfg.metrics_dir, cfg.log_every)
    resumed_from = 0
    if cfg.resume and (path := _find_resume_point(ctx, cfg)):
        loop.restore(checkpoint.load(path), checkpoint.step_of(path), restore)
        resumed_from = loop.step
        log.event("checkpoint_restored", loop.step, path=os.path.basename(path), attempt=attempt)
    if ctx.is_main:
        print(f"ddpkit train: {cfg.model}, world {ctx.world_size} ({ctx.backend}, {ctx.device.type}), "
              f"global batch {cfg.global_batch_size} = {cfg.micro_batch_size} x {cfg.grad_accum} x "
              f"{ctx.world_size}, steps {loop.step} -> {cfg.steps}, digest {cfg.digest()[:12]}", flush=True)
    model = wrap_ddp(loop.raw_model, ctx)
    comm = metrics.CommTimer().register(model) if isinstance(model, DDP) else metrics.CommTimer()
    losses, phase_totals = [], dict.fromkeys(metrics.PHASES, 0.0)
    while loop.step < cfg.steps:
        _maybe_inject_failure(ctx, cfg, loop.step, attempt)
        step_started = time.perf_counter()
        timer, lr = PhaseTimer(ctx.device), lr_at(cfg, loop.step)
        for group in loop.optimizer.param_groups:
            group["lr"] = lr
        comm.reset()
        micro_batches = []
        for _ in range(cfg.grad_accum):
            with timer("data_s"):
                micro_batches.append(loop.next_micro_batch())
        with timer("data_s"):
            _straggle(ctx, cfg, loop.step)
        loss_sum, ids = train_step(model, loop.optimizer, loop.scaler, micro_batches, cfg, ctx.device, timer)
        global_loss_sum, global_ids = _gather_step(ctx, loss_sum, ids)
        loop.step += 1
        loop.consumed += cfg.global_batch_size
        loop.data_sha256 = metrics.extend_data_sha256(loop.data_sha256, global_ids)
        loss = global_loss_sum / cfg.global_batch_size
        losses.append({"step": loop.step, "loss": loss})
        saved = (0.0, 0)
        if cfg.checkpoint_dir and ((cfg.checkpoint_every and loop.step % cfg.checkpoint_every == 0)
                                   or loop.step == cfg.steps):
            saved = loop.save(cfg.keep_last)
            log.event("checkpoint_saved", loop.step, seconds=saved[0], bytes=saved[1])
        step_time = time.perf_counter() - step_started
        phases = {p: timer.seconds.get(p, 0.0) for p in metrics.PHASES if p != "comm_s"}
        phases["comm_s"] = comm.seconds
        for p in metrics.PHASES:
            phase_totals[p] += phases[p]
        log.step(loop.step, last=loop.step == cfg.steps, loss=loss, local_loss=loss_sum / len(ids), lr=lr,
                 step_time_s=step_time, samples_per_s=cfg.global_batch_size / step_time,
                 comm_calls=comm.calls, comm_bytes=comm.bytes, checkpoint_s=saved[0], **phases)
    ran = max(1, loop.step - resumed_from)
    phase_means = metrics.reduce_across_ranks(ctx, {p: v / ran for p, v in phase_totals.items()})
    summary = {
        "world_size": ctx.world_size, "backend": ctx.backend, "model": cfg.model,
        "global_batch_size": cfg.global_batch_size, "steps": loop.step, "losses": losses,
        "param_sha256": metrics.state_sha256(loop.raw_model.state_dict()),
        "param_l2": metrics.param_l2(loop.raw_model), "data_sha256": loop.data_sha256,
        "optimizer_sha256": metrics.optimizer_sha256(loop.optimizer),
        "resumed_from_step": resumed_from, "restarts": attempt, "config_digest": cfg.digest(),
        "phase_s": phase_means, "wall_s": time.perf_counter() - started, "rank": ctx.rank,
    }
    log.event("end", loop.step, param_sha256=summary["param_sha256"], data_sha256=loop.data_sha256)
    log.close()
    if ctx.is_main:
        if losses:
            print(f"done: step {loop.step}, loss {losses[0]['loss']:.4f} -> {losses[-1]['loss']:.4f}, "
                  f"param_sha256 {summary['param_sha256'][:16]}", flush=True)
        if cfg.summary_json:
            write_summary(cfg.summary_json, summary)
    return summary


def write_summary(path: str, summary: dict[str, Any]) -> None:
    """Write the summary JSON atomically (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump(summary, handle, indent=1)
    os.replace(tmp, path)
