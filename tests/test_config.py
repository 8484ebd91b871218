import subprocess
import sys

import pytest

from ddpkit.config import TrainConfig


@pytest.mark.parametrize("changes, message", [
    (dict(world_size=0), "world-size must be >= 1"),
    (dict(steps=-1), "steps must be >= 0"),
    (dict(micro_batch_size=4096), "larger than the dataset"),
    (dict(model="resnet"), "unknown model"),
    (dict(amp="fp8"), "unknown amp mode"),
    (dict(lr=0.0), "lr must be > 0"),
    (dict(n_heads=5), "must divide d-model"),
    (dict(resume=True), "--resume needs --checkpoint-dir"),
    (dict(fail_rank=2), "not a rank of a world of 2"),
    (dict(timeout=0), "timeout must be > 0"),
])
def test_bad_values_raise_a_clear_error(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)


def test_global_batch_is_micro_times_accum_times_world():
    assert TrainConfig(micro_batch_size=8, grad_accum=3, world_size=2).global_batch_size == 48


def test_digest_covers_what_is_learned_not_how_it_runs():
    base = TrainConfig(world_size=2, micro_batch_size=8)
    same_training = [base.replace(world_size=1, micro_batch_size=16),
                     base.replace(world_size=1, grad_accum=2), base.replace(steps=500),
                     base.replace(checkpoint_dir="/elsewhere", checkpoint_every=3)]
    assert {c.digest() for c in same_training} == {base.digest()}
    different = [base.replace(lr=1e-4), base.replace(seed=1), base.replace(micro_batch_size=4),
                 base.replace(model="gpt"), base.replace(amp="bf16")]
    assert len({c.digest() for c in different} | {base.digest()}) == len(different) + 1


def _in_fresh_process(code: str, hash_seed: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONHASHSEED": hash_seed, "PATH": ""}).stdout.strip()


def test_digest_is_stable_across_processes_where_hash_is_not():
    digest = "from ddpkit.config import TrainConfig; print(TrainConfig().digest())"
    handbook = ("import json, dataclasses; from ddpkit.config import TrainConfig; "
                "print(abs(hash(json.dumps(TrainConfig().to_dict(), sort_keys=True))))")
    assert _in_fresh_process(digest, "1") == _in_fresh_process(digest, "2") == TrainConfig().digest()
    assert _in_fresh_process(handbook, "1") != _in_fresh_process(handbook, "2")
