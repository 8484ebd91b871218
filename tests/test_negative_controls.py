"""Negative controls for the mechanisms lessons 01-08 assert: remove the mechanism, the same check fails.

A check that also passes with its mechanism removed proves nothing. The notebooks carry many of their
controls themselves, and ``tests/test_notebooks.py`` asserts both sides of each (no sampler vs a
sampler, hash() vs sha256, ``no_sync`` with the forward outside, views off vs on, fp16 without a
scaler, clipping before unscaling, without ``set_epoch``, padding kept, one seed on every rank, a
weights-only resume, buffer sync off, ...). This file holds the controls that need the library itself
changed: each test runs the real thing and the thing with one mechanism taken out, through one check.
"""

import contextlib
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit import checkpoint, files, metrics, step, train
from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.models import build_model, loss_fn
from test_train import SMALL, accumulated_grads


def _grads_without_dividing_by_accum(ctx, cfg, batch):
    step.MicroStep.loss = lambda self, per_sample, loss_scale=1.0: per_sample.mean() * loss_scale  # the bug
    return accumulated_grads(ctx, cfg, batch)


def _worst_gap_to_big_batch(cfg, batch, fn):
    got = launch(fn, cfg, batch, world_size=2, output="none")
    model = build_model(cfg)
    loss_fn(model(batch["inputs"]), batch["targets"]).backward()
    return max(float((g - p.grad).abs().max()) for rank_grads in got for g, p in zip(rank_grads, model.parameters()))


def test_accumulation_equals_the_big_batch_only_with_the_loss_divided_by_grad_accum():
    """05 and 01: ``loss / grad_accum`` is what makes accumulated gradients the big batch's."""
    cfg = TrainConfig(**SMALL, grad_clip=0.0, world_size=2, micro_batch_size=4, grad_accum=2)
    data = train.build_dataset(cfg)
    batch = {"index": torch.arange(16), "inputs": data.features[:16], "targets": data.labels[:16]}
    assert _worst_gap_to_big_batch(cfg, batch, accumulated_grads) < 1e-6
    assert _worst_gap_to_big_batch(cfg, batch, _grads_without_dividing_by_accum) > 1e-3  # twice the gradient


def _comm_calls_per_step(ctx, cfg, keep_no_sync):
    trainer = train.Trainer(ctx, cfg)
    if not keep_no_sync:
        trainer.strategy.no_sync = lambda model: contextlib.nullcontext()  # the mechanism, removed
    trainer.fit()
    return [e["comm_calls"] for e in metrics.read_metrics(cfg.metrics_dir) if e["rank"] == ctx.rank]


def test_the_trainer_communicates_once_per_step_only_because_of_no_sync(tmp_path):
    """05: the real trainer with grad_accum 4 sends one all-reduce round per step; without no_sync, four."""
    cfg = TrainConfig(**{**SMALL, "steps": 3}, world_size=2, grad_accum=4, micro_batch_size=2)
    kept = launch(_comm_calls_per_step, cfg.replace(metrics_dir=str(tmp_path / "kept")), True, world_size=2, output="none")[0]
    removed = launch(_comm_calls_per_step, cfg.replace(metrics_dir=str(tmp_path / "removed")), False, world_size=2,
                     output="none")[0]
    assert len(set(kept)) == 1 and removed == [4 * kept[0]] * 3


def _hashes_after_wrap(ctx, init_sync):
    torch.manual_seed(1000 * ctx.rank)  # a different initialisation on every rank, on purpose
    model = torch.nn.Linear(8, 8)
    DDP(model, init_sync=init_sync)
    return metrics.state_sha256(model.state_dict())


def test_replicas_start_equal_only_because_ddp_broadcasts_at_wrap():
    """03: the check "one parameter hash across ranks after wrapping" fails without DDP's initial sync."""
    assert len(set(launch(_hashes_after_wrap, True, world_size=2, output="none"))) == 1
    assert len(set(launch(_hashes_after_wrap, False, world_size=2, output="none"))) == 2


def test_topology_keeps_the_sample_stream_only_with_the_global_batch_kept():
    """01: the same data_sha256 across topologies holds because the global batch is kept; change it, it fails."""
    base = TrainConfig(**SMALL, world_size=2, micro_batch_size=4)
    same = [launch(train.run, c, world_size=c.world_size, output="none")[0]["data_sha256"]
            for c in (base, base.replace(world_size=1, micro_batch_size=8))]
    changed = launch(train.run, base.replace(micro_batch_size=2), world_size=2, output="none")[0]["data_sha256"]
    assert same[0] == same[1] and changed != same[0]


def _fsynced_inodes(monkeypatch, tmp_path, remove_folder_fsyncs):
    seen = set()
    real_fsync = os.fsync

    def spy(fd):
        info = os.fstat(fd)
        seen.add((info.st_dev, info.st_ino))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    if remove_folder_fsyncs:
        monkeypatch.setattr(checkpoint, "fsync_path", lambda path: None)
        monkeypatch.setattr(files, "fsync_path", lambda path: None)
    root = tmp_path / ("removed" if remove_folder_fsyncs else "kept")
    published = checkpoint.save(root, 1, {"w": torch.ones(4)})
    needed = [published / checkpoint.STATE_FILE, published / "manifest.json", published, root]
    return [p.name for p in needed if (os.stat(p).st_dev, os.stat(p).st_ino) not in seen]


def test_a_published_checkpoint_is_durable_only_because_every_file_and_folder_is_fsynced(tmp_path, monkeypatch):
    """06: state.pt, the manifest, the checkpoint folder and its parent are fsynced; drop the folder fsyncs and
    the same check names what a power cut could lose (the rename that published the checkpoint)."""
    assert _fsynced_inodes(monkeypatch, tmp_path, remove_folder_fsyncs=False) == []
    assert _fsynced_inodes(monkeypatch, tmp_path, remove_folder_fsyncs=True) != []
