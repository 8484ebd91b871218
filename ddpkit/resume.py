"""A trainer's state in and out of checkpoints: save it, choose where a resume starts, restore, roll back.

The storage protocol (folders, manifests, verification) is ``checkpoint.py``, with ``sharded_checkpoint.py``
for the ``dcp`` writer; what an exact resume needs and how a restore is checked is ``state.py``. This
module applies them to a running trainer (``trainer`` below is the rank's :class:`~ddpkit.train.Trainer`,
passed in: nothing here imports it):

* :func:`save`: every rank calls it at the same step. ``full``: rank 0 gathers and writes one file;
  ``dcp``: every rank writes its shards. Then every rank waits until the checkpoint is durable. A save has
  its own time bound, ``--save-timeout``, not the collective ``--timeout``: the wait for rank 0's write
  runs on a process group created with that timeout, and the stall watchdog allows the save that long.
* :func:`choose`: rank 0 decides what the checkpoint folder means for this run and tells the others, so
  that every rank loads the same checkpoint or raises the same one-line error.
* :func:`read` and :func:`restore`: read a checkpoint (either writer), check it, load it, check again.
* :func:`roll_back`: the loss guard's rollback to the newest good checkpoint (``guard.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import time

import torch.distributed as dist

from ddpkit import checkpoint, preemption, sharded_checkpoint, state
from ddpkit.checkpoint import CheckpointError
from ddpkit.runtime import seed_everything
from ddpkit.step import lr_at

RESTORE_MODES = ("full", "weights")


def save_group(ctx, cfg):
    """The process group a save waits on, with ``cfg.save_timeout`` (collective: every rank calls it once)."""
    if not (cfg.checkpoint_dir and ctx.is_distributed):
        return None
    return dist.new_group(ranks=list(range(ctx.world_size)), timeout=datetime.timedelta(seconds=cfg.save_timeout))


def _within_save_bound(trainer):
    """The stall watchdog allows a save ``--save-timeout`` (it is running only inside ``fit``)."""
    return trainer.watchdog.allow(trainer.cfg.save_timeout) if trainer.watchdog else contextlib.nullcontext()


def save(trainer) -> tuple[float, int]:
    """Checkpoint now (every rank calls; the writer writes; all wait until it is durable). Returns (s, bytes)."""
    started, cfg, ctx = time.perf_counter(), trainer.cfg, trainer.ctx
    group = getattr(trainer, "save_group", None) or ctx.world_group
    with _within_save_bound(trainer):
        trainer.fold_data_hash()
        rngs = state.gather_rng_states(ctx.device)
        probe, nbytes, meta = trainer.probe_loss(), 0, state.meta(cfg)
        extra = {"scaler": trainer.scaler.state_dict() if trainer.scaler.is_enabled() else {},
                 "sampler": trainer.sampler.state_dict(), "rng": rngs, "meta": meta,
                 "train": {"step": trainer.step, "consumed_samples": trainer.consumed, "data_sha256": trainer.data_sha256,
                           "probe_loss": probe, "applied_steps": trainer.applied_steps,
                           "guard": trainer.guard.state_dict() if trainer.guard else {}}}
        if cfg.checkpoint_format == "dcp":  # every rank writes its own shards
            model_state, optimizer_state = trainer.strategy.sharded_state_dicts(trainer.model, trainer.optimizer)
            path = sharded_checkpoint.save(ctx, cfg.checkpoint_dir, trainer.step, model_state, optimizer_state,
                                           extra, meta, cfg.keep_last, group=group)
            if path is not None:
                nbytes = sharded_checkpoint.folder_bytes(path)
        else:  # rank 0 writes the whole state in one file
            model_state, optimizer_state = trainer.strategy.state_dicts(trainer.model, trainer.optimizer)
            if ctx.is_main:
                full = {"model": model_state, "optimizer": optimizer_state, **extra}
                path = checkpoint.save(cfg.checkpoint_dir, trainer.step, full, cfg.keep_last, meta=meta)
                nbytes = (path / checkpoint.STATE_FILE).stat().st_size
        if ctx.is_distributed:
            dist.barrier(group=group)  # nobody runs ahead of a checkpoint that is not yet durable
    return time.perf_counter() - started, nbytes


def choose(ctx, cfg) -> str | None:
    """Rank 0 decides what the checkpoint folder means for this run and tells the others: the newest good
    checkpoint to resume from (refusing a folder whose checkpoints none verifies); or, for a run that does
    not resume, an empty folder (refusing another run's checkpoints, or deleting them when told to)."""
    choice = [None]
    if ctx.is_main:
        try:
            if cfg.resume:
                choice = [str(checkpoint.resume_point(cfg.checkpoint_dir) or "")]
            elif cfg.overwrite_checkpoints:
                gone = checkpoint.clear(cfg.checkpoint_dir)
                preemption.clear_marker(cfg.checkpoint_dir)
                choice = [""]
                if gone:
                    print(f"deleted {len(gone)} checkpoint(s) from {cfg.checkpoint_dir} (--overwrite-checkpoints)", flush=True)
            elif checkpoint.list_checkpoints(cfg.checkpoint_dir):
                raise CheckpointError(state.foreign_checkpoints_message(cfg.checkpoint_dir))
            else:
                choice = [""]
        except CheckpointError as exc:
            choice = ["!" + str(exc)]
    if ctx.is_distributed:
        dist.broadcast_object_list(choice, src=0, group=ctx.world_group)
    if choice[0].startswith("!"):
        raise CheckpointError(choice[0][1:])
    return choice[0] or None


def read(trainer, path: str) -> dict:
    """A checkpoint's content, whichever writer made it (collective for dcp: every rank reads the slices
    its own layout needs, into templates of that layout)."""
    if not sharded_checkpoint.is_dcp(path):
        return checkpoint.load(path)
    model_state, optimizer_state = trainer.strategy.sharded_state_dicts(trainer.model, trainer.optimizer)
    saved = sharded_checkpoint.load(trainer.ctx, path, model_state, optimizer_state)
    return {**saved, "format": "dcp"}


def _load(trainer, saved: dict, with_optimizer: bool = True) -> None:
    dcp = saved.get("format") == "dcp"
    load = trainer.strategy.load_sharded_state_dicts if dcp else trainer.strategy.load_state_dicts
    load(trainer.model, trainer.optimizer if with_optimizer else None, saved["model"],
         saved["optimizer"] if with_optimizer else None)
    if dcp and not with_optimizer:  # the dcp template created optimizer state; a weights-only restore starts it afresh
        trainer.optimizer.state.clear()
    if with_optimizer and trainer.scaler.is_enabled():
        trainer.scaler.load_state_dict(saved["scaler"])
    state.check_probe(saved, trainer.probe_loss())


def restore(trainer, saved: dict, saved_at_step: int, mode: str = "full") -> None:
    """Check ``saved``, load it, check again. ``mode="weights"`` loads everything but the optimizer and
    scaler: the popular half-measure, kept so that its cost can be measured (the Adam moments restart)."""
    cfg, ctx, full = trainer.cfg, trainer.ctx, mode == "full"
    state.check_structure(saved)
    state.check_compatible(saved["meta"], cfg)
    state.check_saved(saved, cfg, lr_at(cfg, saved["train"]["step"] - 1), saved_at_step,
                      set(trainer.raw_model.state_dict()), with_optimizer=full)
    if ctx.is_main and (note := state.torch_version_note(saved["meta"])):
        print(f"ddpkit: warning: {note}", file=sys.stderr, flush=True)
    _load(trainer, saved, with_optimizer=full)
    train = saved["train"]
    trainer.step, trainer.consumed, trainer.data_sha256 = train["step"], train["consumed_samples"], train["data_sha256"]
    trainer.applied_steps = train.get("applied_steps", train["step"]) if full else 0
    if trainer.guard is not None and train.get("guard"):
        trainer.guard.load_state_dict(train["guard"])
    trainer.resumed_from = trainer.step
    trainer.sampler.load_state_dict(saved["sampler"])
    if saved["meta"]["world_size"] == ctx.world_size:
        state.set_rng_state(saved["rng"][ctx.rank], ctx.device)
    else:  # rank r of a new topology has no predecessor: reseed, deterministically
        seed_everything(cfg.seed + 1_000_003 * trainer.step + ctx.rank)
    if ctx.is_main:
        preemption.clear_marker(cfg.checkpoint_dir)


def roll_back(trainer) -> int | None:
    """Every rank goes back to the newest good checkpoint's weights, optimizer and scaler; the data
    position, step count and sample fingerprint go on (the batches in between are undone). Returns the
    checkpoint's step, or None when there is none yet."""
    ctx, cfg = trainer.ctx, trainer.cfg
    choice = [str(checkpoint.latest_good(cfg.checkpoint_dir) or "") if ctx.is_main and cfg.checkpoint_dir else ""]
    if ctx.is_distributed:
        dist.broadcast_object_list(choice, src=0, group=ctx.world_group)
    if not choice[0]:
        return None
    with _within_save_bound(trainer):
        saved = read(trainer, choice[0])
        _load(trainer, saved)
    trainer.applied_steps = saved["train"].get("applied_steps", saved["train"]["step"])
    return saved["train"]["step"]
