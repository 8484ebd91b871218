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


# ------------------------------------------------------------------ 02: the sampler

def _epochs_seen(ctx, dataset_size, global_batch, epochs, removed=None):
    """Notebook 02's ``indices_seen``: this rank's sample ids, epoch by epoch, through a DataLoader."""
    from torch.utils.data import DataLoader

    from ddpkit.data import ResumableDistributedSampler

    original = ResumableDistributedSampler.epoch_order
    if removed == "seed":  # the shuffle drawn from a generator seeded afresh from the operating system
        ResumableDistributedSampler.epoch_order = lambda self, epoch: torch.randperm(
            self.dataset_len, generator=torch.Generator().manual_seed(torch.Generator().seed())).tolist()
    elif removed == "epoch":  # the epoch left out of the shuffle's seed
        ResumableDistributedSampler.epoch_order = lambda self, epoch: original(self, 0)
    seen = []
    for epoch in range(epochs):
        sampler = ResumableDistributedSampler(dataset_size, ctx.world_size, ctx.rank, global_batch, seed=17,
                                              consumed_samples=epoch * dataset_size)
        seen.append([int(i) for i in DataLoader(range(dataset_size), batch_size=None, sampler=sampler)])
    return seen


def test_a_sampler_whose_shuffle_is_not_seeded_deals_another_partition_each_run():
    """02: "deterministic: the same partition on every run" holds because the shuffle is seeded with
    seed + epoch; drawn from a fresh seed, two runs (and the two ranks) deal different orders."""
    from ddpkit.data import check_partition

    runs = {removed: [launch(_epochs_seen, 96, 16, 2, removed, world_size=2, output="none") for _ in range(2)]
            for removed in (None, "seed")}
    assert runs[None][0] == runs[None][1]
    assert all(check_partition([ranks[r][0] for r in range(2)], range(96)).ok for ranks in runs[None])
    assert runs["seed"][0] != runs["seed"][1]
    assert not check_partition([runs["seed"][0][r][0] for r in range(2)], range(96)).ok  # the ranks disagree too


def test_without_the_epoch_in_its_seed_the_sampler_repeats_its_order_and_leaves_torchs():
    """02: "a new order every epoch" and "bitwise PyTorch's own sampler" (at epoch 1) both come from
    seeding the shuffle with seed + epoch, as ``DistributedSampler.set_epoch`` does."""
    from torch.utils.data import DistributedSampler

    theirs = DistributedSampler(range(96), num_replicas=2, rank=0, seed=17, drop_last=True)
    theirs.set_epoch(1)
    for removed, same_order, like_torch in ((None, False, True), ("epoch", True, False)):
        ours = launch(_epochs_seen, 96, 16, 2, removed, world_size=2, output="none")
        assert (ours[0][0] == ours[0][1]) == same_order and (ours[0][1] == list(theirs)) == like_torch, removed


def _sampler_defaults(ctx):
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(10))
    return sampler.num_replicas, sampler.rank


def test_outside_a_process_group_the_sampler_has_no_defaults():
    """02: "defaults: the group's world size and rank": inside real ranks they are the group's; in a
    process that has no process group (this one) there is nothing to read them from."""
    import pytest
    from torch.utils.data import DistributedSampler

    assert launch(_sampler_defaults, world_size=2, output="none") == [(2, 0), (2, 1)]
    with pytest.raises((RuntimeError, ValueError)):
        DistributedSampler(range(10))


def _handbook_counts(num_workers: int) -> tuple[int, int]:
    """Notebook 02's handbook cell: four batches trained, and what the handbook's sampler counted."""
    from torch.utils.data import DataLoader

    from ddpkit.data import HandbookResumeSampler

    sampler = HandbookResumeSampler(range(96), num_replicas=1, rank=0, seed=17)
    loader = DataLoader(range(96), batch_size=1, sampler=sampler, num_workers=num_workers,
                        **({"prefetch_factor": 4, "multiprocessing_context": "fork"} if num_workers else {}))
    trained = 0
    for _ in loader:
        trained += 1
        if trained == 4:
            break
    return sampler.consumed, trained


def test_the_handbook_sampler_overcounts_only_because_workers_prefetch():
    """02: ``h.consumed > trained``: the DataLoader's workers pull indices ahead of training; without
    workers (nothing prefetched) the count trails training (it is advanced after each index is used)."""
    counted, trained = _handbook_counts(2)
    assert counted > trained
    counted, trained = _handbook_counts(0)
    assert trained == 4 and not counted > trained


def test_a_mid_epoch_resume_continues_the_partition_only_because_the_sampler_skips_what_was_consumed(monkeypatch):
    """02: a sampler resumed at ``consumed_samples`` continues the epoch where it stopped; one that starts
    each epoch from its beginning (the offset removed) repeats the steps already trained."""
    from ddpkit.data import ResumableDistributedSampler

    def split_at_two_steps():
        full = [list(ResumableDistributedSampler(96, 2, r, 16, 17)) for r in range(2)]
        before = [f[:16] for f in full]  # two steps of 8 per rank
        after = [list(ResumableDistributedSampler(96, 2, r, 16, 17, consumed_samples=32)) for r in range(2)]
        return [a + b for a, b in zip(before, after)] == full

    assert split_at_two_steps()
    monkeypatch.setattr(ResumableDistributedSampler, "__iter__",
                        lambda self: iter(self.epoch_order(self.epoch)[self.rank:self.samples_per_epoch:self.num_replicas]))
    assert not split_at_two_steps()


# ------------------------------------------------------------------ 03: the model and its optimizer

def _state_bytes_after_a_step(model, optimizer) -> int:
    """Bytes of optimizer state (every tensor but the step counters) after one real step."""
    x, y = torch.randn(8, 32), torch.randint(0, 8, (8,))
    loss_fn(model(x), y).backward()
    optimizer.step()
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items()
               if k != "step" and torch.is_tensor(t))


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_the_optimizer_holds_twice_the_weights_only_because_adamw_keeps_two_moments():
    """03: "AdamW: exp_avg + exp_avg_sq": 2 x the parameter bytes; an optimizer with one moment (SGD with
    momentum) holds 1 x, and the same check fails."""
    cfg = TrainConfig(**SMALL)
    model = build_model(cfg)
    assert _state_bytes_after_a_step(model, train.build_optimizer(model, cfg)) == 2 * _param_bytes(model)
    model = build_model(cfg)
    assert _state_bytes_after_a_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == _param_bytes(model)


def test_mixed_precision_holds_12_bytes_a_parameter_only_with_an_fp32_master_copy():
    """03: "12P of optimizer state in mixed precision": an fp32 master copy (4 B) and two fp32 moments
    (8 B) beside the bf16 weights; AdamW run on the bf16 weights themselves (no master) holds 4 B."""
    cfg = TrainConfig(**SMALL)
    half = build_model(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in half.parameters())
    master = [p.detach().float().clone().requires_grad_() for p in half.parameters()]
    with_master = torch.optim.AdamW(master)
    for p in master:
        p.grad = torch.zeros_like(p)
    with_master.step()
    state = sum(t.numel() * t.element_size() for t in master) + sum(
        t.numel() * t.element_size() for s in with_master.state.values() for k, t in s.items() if k != "step")
    assert state == 12 * n
    for p in half.parameters():  # the master copy removed: AdamW on the bf16 weights themselves
        p.grad = torch.zeros_like(p)
    direct = torch.optim.AdamW(half.parameters())
    direct.step()
    state = sum(t.numel() * t.element_size() for s in direct.state.values() for k, t in s.items() if k != "step")
    assert state == 4 * n


def _autocast_step(model, autocast: bool) -> tuple[torch.dtype, set, int]:
    """Notebooks 03 and 05: one real step; the logits' dtype, the dtypes and bytes held afterwards."""
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(8, 32), torch.randint(0, 8, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(x.to(next(model.parameters()).dtype))
    loss_fn(logits.float(), y).backward()
    optimizer.step()
    held = [*model.parameters(), *(p.grad for p in model.parameters()),
            *(t for s in optimizer.state.values() for k, t in s.items() if k != "step")]
    return logits.dtype, {t.dtype for t in held}, sum(t.numel() * t.element_size() for t in held)


def test_autocast_computes_in_bf16_and_holds_fp32_state_and_a_cast_model_does_not():
    """03 and 05: under autocast the matmuls run in bf16 while weights, gradients and Adam's state stay
    fp32 (16 B a parameter). Without autocast the logits are fp32; with the model cast to bf16 instead
    (no autocast at all) they are bf16 too, but so is everything held, 8 B a parameter."""
    cfg = TrainConfig(**SMALL)
    n = sum(p.numel() for p in build_model(cfg).parameters())
    assert _autocast_step(build_model(cfg), True) == (torch.bfloat16, {torch.float32}, 16 * n)
    assert _autocast_step(build_model(cfg), False)[0] == torch.float32
    logits, dtypes, nbytes = _autocast_step(build_model(cfg).to(torch.bfloat16), False)
    assert logits == torch.bfloat16 and dtypes == {torch.bfloat16} and nbytes == 8 * n


def test_the_trainers_replicas_hold_one_hash_only_because_ddp_all_reduces():
    """03: the trainer's "one parameter hash and one optimizer hash on every rank", and its match with the
    hand-written DDP loop, fail once DDP's gradient all-reduce is replaced by a hook that sends nothing."""
    from test_negative_controls_advanced import _ddp_without_the_all_reduce

    cfg = TrainConfig(**{**SMALL, "steps": 4}, world_size=2)
    kept = launch(train.run, cfg, world_size=2, output="none")
    removed = launch(_ddp_without_the_all_reduce, cfg, world_size=2, output="none")
    assert len({s["param_sha256"] for s in kept}) == len({s["optimizer_sha256"] for s in kept}) == 1
    assert len({s["param_sha256"] for s in removed}) == len({s["optimizer_sha256"] for s in removed}) == 2
    assert removed[0]["param_sha256"] != kept[0]["param_sha256"]
