"""The training loop on one rank: build, resume, step, checkpoint, summarise; hooks at the step boundary.

:class:`Trainer` is the whole job on one rank, in the order a reader would explain it:

1. **layout and strategy**: the config's parallel layout (dp x tp x pp) becomes this rank's device
   mesh, and its strategy (DDP, ZeRO-1, FSDP2, tensor or pipeline parallel: ``parallel/``) wraps the
   model, builds the optimizer and runs each step's micro-batches;
2. **data**: the dataset, and a sampler that partitions it over the data-parallel ranks and counts
   its position in global samples;
3. **resume or start clean**: rank 0 picks the newest good checkpoint (or refuses a folder that holds
   another run's checkpoints) and tells the others; everything an exact resume needs is restored and
   checked (``state.py``);
4. **the loop**: hooks before the step, the step itself (``step.py``), the global loss and sample ids
   that every rank agrees on, hooks after it (checkpoint cadence, fault injection, your own), a log
   line; a watchdog bounds how long any step may take;
5. **the summary**: hashes of the final state (``param_sha256``, ``optimizer_sha256``) and of the data
   consumed (``data_sha256``), so that two runs can be proved identical by comparing strings, and the
   bytes of state this rank holds (``state_bytes_per_rank``).

Checkpoints are written by the config's writer: ``full`` (rank 0, one file) or ``dcp`` (every rank its
shards, ``sharded_checkpoint.py``); a resume reads whichever the checkpoint's manifest names.

:func:`run` is the launcher's entry point: ``ddpkit.launch(train.run, cfg)``.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, default_collate

from ddpkit import checkpoint, metrics, progress, sharded_checkpoint, state
from ddpkit.checkpoint import CheckpointError
from ddpkit.config import TrainConfig
from ddpkit.data import ResumableDistributedSampler, build_dataset
from ddpkit.faults import STALL_MARGIN_S, FaultInjection, StallWatchdog
from ddpkit.guard import MAX_REJECTED, VERDICTS, GuardError, LossGuard
from ddpkit.hooks import CheckpointEvery, Hook, StepResult
from ddpkit.models import build_model
from ddpkit.parallel import build_strategy
from ddpkit.parallel.base import Strategy
from ddpkit.preemption import Preemption
from ddpkit.runtime import RankContext, die_with_parent, seed_everything
from ddpkit.step import (
    PhaseTimer,
    example_batch,
    gather_sample_ids,
    global_loss_sum,
    lr_at,
    micro_step,
    train_step,
)

PROBE_SAMPLES = 16
DATA_HASH_EVERY = 64  # fold the sample ids of this many steps into data_sha256 at once (one all-gather)
RESTORE_MODES = ("full", "weights")
__all__ = ["Hook", "StepResult", "Trainer", "build_dataset", "build_optimizer", "lr_at", "run", "train_step"]


class Trainer:
    """One rank's training run (see the module docstring). ``hooks`` run before the built-in
    checkpoint cadence, so a hook that vetoes a step does so before it is saved."""

    def __init__(self, ctx: RankContext, cfg: TrainConfig, attempt: int = 0, restore: str = "full",
                 hooks: list[Hook] | None = None) -> None:
        if restore not in RESTORE_MODES:
            raise ValueError(f"unknown restore mode {restore!r}: use one of {', '.join(RESTORE_MODES)}")
        self.cfg = cfg = cfg.replace(world_size=ctx.world_size)
        self.ctx = ctx = ctx.with_dims(cfg.dims)
        self.attempt, self.started, wall_started = attempt, time.perf_counter(), time.time()
        seed_everything(cfg.seed)
        self.strategy = build_strategy(cfg.strategy, ctx)
        self.raw_model = build_model(cfg).to(ctx.device)
        self.model = self.strategy.wrap(self.raw_model)
        self.optimizer = self.strategy.build_optimizer(self.raw_model, lr_at(cfg, 0), cfg.weight_decay)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.amp == "fp16")
        self.dataset = build_dataset(cfg)
        self.sampler = self.build_sampler()
        self.loader_gen = torch.Generator()  # keeps the DataLoader off the global RNG
        workers = cfg.num_workers > 0
        self.loader = DataLoader(self.dataset, batch_size=cfg.micro_batch_size, sampler=self.sampler,
                                 num_workers=cfg.num_workers, drop_last=True, generator=self.loader_gen,
                                 persistent_workers=workers, worker_init_fn=die_with_parent if workers else None,
                                 multiprocessing_context="fork" if workers else None)
        self.step, self.consumed, self.data_sha256 = 0, 0, metrics.DATA_SHA256_START
        self._unhashed_ids: list[list[int]] = []  # this rank's ids of the steps not yet in data_sha256
        self.resumed_from, self.losses, self.phase_totals = 0, [], dict.fromkeys(metrics.PHASES, 0.0)
        self.timer = PhaseTimer(ctx.device)
        self.log = metrics.MetricsLogger(ctx, cfg.metrics_dir, cfg.log_every)
        self.log.event("started", 0, time=wall_started, attempt=attempt)  # the process is up: recovery.py times from it
        self.progress = progress.Reporter.from_env(ctx.is_main)  # live view in the launching notebook
        self.hooks = [FaultInjection(cfg, attempt), *(hooks or [])]
        self.stop_requested = False  # set by a hook that ends the run early, on every rank at the same step
        self.guard = LossGuard(cfg.spike_factor) if cfg.nan_guard else None
        self.step_rejected, self._verdict, self._step_total = False, "ok", 0.0
        self.preemption = None
        if cfg.checkpoint_dir:
            self.hooks.append(CheckpointEvery(cfg.checkpoint_every, cfg.steps, cfg.checkpoint_every_s))
            self.preemption = Preemption().install()  # after the cadence: it saves only if that did not
            self.hooks.append(self.preemption)
        self._batches = None
        self._probe = None  # built on first use: a run that never saves or restores never loads it
        self.comm = self.strategy.comm_timer(self.model)
        if cfg.checkpoint_dir and (path := self._agree_on_checkpoint_dir()):
            self.restore(self.read_checkpoint(path), checkpoint.step_of(path), restore)
            self.log.event("checkpoint_restored", self.step, path=os.path.basename(path), attempt=attempt)

    # ------------------------------------------------------------------ data

    def build_sampler(self) -> ResumableDistributedSampler:
        """This data-parallel rank's share of the global sample stream (override to study a broken one)."""
        return ResumableDistributedSampler(len(self.dataset), self.ctx.dp_size, self.ctx.dp_rank,
                                           self.cfg.global_batch_size, self.cfg.seed)

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

    # ------------------------------------------------------------------ checkpoints

    def _agree_on_checkpoint_dir(self) -> str | None:
        """Rank 0 decides what the checkpoint folder means for this run and tells the others, so all
        ranks load the same checkpoint or raise the same error: the newest good checkpoint to resume
        from; or, for a run that does not resume, an empty folder (refusing another run's checkpoints,
        or deleting them when told to)."""
        cfg, choice = self.cfg, [None]
        if self.ctx.is_main:
            if cfg.resume:
                choice = [str(checkpoint.latest_good(cfg.checkpoint_dir) or "")]
            elif cfg.overwrite_checkpoints:
                gone = checkpoint.clear(cfg.checkpoint_dir)
                choice = [""]
                if gone:
                    print(f"deleted {len(gone)} checkpoint(s) from {cfg.checkpoint_dir} (--overwrite-checkpoints)", flush=True)
            else:
                choice = ["!" + state.foreign_checkpoints_message(cfg.checkpoint_dir)] if checkpoint.list_checkpoints(cfg.checkpoint_dir) else [""]
        if self.ctx.is_distributed:
            dist.broadcast_object_list(choice, src=0, group=self.ctx.world_group)
        if choice[0].startswith("!"):
            raise CheckpointError(choice[0][1:])
        return choice[0] or None

    def save(self) -> tuple[float, int]:
        """Checkpoint now (every rank calls; rank 0 writes; all wait until it is durable). Returns (s, bytes)."""
        started, cfg = time.perf_counter(), self.cfg
        self.fold_data_hash()
        rngs = state.gather_rng_states(self.ctx.device)
        probe, nbytes, meta = self.probe_loss(), 0, state.meta(cfg)
        extra = {"scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
                 "sampler": self.sampler.state_dict(), "rng": rngs, "meta": meta,
                 "train": {"step": self.step, "consumed_samples": self.consumed,
                           "data_sha256": self.data_sha256, "probe_loss": probe}}
        if cfg.checkpoint_format == "dcp":  # every rank writes its own shards
            model_state, optimizer_state = self.strategy.sharded_state_dicts(self.model, self.optimizer)
            path = sharded_checkpoint.save(self.ctx, cfg.checkpoint_dir, self.step, model_state, optimizer_state,
                                           extra, meta, cfg.keep_last)
            if path is not None:
                nbytes = sharded_checkpoint.folder_bytes(path)
        else:  # rank 0 writes the whole state in one file
            model_state, optimizer_state = self.strategy.state_dicts(self.model, self.optimizer)
            if self.ctx.is_main:
                full = {"model": model_state, "optimizer": optimizer_state, **extra}
                path = checkpoint.save(cfg.checkpoint_dir, self.step, full, cfg.keep_last, meta=meta)
                nbytes = (path / checkpoint.STATE_FILE).stat().st_size
        if self.ctx.is_distributed:
            dist.barrier(group=self.ctx.world_group)  # nobody runs ahead of a checkpoint that is not yet durable
        return time.perf_counter() - started, nbytes

    def read_checkpoint(self, path: str) -> dict:
        """A checkpoint's content, whichever writer made it (collective for dcp: every rank reads the
        slices its own layout needs, into templates of that layout)."""
        if not sharded_checkpoint.is_dcp(path):
            return checkpoint.load(path)
        model_state, optimizer_state = self.strategy.sharded_state_dicts(self.model, self.optimizer)
        saved = sharded_checkpoint.load(self.ctx, path, model_state, optimizer_state)
        return {**saved, "format": "dcp"}

    def restore(self, saved: dict, saved_at_step: int, mode: str = "full") -> None:
        """Check ``saved``, load it, check again. ``mode="weights"`` loads everything but the optimizer and
        scaler: the popular half-measure, kept so that its cost can be measured (the Adam moments restart)."""
        cfg, full = self.cfg, mode == "full"
        state.check_compatible(saved["meta"], cfg)
        state.check_saved(saved, cfg, lr_at(cfg, saved["train"]["step"] - 1), saved_at_step,
                          set(self.raw_model.state_dict()), with_optimizer=full)
        if self.ctx.is_main and (note := state.torch_version_note(saved["meta"])):
            print(f"ddpkit: warning: {note}", file=sys.stderr, flush=True)
        dcp = saved.get("format") == "dcp"
        load = self.strategy.load_sharded_state_dicts if dcp else self.strategy.load_state_dicts
        load(self.model, self.optimizer if full else None, saved["model"], saved["optimizer"] if full else None)
        if dcp and not full:  # the dcp template created optimizer state; a weights-only restore starts it afresh
            self.optimizer.state.clear()
        if full and self.scaler.is_enabled():
            self.scaler.load_state_dict(saved["scaler"])
        state.check_probe(saved, self.probe_loss())
        train = saved["train"]
        self.step, self.consumed, self.data_sha256 = train["step"], train["consumed_samples"], train["data_sha256"]
        self.resumed_from = self.step
        self.sampler.load_state_dict(saved["sampler"])
        if saved["meta"]["world_size"] == self.ctx.world_size:
            state.set_rng_state(saved["rng"][self.ctx.rank], self.ctx.device)
        else:  # rank r of a new topology has no predecessor: reseed, deterministically
            seed_everything(cfg.seed + 1_000_003 * self.step + self.ctx.rank)

    # ------------------------------------------------------------------ the loop

    def run_step(self) -> StepResult:
        """One optimizer step with the hooks around it, logged."""
        cfg, ctx = self.cfg, self.ctx
        started, self.timer, lr = time.perf_counter(), PhaseTimer(ctx.device), lr_at(cfg, self.step)
        for hook in self.hooks:
            hook.before_step(self)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.comm.reset()
        micro_batches = []
        for _ in range(cfg.grad_accum):
            with self.timer("data_s"):
                micro_batches.append(self.next_micro_batch())
        self.step_rejected = False
        loss_sum, ids = train_step(self.model, self.optimizer, self.scaler, micro_batches, cfg, ctx.device,
                                   self.timer, self.strategy, self.judge if self.guard else None)
        if self.guard:  # the guard has already made the global loss
            total_loss = self._step_total
        else:
            with self.timer("sync_s"):  # the step's own small collectives, so "the rest" is accounted for
                total_loss = global_loss_sum(ctx, loss_sum)
        self.step += 1
        self.consumed += cfg.global_batch_size
        self._unhashed_ids.append(ids)
        if self.guard:
            self.after_verdict(total_loss / cfg.global_batch_size, ids)
        if len(self._unhashed_ids) >= DATA_HASH_EVERY:
            with self.timer("sync_s"):
                self.fold_data_hash()
        phases = {p: self.timer.seconds.get(p, 0.0) for p in metrics.PHASES if p != "comm_s"}
        phases["comm_s"] = self.comm.seconds
        result = StepResult(self.step, total_loss / cfg.global_batch_size, loss_sum / len(ids), lr, ids,
                            phases, self.comm.calls, self.comm.bytes)
        for hook in self.hooks:
            hook.after_step(self, result)
        result.step_time_s = time.perf_counter() - started
        self.losses.append({"step": result.step, "loss": result.loss})
        for p in metrics.PHASES:
            self.phase_totals[p] += result.phases[p]
        self.log.step(result.step, last=result.step == cfg.steps, loss=result.loss, local_loss=result.local_loss,
                      lr=result.lr, step_time_s=result.step_time_s, samples_per_s=cfg.global_batch_size / result.step_time_s,
                      comm_calls=result.comm_calls, comm_bytes=result.comm_bytes, checkpoint_s=result.checkpoint_s,
                      **result.phases)
        self.progress.step(result.step, cfg.steps, result.loss)
        return result

    # ------------------------------------------------------------------ the loss guard (guard.py)

    def judge(self, loss_sum: float, grad_norm: float) -> bool:
        """Apply this step? Asked by the step after backward, on every rank (see ``guard.py``)."""
        ctx = self.ctx
        with self.timer("sync_s"):
            self._step_total = global_loss_sum(ctx, loss_sum)
            verdict = self.guard.verdict(self._step_total / self.cfg.global_batch_size, grad_norm)
            code = torch.tensor([VERDICTS.index(verdict)], dtype=torch.int32)
            if ctx.is_distributed:  # the worst verdict of any rank is everyone's
                code = code.to(ctx.device)
                dist.all_reduce(code, op=dist.ReduceOp.MAX, group=ctx.world_group)
        self._verdict = VERDICTS[int(code.item())]
        return self._verdict == "ok"

    def after_verdict(self, loss: float, ids: list[int]) -> None:
        """Record an accepted step, or a rejected one (skip it, or roll back on the second in a row)."""
        if self._verdict == "ok":
            self.guard.accept(loss)
            return
        self.step_rejected = True
        global_ids = [i for i in gather_sample_ids(self.ctx, [ids])[0] if i >= 0]
        action = self.guard.reject(self.step, self._verdict, global_ids)
        self.log.event("step_rejected", self.step, reason=self._verdict, action=action)
        if self.ctx.is_main:
            print(f"ddpkit: step {self.step} rejected ({self._verdict} loss or gradient): {action}", flush=True)
        if action == "rollback":
            self.rollback()

    def rollback(self) -> None:
        """Every rank goes back to the newest good checkpoint's weights, optimizer and scaler; the data
        position, step count and sample fingerprint go on (the batches in between are undone)."""
        choice = [str(checkpoint.latest_good(self.cfg.checkpoint_dir) or "") if self.ctx.is_main and self.cfg.checkpoint_dir else ""]
        if self.ctx.is_distributed:
            dist.broadcast_object_list(choice, src=0, group=self.ctx.world_group)
        if not choice[0]:
            if self.guard.rejected_in_a_row >= MAX_REJECTED:
                raise GuardError(f"the loss guard rejected {MAX_REJECTED} steps in a row and there is no checkpoint to "
                                 f"roll back to: add --checkpoint-dir with --checkpoint-every, or lower --lr")
            return
        saved = self.read_checkpoint(choice[0])
        load = self.strategy.load_sharded_state_dicts if saved.get("format") == "dcp" else self.strategy.load_state_dicts
        load(self.model, self.optimizer, saved["model"], saved["optimizer"])
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(saved["scaler"])
        state.check_probe(saved, self.probe_loss())
        self.guard.rolled_back(self.step, saved["train"]["step"])
        self.log.event("rolled_back", self.step, to_step=saved["train"]["step"])
        if self.ctx.is_main:
            print(f"ddpkit: rolled back to the checkpoint of step {saved['train']['step']}", flush=True)

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
            print(f"ddpkit train: {cfg.model}, world {ctx.world_size} ({ctx.backend}, {ctx.device.type}, "
                  f"{cfg.strategy}, {ctx.dims.describe()}), global batch {cfg.global_batch_size} = "
                  f"{cfg.micro_batch_size} x {cfg.grad_accum} x {ctx.dp_size}, steps {self.step} -> {cfg.steps}, "
                  f"digest {cfg.digest()[:12]}", flush=True)
        self.strategy.prepare(self.model, micro_step(self.model, self.scaler, cfg, ctx.device, 1,
                                                     PhaseTimer(ctx.device), [], []), example_batch(cfg))

    def fit(self) -> dict:
        """Train to ``cfg.steps``; returns the run summary (every rank computes it, rank 0 writes it)."""
        cfg = self.cfg
        watchdog = StallWatchdog(cfg.timeout + STALL_MARGIN_S)
        watchdog.pet()
        try:
            self.prepare()
            while self.step < cfg.steps and not self.stop_requested:
                self.run_step()
                watchdog.pet()
            for hook in self.hooks:
                hook.on_end(self)
            return self.summary()
        finally:
            watchdog.stop()
            self.close()

    def close(self) -> None:
        """Close the logs and shut DataLoader workers down now (not when the garbage collector gets to it)."""
        if self.preemption is not None:
            self.preemption.uninstall()
        self.log.close()
        self.progress.close()
        self._batches = self.loader = None

    def summary(self) -> dict:
        """The run's result: hashes that prove what was trained on what, losses, phase times (collective)."""
        cfg, ctx = self.cfg, self.ctx
        self.fold_data_hash()
        ran = max(1, self.step - self.resumed_from)
        phase_means = metrics.reduce_across_ranks(ctx, {p: v / ran for p, v in self.phase_totals.items()})
        model_state, optimizer_state = self.strategy.state_dicts(self.model, self.optimizer, rank0_only=False)
        summary = {
            "world_size": ctx.world_size, "backend": ctx.backend, "model": cfg.model, "strategy": cfg.strategy,
            "dp": ctx.dims.dp, "tp": ctx.dims.tp, "pp": ctx.dims.pp,
            "global_batch_size": cfg.global_batch_size, "steps": self.step, "losses": self.losses,
            "param_sha256": metrics.state_sha256(model_state),
            "param_l2": metrics.state_l2(model_state), "data_sha256": self.data_sha256,
            "optimizer_sha256": metrics.optimizer_sha256(optimizer_state),
            "state_bytes_per_rank": self.strategy.state_bytes(self.model, self.optimizer),
            "checkpoint_format": cfg.checkpoint_format, "activation_checkpointing": cfg.activation_checkpointing,
            "resumed_from_step": self.resumed_from, "restarts": self.attempt, "config_digest": cfg.digest(),
            "emergency_checkpoint_step": self.preemption.saved_step if self.preemption else None,
            "rollbacks": self.guard.rollbacks if self.guard else 0,
            "skipped_batches": self.guard.skipped_batches if self.guard else [],
            "guard_events": self.guard.events if self.guard else [],
            "phase_s": phase_means, "wall_s": time.perf_counter() - self.started, "rank": ctx.rank,
        }
        self.log.event("end", self.step, param_sha256=summary["param_sha256"], data_sha256=self.data_sha256)
        if ctx.is_main:
            if self.losses:
                print(f"done: step {self.step}, loss {self.losses[0]['loss']:.4f} -> {self.losses[-1]['loss']:.4f}, "
                      f"param_sha256 {summary['param_sha256'][:16]}", flush=True)
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
