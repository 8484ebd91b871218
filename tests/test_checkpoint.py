import json
import os
import random
import warnings

import numpy as np
import pytest
import torch

from ddpkit import checkpoint
from ddpkit.checkpoint import CheckpointError, CheckpointWarning
from ddpkit.config import TrainConfig


def state(value: float) -> dict:
    return {"model": {"w": torch.full((4, 4), value)}, "train": {"step": int(value)}}


def test_save_verify_and_keep_last(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, state(step), keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000004", "step-00000003"]
    assert checkpoint.verify(tmp_path / "step-00000004") is None
    assert checkpoint.load(checkpoint.latest_good(tmp_path))["train"]["step"] == 4


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-manifest"])
def test_a_damaged_newest_checkpoint_is_skipped(tmp_path, damage):
    checkpoint.save(tmp_path, 1, state(1))
    newest = checkpoint.save(tmp_path, 2, state(2))
    data = (newest / "state.pt").read_bytes()
    if damage == "truncate":
        (newest / "state.pt").write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        (newest / "state.pt").write_bytes(data[:-20] + bytes([data[-20] ^ 1]) + data[-19:])
    else:
        (newest / "manifest.json").unlink()
    with pytest.warns(CheckpointWarning, match="skipping checkpoint step-00000002"):
        chosen = checkpoint.latest_good(tmp_path)
    assert chosen.name == "step-00000001"
    with pytest.raises(CheckpointError, match="does not verify"):
        checkpoint.load(newest)


def test_a_crash_during_save_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, state(1))
    real_save = torch.save

    def dies_halfway(obj, handle):
        real_save(obj, handle)
        handle.truncate(100)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, 2, state(2))
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the torn write is not even a candidate
        assert checkpoint.latest_good(tmp_path).name == "step-00000001"
    checkpoint.save(tmp_path, 3, state(3))  # and the next save cleans up the leftovers
    assert not list(tmp_path.glob(".tmp-*"))


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['DDPKIT_PWNED']}",))


def test_a_malicious_pickle_is_refused_without_running_it(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("DDPKIT_PWNED", str(marker))
    path = checkpoint.save(tmp_path / "ck", 5, {"model": Exploit()})  # a well-formed, verified file
    assert checkpoint.verify(path) is None
    with pytest.raises(CheckpointError, match="a checkpoint is data, not code"):
        checkpoint.load(path)
    assert not marker.exists()


def test_rng_states_round_trip_as_plain_data(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = checkpoint.save(tmp_path, 1, {"rng": [checkpoint.rng_state()]})
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.set_rng_state(checkpoint.load(path)["rng"][0])  # loaded with weights_only=True
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def meta_for(cfg: TrainConfig) -> dict:
    return {"config_digest": cfg.digest(), "semantics": cfg.semantics(), "world_size": cfg.world_size,
            "global_batch_size": cfg.global_batch_size, "micro_batch_size": cfg.micro_batch_size,
            "grad_accum": cfg.grad_accum}


def test_resume_that_changes_training_is_refused_with_the_fix():
    saved = TrainConfig(world_size=2, micro_batch_size=8)
    checkpoint.check_compatible(meta_for(saved), saved.replace(world_size=1, micro_batch_size=16, steps=99))
    with pytest.raises(CheckpointError, match="keep micro x accum x world = 16"):
        checkpoint.check_compatible(meta_for(saved), saved.replace(world_size=1))
    with pytest.raises(CheckpointError, match=r"lr: 0\.003 -> 0\.1"):
        checkpoint.check_compatible(meta_for(saved), saved.replace(lr=0.1))


def test_manifest_lists_sha256_and_size(tmp_path):
    path = checkpoint.save(tmp_path, 7, state(7))
    manifest = json.loads((path / "manifest.json").read_text())
    info = manifest["files"]["state.pt"]
    assert info["bytes"] == (path / "state.pt").stat().st_size
    assert info["sha256"] == checkpoint.file_sha256(path / "state.pt")
