"""The training loop on one rank: build, resume, step, checkpoint, summarise; hooks at the step boundary.

:class:`Trainer` is the whole job on one rank, in the order a reader would explain it:

1. **layout and strategy**: the config's parallel layout (dp x tp x pp) becomes this rank's device
   mesh, and its strategy (DDP, ZeRO-1, FSDP2, tensor or pipeline parallel: ``parallel/``) wraps the
   model, builds the optimizer and runs each step's micro-batches;
2. **data**: the dataset, and a sampler that partitions it over the data-parallel ranks and counts
   its position in global samples;
3. **resume or start clean**: rank 0 picks the newest good checkpoint (or refuses a folder that holds
   another run's checkpoints, or only unreadable ones) and tells the others; everything an exact resume
   needs is restored and checked (``resume.py``, ``state.py``);
4. **the loop**: hooks before the step, the step itself (``step.py``), the global loss and sample ids
   that every rank agrees on, the loss guard's verdict (``guard.py``: skip, roll back), hooks after it
   (fault injection, your own, the checkpoint cadence, the preemption notice: ``hooks.py``,
   ``preemption.py``), a log line; a watchdog bounds how long any step (and any save) may take;
5. **the summary**: hashes of the final state (``param_sha256``, ``optimizer_sha256``) and of the data
   consumed (``data_sha256``), so that two runs can be proved identical by comparing strings, and the
   bytes of state this rank holds (``state_bytes_per_rank``).

Checkpoints are written by the config's writer: ``full`` (rank 0, one file) or ``dcp`` (every rank its
shards, ``sharded_checkpoint.py``); a resume reads whichever the checkpoint's manifest names. The
decisions taken at a step boundary live in the modules that own them; this file is the loop.

:func:`run` is the launcher's entry point: ``ddpkit.launch(train.run, cfg)``.
"""

from __future__ import annotations

import functools
import os
import time

import torch
from torch.utils.data import DataLoader, default_collate

from ddpkit import checkpoint, faults, metrics, progress, resume
from ddpkit.config import TrainConfig
from ddpkit.data import ResumableDistributedSampler, build_dataset
from ddpkit.faults import FaultInjection, StallWatchdog
from ddpkit.guard import LossGuard, settle
from ddpkit.hooks import CheckpointEvery, Hook, StepResult
from ddpkit.models import build_model
from ddpkit.parallel import build_strategy
from ddpkit.parallel.base import Strategy
from ddpkit.preemption import Preemption, loader_worker_init
from ddpkit.runtime import RankContext, seed_everything
from ddpkit.step import GlobalLossSum, PhaseTimer, example_batch, gather_sample_ids, lr_at, micro_step, train_step

PROBE_SAMPLES = 16
DATA_HASH_EVERY = 64  # fold the sample ids of this many steps into data_sha256 at once (one all-gather)
STEP_PHASES = tuple(p for p in metrics.PHASES if p != "comm_s")  # timed by the step; comm_s by the CommTimer
RESTORE_MODES = resume.RESTORE_MODES
__all__ = ["Hook", "StepResult", "Trainer", "build_dataset", "build_optimizer", "lr_at", "run", "train_step"]


class Trainer:
    """One rank's training run (see the module docstring). ``hooks`` run before the built-in
    checkpoint cadence, so a hook that vetoes a step does so before it is saved."""

    def __init__(self, ctx: RankContext, cfg: TrainConfig, attempt: int = 0, restore: str = "full",
                 hooks: list[Hook] | None = None) -> None:
        if restore not in RESTORE_MODES:
            raise ValueError(f"unknown restore mode {restore!r}: use one of {', '.join(RESTORE_MODES)}")
        # first of all: a notice that arrives while the rest is built is kept for the first step boundary
        self.preemption = Preemption().install() if cfg.checkpoint_dir else None
        try:
            self._build(ctx, cfg, attempt, hooks)
            if cfg.checkpoint_dir and (path := resume.choose(self.ctx, self.cfg)):
                resume.restore(self, resume.read(self, path), checkpoint.step_of(path), restore)
                self.log.event("checkpoint_restored", self.step, path=os.path.basename(path), attempt=attempt)
        except BaseException:
            self.close()
            raise

    def _build(self, ctx: RankContext, cfg: TrainConfig, attempt: int, hooks: list[Hook] | None) -> None:
        self.cfg = cfg = cfg.replace(world_size=ctx.world_size)
        self.ctx = ctx = ctx.with_dims(cfg.dims)
        self.save_group = resume.save_group(ctx, cfg)  # saves wait on it, with their own time bound
        self.attempt, self.started, wall_started = attempt, time.perf_counter(), time.time()
        seed_everything(cfg.seed)
        self.strategy = build_strategy(cfg.strategy, ctx, cfg)
        if ctx.dims.pp > 1:
            self.strategy.schedule_name = cfg.pp_schedule
        self.raw_model = build_model(cfg).to(ctx.device)
        self.model = self.strategy.wrap(self.raw_model)
        self.optimizer = self.strategy.build_optimizer(self.raw_model, lr_at(cfg, 0), cfg.weight_decay)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.amp == "fp16")
        self.dataset = build_dataset(cfg)
        self.sampler = self.build_sampler()
        self.loader_gen = torch.Generator()  # keeps the DataLoader off the global RNG
        self.loader = self.build_loader()
        self.step, self.consumed, self.data_sha256 = 0, 0, metrics.DATA_SHA256_START
        self.applied_steps = 0  # steps whose update is in the state (the loss guard skips and undoes some)
        self._unhashed_ids: list[list[int]] = []  # this rank's ids of the steps not yet in data_sha256
        self.resumed_from, self.losses, self.phase_totals = 0, [], {}
        self.timer = PhaseTimer(ctx.device)
        self.log = metrics.MetricsLogger(ctx, cfg.metrics_dir, cfg.log_every)
        self.log.event("started", 0, time=wall_started, attempt=attempt)  # the process is up: recovery.py times from it
        self.progress = progress.Reporter.from_env(ctx.is_main)  # live view in the launching notebook
        self.guard = LossGuard(cfg.spike_factor) if cfg.nan_guard else None
        self.step_rejected, self._verdict, self._step_total = False, "ok", 0.0
        self.stop_requested = False  # set by a hook that ends the run early, on every rank at the same step
        self.watchdog: StallWatchdog | None = None  # running inside fit()
        # fault injection only when asked for: a hook that does nothing still costs a call per step
        self.hooks = [*([FaultInjection(cfg, attempt)] if cfg.fail_at_step is not None else []), *(hooks or [])]
        if cfg.checkpoint_dir:  # the notice after the cadence: it saves only if that did not
            self.hooks += [CheckpointEvery(cfg.checkpoint_every, cfg.steps, cfg.checkpoint_every_s), self.preemption]
        self._batches = None
        self._probe = None  # built on first use: a run that never saves or restores never loads it
        # comm_s costs a Python hook on every bucket: measured only when it is written per step (metrics.py)
        self.strategy.measure_comm = bool(cfg.metrics_dir)
        self.comm = self.strategy.comm_timer(self.model)
        self.global_loss_sum = GlobalLossSum(ctx)  # the step's loss all-reduce, its group and buffer found once

    # ------------------------------------------------------------------ data

    def build_sampler(self) -> ResumableDistributedSampler:
        """This data-parallel rank's share of the global sample stream (override to study a broken one)."""
        return ResumableDistributedSampler(len(self.dataset), self.ctx.dp_size, self.ctx.dp_rank,
                                           self.cfg.global_batch_size, self.cfg.seed)

    def build_loader(self) -> DataLoader:
        """The DataLoader over this rank's sampler; its workers (if any) leave SIGTERM to the rank."""
        cfg, workers = self.cfg, self.cfg.num_workers > 0
        return DataLoader(self.dataset, batch_size=cfg.micro_batch_size, sampler=self.sampler,
                          num_workers=cfg.num_workers, drop_last=True, generator=self.loader_gen,
                          persistent_workers=workers, worker_init_fn=loader_worker_init if workers else None,
                          multiprocessing_context="fork" if workers else None)

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

    def probe_loss(self) -> float:
        """Loss of the model on a fixed batch, in fp32: saved with a checkpoint and reproduced after a
        restore (the loss-continuity check: the weights in memory are the weights that were saved)."""
        if self._probe is None:
            batch = default_collate([self.dataset[i] for i in range(min(PROBE_SAMPLES, len(self.dataset)))])
            self._probe = (batch["inputs"].to(self.ctx.device), batch["targets"].to(self.ctx.device))
        return self.strategy.eval_loss(self.raw_model, *self._probe)

    # ------------------------------------------------------------------ checkpoints (resume.py)

    def save(self) -> tuple[float, int]:
        """Checkpoint now (every rank calls; the writer writes; all wait until it is durable). Returns (s, bytes)."""
        return resume.save(self)

    def roll_back(self) -> int | None:
        """Back to the newest good checkpoint's state (the loss guard asks); returns its step, or None."""
        return resume.roll_back(self)

    # ------------------------------------------------------------------ the loop

    def run_step(self) -> StepResult:
        """One optimizer step with the hooks around it, logged.

        Everything here runs every step, so it is kept to what the step needs: per-step work that could
        be done once (the loss all-reduce's group and buffer, the phase names) is done once, and the
        log's fields are built only when a line will be written or printed."""
        cfg = self.cfg
        started, lr = time.perf_counter(), lr_at(cfg, self.step)
        self.timer = timer = PhaseTimer(self.ctx.device)
        for hook in self.hooks:
            hook.before_step(self)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.comm.reset()
        with timer("data_s"):
            micro_batches = [self.next_micro_batch() for _ in range(cfg.grad_accum)]
        self._verdict = "ok"
        loss_sum, ids = train_step(self.model, self.optimizer, self.scaler, micro_batches, cfg, self.ctx.device,
                                   timer, self.strategy, self.judge if self.guard else None)
        if self.guard:  # the guard has already made the global loss
            total_loss = self._step_total
        else:
            with timer("sync_s"):  # the step's own small collectives, so "the rest" is accounted for
                total_loss = self.global_loss_sum(loss_sum)
        global_batch = cfg.global_batch_size
        self.step += 1
        self.consumed += global_batch
        self._unhashed_ids.append(ids)
        self.step_rejected = self._verdict != "ok"
        self.applied_steps += not self.step_rejected
        if self.guard:  # accept, skip or roll back (guard.py)
            settle(self, self._verdict, total_loss / global_batch, ids)
        if len(self._unhashed_ids) >= DATA_HASH_EVERY:
            with timer("sync_s"):
                self.fold_data_hash()
        seconds = timer.seconds
        phases = {p: seconds.get(p, 0.0) for p in STEP_PHASES}
        if self.comm.measured:
            phases["comm_s"] = self.comm.seconds
        result = StepResult(self.step, total_loss / global_batch, loss_sum / len(ids), lr, ids,
                            phases, self.comm.calls, self.comm.bytes)
        for hook in self.hooks:
            hook.after_step(self, result)
        result.step_time_s = time.perf_counter() - started
        self.losses.append({"step": result.step, "loss": result.loss})
        totals = self.phase_totals
        for p, phase_s in result.phases.items():
            totals[p] = totals.get(p, 0.0) + phase_s
        last = result.step == cfg.steps
        if self.log.wants_step(result.step, last):
            self.log.step(result.step, last=last, loss=result.loss, local_loss=result.local_loss, lr=result.lr,
                          step_time_s=result.step_time_s, samples_per_s=global_batch / result.step_time_s,
                          comm_calls=result.comm_calls, comm_bytes=result.comm_bytes,
                          checkpoint_s=result.checkpoint_s, **result.phases)
        self.progress.step(result.step, cfg.steps, result.loss, self.run_name)
        return result

    def judge(self, loss_sum: float, grad_norm: float) -> bool:
        """Apply this step? Asked by the step after backward, on every rank: the global loss, then the
        loss guard's verdict agreed by every rank (``guard.py``)."""
        with self.timer("sync_s"):
            self._step_total = self.global_loss_sum(loss_sum)
            self._verdict = self.guard.judge(self.ctx, self._step_total / self.cfg.global_batch_size, grad_norm)
        return self._verdict == "ok"

    def fold_data_hash(self) -> str:
        """Bring ``data_sha256`` up to date: fold in the global sample ids of the steps since the last
        fold, step by step (collective: every rank calls it at the same step; save and summary do)."""
        for step_ids in gather_sample_ids(self.ctx, self._unhashed_ids):
            self.data_sha256 = metrics.extend_data_sha256(self.data_sha256, step_ids)
        self._unhashed_ids = []
        return self.data_sha256

    def prepare(self) -> None:
        """Announce the run (rank 0) and let the strategy settle before the first step (collective)."""
        cfg, ctx = self.cfg, self.ctx
        if ctx.is_main:
            experts = f", {cfg.experts} experts over ep {cfg.ep}" if cfg.experts else ""
            print(f"ddpkit train: {cfg.model}, world {ctx.world_size} ({ctx.backend}, {ctx.device.type}, "
                  f"{cfg.strategy}, {ctx.dims.describe()}{experts}), global batch {cfg.global_batch_size} = "
                  f"{cfg.micro_batch_size} x {cfg.grad_accum} x {ctx.dp_size}, steps {self.step} -> {cfg.steps}, "
                  f"digest {cfg.digest()[:12]}", flush=True)
        self.strategy.prepare(self.model, micro_step(self.model, self.scaler, cfg, ctx.device, 1,
                                                     PhaseTimer(ctx.device), [], []), example_batch(cfg))

    @functools.cached_property
    def run_name(self) -> str:
        """How the live progress names this run, so that the runs one cell trains are told apart: model,
        strategy and layout, precision, a provoked fault, the save cadence, a resume (built once)."""
        cfg, parts = self.cfg, [self.cfg.model, self.cfg.strategy]
        parts += [f"{k} {getattr(cfg, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(cfg, k) > 1]
        parts.append(f"{self.ctx.world_size} ranks")
        if cfg.amp != "off":
            parts.append(cfg.amp)
        if cfg.fail_at_step is not None:
            parts.append(f"{cfg.fail_mode} at step {cfg.fail_at_step}")
        if cfg.nan_guard:
            parts.append("guarded")
        if cfg.checkpoint_dir and cfg.checkpoint_every_s:
            parts.append(f"saves every {cfg.checkpoint_every_s:g} s")
        elif cfg.checkpoint_dir and cfg.checkpoint_every:
            parts.append(f"saves every {cfg.checkpoint_every} steps")
        if self.resumed_from:
            parts.append(f"resumed at step {self.resumed_from}")
        return ", ".join(parts)

    def fit(self) -> dict:
        """Train to ``cfg.steps``; returns the run summary (every rank computes it, rank 0 writes it)."""
        cfg = self.cfg
        self.watchdog = StallWatchdog(cfg.timeout + faults.STALL_MARGIN_S)
        self.watchdog.pet()
        try:
            self.prepare()
            while self.step < cfg.steps and not self.stop_requested:
                self.run_step()
                self.watchdog.pet()
            for hook in self.hooks:
                hook.on_end(self)
            return self.summary()
        finally:
            self.watchdog.stop()
            self.watchdog = None
            self.close()

    def close(self) -> None:
        """Give the notice signal back, close the logs and shut DataLoader workers down now (not when the
        garbage collector gets to it)."""
        if self.preemption is not None:
            self.preemption.uninstall()
        for part in ("log", "progress"):
            if hasattr(self, part):
                getattr(self, part).close()
        self._batches = self.loader = None

    def summary(self) -> dict:
        """The run's result: hashes that prove what was trained on what, losses, phase times (collective)."""
        cfg, ctx = self.cfg, self.ctx
        self.fold_data_hash()
        ran = max(1, self.step - self.resumed_from)
        phase_means = metrics.reduce_across_ranks(ctx, {p: v / ran for p, v in self.phase_totals.items()})
        model_state, optimizer_state = self.strategy.state_dicts(self.model, self.optimizer, rank0_only=False)
        guard = self.guard.state_dict() if self.guard else {"rollbacks": 0, "skipped_batches": [], "events": []}
        summary = {
            "world_size": ctx.world_size, "backend": ctx.backend, "model": cfg.model, "strategy": cfg.strategy,
            "dp": ctx.dims.dp, "tp": ctx.dims.tp, "pp": ctx.dims.pp, "cp": ctx.dims.cp, "ep": cfg.ep, "experts": cfg.experts,
            "global_batch_size": cfg.global_batch_size, "steps": self.step, "applied_steps": self.applied_steps,
            "losses": self.losses, "param_sha256": metrics.state_sha256(model_state),
            "param_l2": metrics.state_l2(model_state), "data_sha256": self.data_sha256,
            "optimizer_sha256": metrics.optimizer_sha256(optimizer_state),
            "state_bytes_per_rank": self.strategy.state_bytes(self.model, self.optimizer),
            "sharding": self.strategy.sharding(self.raw_model),
            "checkpoint_format": cfg.checkpoint_format, "activation_checkpointing": cfg.activation_checkpointing,
            "resumed_from_step": self.resumed_from, "restarts": self.attempt, "config_digest": cfg.digest(),
            "preempted_at_step": self.preemption.stopped_step if self.preemption else None,
            "emergency_checkpoint_step": self.preemption.saved_step if self.preemption else None,
            "rollbacks": guard["rollbacks"], "skipped_batches": guard["skipped_batches"], "guard_events": guard["events"],
            "phase_s": phase_means, "wall_s": time.perf_counter() - self.started, "rank": ctx.rank,
        }
        if cfg.experts:  # per MoE layer: tokens per expert and drops, over the world and this run's steps
            summary["moe"] = self.strategy.expert_stats()
        self.log.event("end", self.step, param_sha256=summary["param_sha256"], data_sha256=self.data_sha256)
        if ctx.is_main:
            if self.losses:
                print(f"done: step {self.step}, loss {self.losses[0]['loss']:.4f} -> {self.losses[-1]['loss']:.4f}, "
                      f"param_sha256 {summary['param_sha256'][:16]}", flush=True)
            for i, layer in enumerate(summary.get("moe", [])):
                print(f"moe layer {i}: tokens per expert {layer['tokens_per_expert']}, dropped {layer['dropped']} "
                      f"of {layer['assignments']} assignments", flush=True)
            if cfg.summary_json:
                metrics.write_summary(cfg.summary_json, summary)
        return summary


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW for ``model`` as the trainer builds it (through its strategy), at the schedule's first lr."""
    return Strategy().build_optimizer(model, lr_at(cfg, 0), cfg.weight_decay)


def run(ctx: RankContext, cfg: TrainConfig, attempt: int = 0, restore: str = "full") -> dict:
    """Train on this rank; returns the run summary (every rank computes it, rank 0 writes it).

    ``restore="weights"`` resumes with the model weights, data position and RNG but a fresh optimizer:
    not a recovery plan, only a way to measure why not (notebook 06).
    """
    return Trainer(ctx, cfg, attempt, restore).fit()
