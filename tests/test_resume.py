"""A trainer's state in and out of checkpoints: a save has its own time bound, apart from the collective
timeout and the stall limit of a step."""

import time

import pytest

from ddpkit import checkpoint, faults, train
from ddpkit.config import TrainConfig
from ddpkit.failures import LaunchError
from ddpkit.launch import launch
from ddpkit.train import Trainer

DELAY_S = 3.5  # the write takes this long: more than the collective timeout and the step's stall limit
RUN = dict(steps=4, dataset_size=256, log_every=100, timeout=2.0)


def slow_disk_run(ctx, cfg):
    faults.STALL_MARGIN_S = 0.5  # a step may take timeout + 0.5 s: a short limit, so the test is quick
    if ctx.rank == 0:
        write = checkpoint.write_torch

        def slow(path, obj):  # a slow disk under rank 0's write
            time.sleep(DELAY_S)
            return write(path, obj)

        checkpoint.write_torch = slow
    return Trainer(ctx, cfg).fit()


def test_a_save_longer_than_the_collective_timeout_and_the_stall_limit_finishes(tmp_path):
    clean = launch(train.run, TrainConfig(**RUN), world_size=2, timeout=RUN["timeout"], output="none")[0]
    cfg = TrainConfig(**RUN, checkpoint_dir=str(tmp_path / "a"), save_timeout=30.0)
    saved = launch(slow_disk_run, cfg, world_size=2, timeout=cfg.timeout, output="none")[0]
    assert saved["param_sha256"] == clean["param_sha256"]
    assert checkpoint.verify(checkpoint.latest_good(tmp_path / "a")) is None
    started = time.monotonic()
    with pytest.raises(LaunchError):  # the control: a save bound shorter than the write
        launch(slow_disk_run, cfg.replace(checkpoint_dir=str(tmp_path / "b"), save_timeout=1.0), world_size=2,
               timeout=cfg.timeout, output="none")
    assert time.monotonic() - started < DELAY_S + 20
