"""Negative controls for the mechanisms lessons 01-08 assert: remove the mechanism, the same check fails.

A check that also passes with its mechanism removed proves nothing. The notebooks carry many of their
controls themselves (no sampler vs a sampler, hash() vs sha256, ``no_sync`` with the forward outside,
views off vs on, fp16 without a scaler, clipping before unscaling, ...), and ``tests/test_controls.py``
lists every notebook assert with the place its control is. This file holds the controls that need the
library (or torch) changed: each test runs the real thing and the thing with one mechanism taken out,
through the notebook's check, on real gloo ranks where the lesson uses ranks.
"""

import contextlib
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit import checkpoint, files, metrics, step, train
from ddpkit.hooks import Hook
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


# ------------------------------------------------------------------ 04: distributed init

def _pid(ctx):
    return os.getpid()


def test_ranks_are_processes_of_their_own_only_because_the_launcher_starts_them():
    """04: "one process per rank, none of them this kernel". Where the launcher starts nothing (the
    environment already says this process is a rank, as under torchrun) the rank is the caller itself."""
    import subprocess
    import sys

    from ddpkit.launch import free_port

    assert os.getpid() not in launch(_pid, world_size=2, output="none")
    script = ("import os; from ddpkit import launch; from test_negative_controls import _pid; "
              "print(launch(_pid, world_size=1, output='none') == [os.getpid()])")
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "True", done.stderr[-2000:]


def _threads(ctx):
    return torch.get_num_threads()


def test_forked_ranks_run_one_thread_only_because_the_launcher_sets_it(monkeypatch):
    """04: "one intra-op thread per forked rank", even where the user asked for two; without the rule
    (the user's OMP_NUM_THREADS taken for a forked rank too) the ranks run two threads each."""
    from ddpkit import runtime

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert launch(_threads, world_size=2, start_method="fork", output="none") == [1, 1]
    monkeypatch.setattr(runtime, "threads_per_rank", lambda forked=False: int(os.environ["OMP_NUM_THREADS"]))
    assert launch(_threads, world_size=2, start_method="fork", output="none") == [2, 2]


def _average(ctx, how):
    """Notebook 04's ``average``: each rank holds its rank id; what the group's reduction makes of it."""
    import torch.distributed as dist

    value = torch.full((3,), float(ctx.rank))
    if how == "divide, then SUM":
        value /= ctx.world_size
    if how == "AVG":
        try:
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        except (RuntimeError, ValueError):
            return None  # this gloo has no AVG
    else:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.tolist()


def test_an_all_reduce_averages_only_when_divided_by_the_world_size():
    """04: "divide, then SUM" (and AVG, where gloo has it) give the mean of the ranks' values; the same
    SUM without the division gives world_size times it, and the notebook's check fails."""
    expected = [1.0] * 3  # the mean of rank ids 0, 1, 2
    assert launch(_average, "divide, then SUM", world_size=3, output="none")[0] == expected
    assert launch(_average, "AVG", world_size=3, output="none")[0] in (expected, None)
    assert launch(_average, "SUM", world_size=3, output="none")[0] == [3.0] * 3 != expected


def _address_book(ctx, ports, shared: bool, atomic: bool):
    """Notebook 04's ``rendezvous``, with one store for all (``shared``) or one per rank, and a check-in
    counted by the store's atomic ``add`` or by reading then writing the count."""
    import datetime
    import socket

    import torch.distributed as dist

    port = ports[0] if shared else ports[ctx.rank]
    store = dist.TCPStore("127.0.0.1", port, ctx.world_size if shared else 1, is_master=ctx.rank == 0 or not shared,
                          timeout=datetime.timedelta(seconds=10))
    store.set(f"addr/{ctx.rank}", f"{socket.gethostname()}:{os.getpid()}")
    if atomic:
        arrived = store.add("arrived", 1)
    else:  # read, then write: both ranks read before either writes (the barrier makes the race certain)
        seen = int(store.get("arrived")) if store.check(["arrived"]) else 0
        dist.barrier()
        arrived = seen + 1
        store.set("arrived", str(arrived))
    keys = [f"addr/{r}" for r in range(ctx.world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=1))
    except Exception:  # noqa: BLE001 - a store nobody else writes to: the others' keys never come
        pass
    peers = [store.get(k).decode() if store.check([k]) else None for k in keys]
    dist.barrier()
    return {"checked_in": arrived, "peers": peers}


def test_ranks_share_an_address_book_only_through_one_store_and_check_in_once_only_by_an_atomic_add():
    """04: "every rank learned the same address book" needs one store for all; each rank on a store of
    its own learns only itself. The check-ins number 1..N because ``add`` is atomic; a read followed by
    a write lets two ranks take the same number."""
    from ddpkit.launch import free_port

    def book(shared, atomic):
        return launch(_address_book, [free_port(), free_port()], shared, atomic, world_size=2, output="none")

    kept = book(True, True)
    assert kept[0]["peers"] == kept[1]["peers"] and None not in kept[0]["peers"]
    assert sorted(p["checked_in"] for p in kept) == [1, 2]
    alone = book(False, True)
    assert alone[0]["peers"] != alone[1]["peers"]
    raced = book(True, False)
    assert sorted(p["checked_in"] for p in raced) == [1, 1]


_PROBE = ("import os; e = os.environ; print(f'OMP_NUM_THREADS={e.get(\"OMP_NUM_THREADS\")} "
          "TORCHELASTIC_USE_AGENT_STORE={e.get(\"TORCHELASTIC_USE_AGENT_STORE\")}')")


def _agent_store_flag(ctx):
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE")


def test_torchruns_environment_comes_from_its_agent_and_its_thread_rule():
    """04: torchrun's workers see TORCHELASTIC_USE_AGENT_STORE=True (its agent hosts the store) and
    OMP_NUM_THREADS=1 (it sets it for nproc-per-node > 1; notebook 04 runs 2). Ranks started without
    torchrun's agent do not have the flag; one worker per node does not get the thread setting."""
    import subprocess
    import sys

    assert launch(_agent_store_flag, world_size=2, output="none") == [None, None]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           "--no-python", sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    seen = [line for line in done.stdout.splitlines() if line.startswith("OMP_NUM_THREADS=")]
    assert done.returncode == 0 and seen == ["OMP_NUM_THREADS=None TORCHELASTIC_USE_AGENT_STORE=True"], done.stdout + done.stderr


def _one_rank_never_arrives(ctx, seconds=600.0):
    import time

    import torch.distributed as dist

    if ctx.rank == ctx.world_size - 1:
        time.sleep(seconds)  # stuck
    dist.barrier()


def test_the_stalled_rank_is_named_only_because_its_timed_out_peers_are_set_aside(monkeypatch):
    """04: the report names the rank that never arrived, kind "stalled", because the peers' collective
    timeouts are knock-on failures; counted as causes, the earliest of them (rank 0's) is named instead."""
    import pytest

    from ddpkit.failures import LaunchError, RankFailure

    with pytest.raises(LaunchError) as kept:
        launch(_one_rank_never_arrives, world_size=2, timeout=1.0, output="none")
    assert kept.value.rank == 1 and kept.value.root_cause.kind == "stalled"
    monkeypatch.setattr(RankFailure, "is_knock_on", property(lambda self: False))
    with pytest.raises(LaunchError) as removed:
        launch(_one_rank_never_arrives, world_size=2, timeout=1.0, output="none")
    assert not (removed.value.rank == 1 and removed.value.root_cause.kind == "stalled"), removed.value


def test_a_stalled_rank_is_given_up_on_only_within_the_timeout():
    """04: ``elapsed < timeout_s + 5``: the collective timeout and the launcher's watchdog end the job;
    with a timeout longer than the stall, the job waits the whole stall (a lower bound: no timing flake)."""
    import time

    import pytest

    from ddpkit.failures import LaunchError

    timeout_s = 1.0
    started = time.monotonic()
    with pytest.raises(LaunchError):
        launch(_one_rank_never_arrives, world_size=2, timeout=timeout_s, output="none")
    assert time.monotonic() - started < timeout_s + 5
    started = time.monotonic()
    launch(_one_rank_never_arrives, 6.5, world_size=2, timeout=60.0, output="none")  # the bound removed: it waits
    assert not time.monotonic() - started < timeout_s + 5


# ------------------------------------------------------------------ 06: checkpoints

SAVED = dict(SMALL, steps=4, checkpoint_every=4, world_size=2)


def _rank_0s_rng_only(ctx, cfg):
    from ddpkit import state

    state.gather_rng_states = lambda device: [state.rng_state(device)]  # the gather removed: rank 0's own only
    return train.run(ctx, cfg)


def test_a_checkpoint_holds_every_ranks_rng_only_because_they_are_gathered(tmp_path):
    """06: "every rank's RNG state, not just rank 0's": the save gathers each rank's generators; without
    the gather the checkpoint holds one, and the notebook's count fails."""
    for fn, expected in ((train.run, 2), (_rank_0s_rng_only, 1)):
        root = tmp_path / fn.__name__
        launch(fn, TrainConfig(**SAVED, checkpoint_dir=str(root)), world_size=2, output="none")
        assert len(checkpoint.load(checkpoint.latest_good(root))["rng"]) == expected


def _sgd_without_momentum(ctx, cfg):
    from ddpkit.parallel.ddp import DDPStrategy

    DDPStrategy.build_optimizer = lambda self, model, lr, weight_decay: torch.optim.SGD(model.parameters(), lr=lr)
    return train.run(ctx, cfg)


def test_a_checkpoint_is_three_times_the_weights_only_because_adamw_keeps_two_moments(tmp_path):
    """06: "weights + 2 Adam moments, plus small state": ``3 P <= file < 3 P x 1.05 + 64 KiB``; trained with
    an optimizer that keeps no moments (plain SGD), the file is about the weights alone."""
    for fn, moments in ((train.run, True), (_sgd_without_momentum, False)):
        root = tmp_path / fn.__name__
        launch(fn, TrainConfig(**SAVED, checkpoint_dir=str(root)), world_size=2, output="none")
        newest = checkpoint.latest_good(root)
        param_bytes = sum(t.numel() * t.element_size() for t in checkpoint.load(newest)["model"].values())
        file_bytes = (newest / checkpoint.STATE_FILE).stat().st_size
        assert (3 * param_bytes <= file_bytes < 3 * param_bytes * 1.05 + 2**16) == moments, (file_bytes, param_bytes)


def _two_saves_the_newest_torn(root):
    import warnings

    for step in (5, 10):
        checkpoint.save(root, step, {"w": torch.full((1000,), float(step))})
    newest = root / "step-00000010" / checkpoint.STATE_FILE
    with open(newest, "r+b") as handle:
        handle.truncate(newest.stat().st_size // 2)  # damaged after it was published, as in notebook 06
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = checkpoint.latest_good(root)
    return chosen.name, [str(w.message) for w in caught]


def test_a_torn_newest_checkpoint_is_chosen_once_verification_is_removed(tmp_path, monkeypatch):
    """06: the truncated newest checkpoint is skipped with a warning for the one before; with the manifest
    check removed it is the one a resume would load, and nothing warns."""
    chosen, warned = _two_saves_the_newest_torn(tmp_path / "kept")
    assert chosen == "step-00000005" and any("step-00000010" in w for w in warned)
    monkeypatch.setattr(checkpoint, "verify", lambda path, deep=True: None)
    chosen, warned = _two_saves_the_newest_torn(tmp_path / "removed")
    assert chosen == "step-00000010" and not warned


def test_dead_temporary_folders_stay_once_the_sweep_is_removed(tmp_path, monkeypatch):
    """06: "the next save cleans up the dead temporary folder": the pruning after each save deletes every
    ``.tmp-step-*`` left by an interrupted save; without that sweep the dead folder stays."""
    from pathlib import Path

    def dead_folder_after_a_save(root):
        checkpoint.save(root, 1, {"w": torch.ones(4)})
        partial = root / ".tmp-step-00000009-4242"
        partial.mkdir()
        (partial / checkpoint.STATE_FILE).write_bytes(b"half a checkpoint")
        checkpoint.save(root, 2, {"w": torch.ones(4)})
        return partial.exists()

    assert not dead_folder_after_a_save(tmp_path / "kept")
    real_glob = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pattern, **kw: iter(()) if pattern == ".tmp-step-*"
                        else real_glob(self, pattern, **kw))
    assert dead_folder_after_a_save(tmp_path / "removed")


def _resume_without_its_checks(ctx, cfg):
    from ddpkit import state

    for name in ("check_compatible", "check_saved", "check_probe"):
        setattr(state, name, lambda *args, **kwargs: None)
    return train.run(ctx, cfg)


def test_crafted_bad_resumes_are_accepted_once_the_resume_checks_are_removed(tmp_path):
    """06: each crafted bad resume is refused with its words (one case for each of the three checks:
    the config, the saved state, the loss probe); with the checks removed every one of them resumes."""
    from ddpkit.failures import LaunchError

    good = tmp_path / "good"
    cfg = TrainConfig(**SAVED, checkpoint_dir=str(good))
    launch(train.run, cfg, world_size=2, output="none")
    crafted = {  # case -> (change to the checkpoint, change to the config, words of the refusal)
        "learning rate changed": (None, dict(lr=1e-2), "resuming would change training (lr"),
        "sampler position": (lambda s: s["train"].update(consumed_samples=s["train"]["consumed_samples"] - 8), {},
                             "sampler position"),
        "loss not continuous": (lambda s: s.update(model=build_model(cfg.replace(seed=99)).state_dict()), {},
                                "loss is not continuous"),
    }
    for case, (change, config_change, words) in crafted.items():
        for fn in (train.run, _resume_without_its_checks):
            root = tmp_path / f"{case.replace(' ', '-')}-{fn.__name__}"
            bad = checkpoint.load(checkpoint.latest_good(good))
            if change:
                change(bad)
            checkpoint.save(root, cfg.steps, bad)
            try:
                launch(fn, cfg.replace(steps=6, checkpoint_dir=str(root), resume=True, **config_change), world_size=2,
                       output="none")
                refusal = None
            except LaunchError as err:
                refusal = err.root_cause.message
            assert bool(refusal and words in refusal) == (fn is train.run), (case, fn.__name__, refusal)


def _without_the_clock(ctx, cfg):
    from ddpkit.hooks import CheckpointEvery

    CheckpointEvery.time_is_due = lambda self, trainer: False  # the time trigger removed
    return train.run(ctx, cfg)


def _gaps_over_the_bound(metrics_dir: str, every_s: float) -> int:
    """Notebook 06's time-trigger check: how many gaps between saves exceed every_s plus the step that
    saved (measured from the previous step's end) plus 50 ms."""
    step_events = {e["step"]: e for e in metrics.read_metrics(metrics_dir) if e["rank"] == 0}
    saves = [e for e in metrics.read_metrics(metrics_dir, event="checkpoint_saved") if e["rank"] == 0]
    first = step_events[1]["time"] - step_events[1]["step_time_s"]
    times = [first] + [e["time"] for e in saves]
    ends = {s: e["time"] for s, e in step_events.items()}
    bounds = [every_s + ends[e["step"]] - ends.get(e["step"] - 1, first) + 0.05 for e in saves]
    return sum(b - a > bound for a, b, bound in zip(times, times[1:], bounds))


def test_saves_stay_within_every_s_only_because_the_clock_is_checked(tmp_path):
    """06: "every gap within every_s + one step" on a run whose steps slow down (a straggler sleeping
    0.1 s a step); with the clock's check removed only the last step saves and the gap, at least the ten
    slow steps' sleep (a lower bound, not a timing guess), is far over the bound."""
    every_s = 0.15
    over = {}
    for fn in (train.run, _without_the_clock):
        folder = tmp_path / fn.__name__
        cfg = TrainConfig(**{**SMALL, "steps": 12}, world_size=2, checkpoint_every_s=every_s, fail_mode="slow", fail_rank=1,
                          fail_at_step=2, slow_step_s=0.1, checkpoint_dir=str(folder / "ck"), metrics_dir=str(folder / "m"))
        launch(fn, cfg, world_size=2, output="none")
        over[fn.__name__] = _gaps_over_the_bound(str(folder / "m"), every_s)
    assert over == {"run": 0, "_without_the_clock": 1}, over


# ------------------------------------------------------------------ 07: metrics

def _every_rank_prints(ctx, cfg):
    original = metrics.MetricsLogger.__init__

    def everyone(self, ctx, metrics_dir, log_every=10, console=None):
        original(self, ctx, metrics_dir, log_every, console=True)  # the "rank 0 only" rule removed

    metrics.MetricsLogger.__init__ = everyone
    return train.run(ctx, cfg)


def test_only_rank_0_prints_the_loss_table_because_the_logger_asks_is_main(tmp_path):
    """07: "console on rank 0 only", read from each rank's own log with every rank's output relayed:
    the logger prints when its rank is the main one; told every rank may, rank 1 prints it too."""
    cfg = TrainConfig(**{**SMALL, "steps": 3, "log_every": 1}, world_size=2)
    for fn, alone in ((train.run, True), (_every_rank_prints, False)):
        logs = tmp_path / fn.__name__
        launch(fn, cfg, world_size=2, output="none", log_dir=str(logs))
        printed = ["samples/s" in (logs / f"rank{r}.log").read_text() for r in range(2)]
        assert (printed == [True, False]) == alone, (fn.__name__, printed)


class _Sink(Hook):
    """Notebook 16's MetricsSink: what a hook plugged in on every rank is told after each step."""

    def __init__(self):
        self.sent = []

    def after_step(self, trainer, result):
        self.sent.append((result.step, round(result.loss, 4)))


def _sink_sees(ctx, cfg, local_only):
    from ddpkit.step import GlobalLossSum

    if local_only:  # the loss all-reduce removed: each rank reports its own batch as if it were everyone's
        GlobalLossSum.__call__ = lambda self, loss_sum: loss_sum * ctx.world_size
    sink = _Sink()
    train.Trainer(ctx, cfg, hooks=[sink]).fit()
    return sink.sent


def test_every_rank_sees_one_global_loss_only_because_it_is_all_reduced():
    """16 (and 07): a hook on every rank sees the same loss at every step because the trainer all-reduces
    each step's loss; without that all-reduce each rank sees its own batch's."""
    cfg = TrainConfig(**{**SMALL, "steps": 3}, world_size=2)
    kept = launch(_sink_sees, cfg, False, world_size=2, output="none")
    removed = launch(_sink_sees, cfg, True, world_size=2, output="none")
    assert all(s == kept[0] and len(s) == 3 for s in kept)
    assert not all(s == removed[0] and len(s) == 3 for s in removed)


def _healthy_rank_step_times(ctx, with_ddp: bool, slow_s: float, steps: int = 8):
    """A training loop whose rank 1 loads each batch ``slow_s`` late; rank 0's step times."""
    import time

    model = build_model(TrainConfig(**SMALL))
    wrapped = DDP(model) if with_ddp else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(ctx.rank)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        if ctx.rank == 1:
            time.sleep(slow_s)  # the straggler's slow input
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 8, (8,), generator=g)
        loss_fn(wrapped(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def test_a_straggler_slows_a_healthy_rank_only_through_a_collective():
    """07: "the healthy rank is slowed by about as much" (its step time grows by more than 0.6 x the
    straggler's delay): DDP's gradient all-reduce waits for the straggler every step; the same loop
    without DDP (no collective) leaves the healthy rank's steps at their own few milliseconds."""
    slow_s = 0.2
    with_ddp = launch(_healthy_rank_step_times, True, slow_s, world_size=2, output="none")[0]
    alone = launch(_healthy_rank_step_times, False, slow_s, world_size=2, output="none")[0]
    assert with_ddp > 0.6 * slow_s and not alone > 0.6 * slow_s, (with_ddp, alone)


def _straggler_phase_growth(tmp_path, fn, slow_s):
    """Notebook 07's straggler cell: how much rank 0's phases grew, median after the slowdown minus before."""
    import statistics

    cfg = TrainConfig(**{**SMALL, "steps": 10}, world_size=2, metrics_dir=str(tmp_path / fn.__name__), fail_mode="slow",
                      fail_rank=1, fail_at_step=4, slow_step_s=slow_s)
    launch(fn, cfg, world_size=2, output="none")
    events = [e for e in metrics.read_metrics(cfg.metrics_dir) if e["rank"] == 0]
    before = [e for e in events if 1 < e["step"] <= 4]
    after = [e for e in events if e["step"] > 5]
    return {k: statistics.median(e[k] for e in after) - statistics.median(e[k] for e in before)
            for k in ("data_s", "backward_s", "sync_s")}


def test_a_straggler_holds_the_healthy_rank_inside_backward_only_through_ddps_all_reduce(tmp_path):
    """07: "...waiting inside backward, for the all-reduce": the healthy rank's wait lands in backward
    because DDP all-reduces the gradients there. With that all-reduce removed the wait moves to the
    next collective, the step's loss all-reduce (sync_s), and the notebook's backward check fails."""
    from test_negative_controls_advanced import _ddp_without_the_all_reduce

    slow_s = 0.2
    kept = _straggler_phase_growth(tmp_path, train.run, slow_s)
    removed = _straggler_phase_growth(tmp_path, _ddp_without_the_all_reduce, slow_s)
    assert kept["data_s"] < 0.3 * slow_s and kept["backward_s"] > 0.5 * slow_s, kept
    assert not removed["backward_s"] > 0.5 * slow_s and removed["sync_s"] > 0.5 * slow_s, removed


# ------------------------------------------------------------------ 08: launch, kill, restart

def _rank_1_dies_after_its_peer_failed(ctx):
    """Rank 1 drops its connections (rank 0, waiting in a barrier, fails at once: a knock-on failure),
    then is killed 0.4 s later: the knock-on comes first in time, the cause second."""
    import signal
    import time

    import torch.distributed as dist

    if ctx.rank == 1:
        dist.destroy_process_group()
        time.sleep(0.4)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_the_killed_rank_is_named_only_because_knock_on_failures_are_set_aside(monkeypatch):
    """08 (and 15): "the root cause is rank 1" and "the other ranks are listed as knock-on, not as causes":
    a peer's "connection closed" is a consequence, set aside even when it came first. Counted as a cause
    like any other, the first failure in time (rank 0's) is named, and both checks fail."""
    import pytest

    from ddpkit.failures import LaunchError, RankFailure

    with pytest.raises(LaunchError) as kept:
        launch(_rank_1_dies_after_its_peer_failed, world_size=2, timeout=10, output="none")
    assert kept.value.rank == 1 and kept.value.root_cause.exc_type == "SIGKILL"
    assert all(f.rank != 1 for f in kept.value.others)
    monkeypatch.setattr(RankFailure, "is_knock_on", property(lambda self: False))
    with pytest.raises(LaunchError) as removed:
        launch(_rank_1_dies_after_its_peer_failed, world_size=2, timeout=10, output="none")
    assert removed.value.rank != 1 and not all(f.rank != 1 for f in removed.value.others), removed.value


def _rank_1_killed(ctx):
    import signal

    import torch.distributed as dist

    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no Python error, no exit code of its own
    dist.barrier()


def test_a_killed_rank_is_reported_killed_by_sigkill_only_because_its_exit_signal_is_read(monkeypatch):
    """08: the report says "killed", "SIGKILL": the launcher reads the signal from the exit status
    (negative: -9); with that reading removed (the status taken as a plain exit code) it says neither."""
    import pytest

    from ddpkit import failures, monitor

    with pytest.raises(failures.LaunchError) as kept:
        launch(_rank_1_killed, world_size=2, timeout=10, output="none")
    assert kept.value.root_cause.kind == "killed" and kept.value.root_cause.exc_type == "SIGKILL"
    read = failures.exit_failure
    monkeypatch.setattr(monitor, "exit_failure", lambda rank, code, when, tail="": read(rank, abs(code), when, tail))
    with pytest.raises(failures.LaunchError) as removed:
        launch(_rank_1_killed, world_size=2, timeout=10, output="none")
    cause = removed.value.root_cause
    assert not (cause.kind == "killed" and cause.exc_type == "SIGKILL"), cause


def test_torchrun_without_restarts_ends_the_killed_run_in_failure(tmp_path):
    """08: torchrun's run with a rank killed ends with exit 0, one restart and the uninterrupted run's
    weights because of ``--max-restarts`` (tests/test_cli.py runs that side); with no restart allowed the
    same run fails and writes no summary."""
    import subprocess
    import sys

    summary = tmp_path / "tr.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "0", "-m", "ddpkit", "train", "--steps", "6", "--dataset-size", "512",
                           "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2", "--fail-at-step", "3",
                           "--fail-rank", "1", "--fail-mode", "kill", "--timeout", "10", "--summary-json", str(summary)],
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0 and not summary.exists(), done.stdout[-2000:]
    assert "Signal 9 (SIGKILL)" in done.stdout + done.stderr  # the injected kill, not some other failure
