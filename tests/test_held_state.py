"""State that stays sharded: each rank saves and loads only what it holds, measured in memory per rank;
the chunk arithmetic; and the async snapshot on the host."""

import ctypes
import math
import sys

import pytest
import torch

from ddpkit import checkpoint, resume
from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.parallel.chunks import Chunked, flat_range_chunks
from ddpkit.train import Trainer

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident set from /proc")
WIDE = dict(model="gpt", d_model=256, n_layers=2, dataset_size=256, micro_batch_size=2, steps=4, log_every=100)


def test_a_flat_range_is_cut_into_rectangles_that_cover_it_once():
    for shape in [(6, 4), (3, 5, 4), (7,), ()]:
        n = math.prod(shape)
        for start in range(n + 1):
            for stop in range(start, n + 1):
                marks = torch.zeros(shape, dtype=torch.int64)
                for offsets, sizes in flat_range_chunks(shape, start, stop):
                    view = marks
                    for dim, (o, s) in enumerate(zip(offsets, sizes)):
                        view = view.narrow(dim, o, s)
                    view += 1
                expected = torch.zeros(n, dtype=torch.int64)
                expected[start:stop] = 1
                assert torch.equal(marks.reshape(-1), expected), (shape, start, stop)


def _resident(key: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(key))


def _peak_growth(fn) -> int:
    """Bytes by which this process's resident set grew at its highest while ``fn`` ran."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets the high-water mark (VmHWM) to the current resident set
    before = _resident("VmRSS:")
    fn()
    return _resident("VmHWM:") - before


def _save_and_load(ctx, cfg, root: str, whole_everywhere: bool) -> dict:
    """Train a step, then measure a dcp save and a dcp load of it. ``whole_everywhere`` hands DCP every
    rank the whole state instead (the gather this replaced): the negative control."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: large blocks go back to the OS when freed
    trainer = Trainer(ctx, cfg.replace(checkpoint_dir=root, checkpoint_format="dcp"))
    trainer.prepare()
    trainer.run_step()
    strategy = trainer.strategy
    if whole_everywhere:
        strategy.sharded_state_dicts = lambda model, optimizer: strategy.state_dicts(model, optimizer, rank0_only=False)
    held = strategy.state_bytes(trainer.model, trainer.optimizer)
    largest = max(t.numel() * t.element_size() for t in trainer.raw_model.state_dict().values())
    trainer.save()  # the first save imports and plans: not measured
    probe = trainer.probe_loss()
    trainer.probe_loss = lambda: probe  # its forward pass is not the checkpoint's memory
    trainer.step += 1
    save = _peak_growth(trainer.save)
    path = str(checkpoint.latest_good(root))

    def load():
        saved = resume.read(trainer, path)
        if not whole_everywhere:
            strategy.load_sharded_state_dicts(trainer.model, trainer.optimizer, saved["model"], saved["optimizer"])

    load()
    grown = _peak_growth(load)
    if whole_everywhere:  # the full writer's old gather: the whole state on every rank
        whole = strategy.state_dicts
        strategy.state_dicts = lambda model, optimizer, rank0_only=True: whole(model, optimizer, rank0_only=False)
    trainer.cfg = trainer.cfg.replace(checkpoint_format="full", checkpoint_dir=root + "-full")
    trainer.save()
    trainer.step += 1
    full = _peak_growth(trainer.save)
    return {"save": save, "load": grown, "full_save": full, "own": held["params"] + held["optimizer"],
            "optimizer": held["optimizer"], "largest": largest}


@LINUX
@pytest.mark.parametrize("layout", [dict(strategy="zero1"), dict(tp=2), dict(pp=2)], ids=["zero1", "tp", "pp"])
def test_a_sharded_save_and_load_grow_a_rank_by_at_most_its_largest_tensor(tmp_path, layout):
    cfg = TrainConfig(world_size=2, **WIDE, **layout)
    kept = launch(_save_and_load, cfg, str(tmp_path / "kept"), False, world_size=2, output="none")
    gathered = launch(_save_and_load, cfg, str(tmp_path / "gathered"), True, world_size=2, output="none")
    for rank, (ours, theirs) in enumerate(zip(kept, gathered)):
        # one tensor in flight, and DCP's own bookkeeping with what the process touches around it: the resident
        # set measures pages, and beside other work a save grew 2.7 MiB here (0.5 MiB the largest tensor)
        slack = ours["largest"] + 3 * 2**20
        # DCP (torch 2.13) writes a compact copy of a tensor that is a view into a larger storage, and keeps
        # every such copy until the rank's file is closed: ZeRO-1's chunks are views of its flat shard
        views = ours["optimizer"] if layout.get("strategy") == "zero1" else 0
        assert ours["save"] <= slack + views and ours["load"] <= slack, (rank, ours)
        # the whole state on every rank costs more than this rank's own state and a tensor besides
        assert theirs["save"] > ours["own"] + slack or theirs["load"] > ours["own"] + slack, (rank, theirs, ours)
        if rank > 0:  # a full checkpoint gathers to rank 0 only: the others send their chunks and keep nothing
            assert ours["full_save"] <= slack < ours["own"] + slack < theirs["full_save"], (rank, ours, theirs)


def _snapshot_of_fsdp_state(ctx, cfg):
    from ddpkit import sharded_checkpoint

    trainer = Trainer(ctx, cfg)
    trainer.prepare()
    trainer.run_step()
    model_state, optimizer_state = trainer.strategy.sharded_state_dicts(trainer.model, trainer.optimizer)
    live = model_state["net.0.weight"]
    snap = sharded_checkpoint._snapshot({"model": model_state, "optimizer": optimizer_state["state"]})
    leaf = snap["model"]["net.0.weight"]
    pieces = leaf.pieces if isinstance(leaf, Chunked) else []
    trainer.close()
    return {"live_is_dtensor": hasattr(live, "to_local"), "snapshot_is_dtensor": hasattr(leaf, "to_local"),
            "host_pieces": [(p.device.type, p.is_pinned() == torch.cuda.is_available()) for _, p in pieces],
            "shares_memory": any(p.untyped_storage().data_ptr() == live.to_local().untyped_storage().data_ptr()
                                 for _, p in pieces),
            "equal": all(p.equal(live.to_local()) for _, p in pieces)}


@pytest.mark.skipif(not __import__("ddpkit.parallel.fsdp", fromlist=["x"]).cpu_supported(), reason="FSDP2 on CPU")
def test_the_async_snapshot_of_a_dtensor_is_a_host_copy_of_its_chunk():
    cfg = TrainConfig(world_size=2, strategy="fsdp2", dataset_size=256, input_width=32, hidden_width=64, steps=1)
    for rank in launch(_snapshot_of_fsdp_state, cfg, world_size=2, output="none"):
        assert rank["live_is_dtensor"] and not rank["snapshot_is_dtensor"], rank  # a DTensor would keep its device
        assert rank["host_pieces"] == [("cpu", True)] and not rank["shares_memory"] and rank["equal"], rank
