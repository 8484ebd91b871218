"""What a save costs, measured on a real trainer: ``full`` (rank 0 gathers and writes one file), ``dcp``
(every rank writes its shards) and ``dcp`` in the background (``sharded_checkpoint.AsyncSave``).

It sits above the trainer (it builds one), so that ``sharded_checkpoint``, which the trainer imports,
never imports the trainer back. Notebook 11 and ``benchmarks/async_save.py`` launch it.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch.distributed as dist

from ddpkit import checkpoint, sharded_checkpoint
from ddpkit.train import Trainer


def measure_save_costs(ctx, cfg, root: str, steps_after: int = 6) -> dict:
    """Save the same trained state three ways and time each (a function for ``ddpkit.launch``; the
    config must not checkpoint on its own): ``full`` (rank 0 gathers and writes one file), ``dcp``
    (every rank writes its shards), and ``async`` (dcp saves in the background while ``steps_after``
    more steps train, twice: the second reuses the snapshot buffers, as every later save of a run
    does). Returns, on every rank, seconds and bytes of each, the files of the dcp checkpoint, the
    training stall of the async saves and the step times around them."""
    trainer = Trainer(ctx, cfg)
    trainer.prepare()
    for _ in range(3):
        trainer.run_step()
    out = {}
    for fmt in ("full", "dcp"):
        trainer.cfg = cfg.replace(checkpoint_dir=str(Path(root) / fmt), checkpoint_format=fmt)
        seconds, nbytes = trainer.save()
        out[fmt] = {"seconds": seconds, "bytes": nbytes}
    plain = [trainer.run_step().step_time_s for _ in range(steps_after)]
    saver = sharded_checkpoint.AsyncSave(ctx)
    stalls = []
    for _ in range(2):  # the first save allocates the snapshot buffers; later ones reuse them
        model_state, optimizer_state = trainer.strategy.sharded_state_dicts(trainer.model, trainer.optimizer)
        extra = {"train": {"step": trainer.step, "consumed_samples": trainer.consumed,
                           "data_sha256": trainer.fold_data_hash()}, "meta": {}}
        started = time.perf_counter()
        stalls.append(saver.start(str(Path(root) / "async"), trainer.step, model_state, optimizer_state, extra, {},
                                  cfg.keep_last))
        during = [trainer.run_step().step_time_s for _ in range(steps_after)]
        path = saver.wait()
        written = time.perf_counter() - started
    out["async"] = {"stall_s": stalls[-1], "first_stall_s": stalls[0], "until_sealed_s": written,
                    "plain_step_s": statistics.median(plain), "step_s_during": statistics.median(during)}
    if ctx.is_main:
        out["dcp_files"] = {p.name: p.stat().st_size for p in sorted((Path(root) / "dcp").glob("step-*/*"))}
        out["async"]["verified"] = checkpoint.verify(path) is None
    shared = [out]
    if ctx.is_distributed:
        dist.broadcast_object_list(shared, src=0, group=ctx.world_group)
    trainer.close()
    return shared[0]


def busiest_writer_seconds(files: dict[str, str | Path], repeats: int = 6) -> dict[str, dict]:
    """The write time of each format's busiest writer: for each named file (the largest one a single rank
    wrote in that format), its bytes written again into a fresh file, ``repeats`` times, alternating
    between the files so that the load hits each alike, timed by the fastest write (a write that lost
    the core to another process says nothing about the bytes). The writes go to the page cache, not
    through fsync: the disk here is shared with other processes, and the fsync a checkpoint needs is
    notebook 06's lesson. Returns each name's ``bytes`` and ``seconds``. At scale this is the save time
    that sharding divides: a full save pushes the whole state through one rank; DCP, 1/N of it."""
    import os
    import tempfile

    data = {name: Path(path).read_bytes() for name, path in files.items()}
    seconds: dict[str, list[float]] = {name: [] for name in data}
    with tempfile.TemporaryDirectory(prefix="ddpkit-writer-") as folder:
        target = os.path.join(folder, "rewrite")
        for round_ in range(repeats):
            for name in (list(data) if round_ % 2 == 0 else list(data)[::-1]):
                started = time.perf_counter()
                with open(target, "wb") as handle:
                    handle.write(data[name])
                    handle.flush()
                seconds[name].append(time.perf_counter() - started)
                os.remove(target)
    return {name: {"bytes": len(data[name]), "seconds": min(seconds[name])} for name in data}
