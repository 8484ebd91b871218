import dataclasses
import subprocess
import sys

import pytest

from ddpkit.config import TrainConfig, learned


@pytest.mark.parametrize("changes, message", [
    (dict(world_size=0), "world-size must be >= 1"),
    (dict(steps=-1), "steps must be >= 0"),
    (dict(micro_batch_size=4096), "larger than the dataset"),
    (dict(model="resnet"), "unknown model"),
    (dict(amp="fp8"), "unknown amp mode"),
    (dict(lr=0.0), r"lr must be in \(0, 1\]"),
    (dict(lr=float("inf")), "lr must be a finite number"),
    (dict(lr=float("nan")), "lr must be a finite number"),
    (dict(lr=5.0), r"lr must be in \(0, 1\]"),
    (dict(timeout=float("inf")), "timeout must be a finite number"),
    (dict(timeout=1e30), r"timeout must be in \(0, 86400\]"),
    (dict(seed=2**63), "seed must be in 0 .. 4294967295"),
    (dict(seed=-1), "seed must be in"),
    (dict(dataset_size=10**12), "more than half of this machine's"),
    (dict(hidden_width=10**6), "more than half of this machine's"),
    (dict(checkpoint_every=1), "--checkpoint-every needs --checkpoint-dir"),
    (dict(checkpoint_every_s=30.0), "--checkpoint-every-s needs --checkpoint-dir"),
    (dict(checkpoint_every_s=-1.0, checkpoint_dir="/tmp/x"), "checkpoint-every-s must be from 0"),
    (dict(num_workers=1000), "num-workers must be <= 32"),
    (dict(data_delay_s=-1.0), "data-delay-s must be in"),
    (dict(steps="40"), "steps must be a whole number"),
    (dict(world_size=4, tp=3), "not divisible by tp x pp"),
    (dict(world_size=4, tp=2), "use --model gpt"),
    (dict(world_size=4, tp=2, model="gpt", strategy="zero1"), "combines with strategy ddp or fsdp2"),
    (dict(world_size=6, tp=3, model="gpt"), "must divide the attention heads"),
    (dict(world_size=4, pp=2), "cuts the GPT's blocks into stages: use --model gpt"),
    (dict(world_size=4, pp=2, model="gpt", strategy="zero1"), "combines with strategy ddp"),
    (dict(world_size=3, pp=3, model="gpt", n_layers=2), "more stages than the model's 2 blocks"),
    (dict(strategy="zero9"), "unknown strategy"),
    (dict(checkpoint_dir="/x", resume=True, overwrite_checkpoints=True), "choose one"),
    (dict(n_heads=5), "must divide d-model"),
    (dict(resume=True), "--resume needs --checkpoint-dir"),
    (dict(fail_rank=2), "not a rank of a world of 2"),
    (dict(timeout=0), r"timeout must be in \(0, 86400\]"),
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


def test_every_field_says_whether_it_is_in_the_digest():
    unmarked = [f.name for f in dataclasses.fields(TrainConfig) if "digest" not in f.metadata]
    assert not unmarked, f"mark these fields learned(...) or runtime(...): {unmarked}"


def test_a_training_field_declared_anywhere_is_in_the_digest():
    """Digest membership is a property of the field, not of where it is declared."""
    Extended = dataclasses.make_dataclass("Extended", [("dropout", float, learned(0.1))], bases=(TrainConfig,), frozen=True)
    base = Extended()
    assert "dropout" in base.semantics()
    assert base.replace(dropout=0.2).digest() != base.digest()
    assert base.replace(steps=99, world_size=1, micro_batch_size=16).digest() == base.digest()


def test_the_global_batch_counts_data_parallel_ranks_only():
    cfg = TrainConfig(world_size=4, micro_batch_size=8, grad_accum=2)
    assert (cfg.dp, cfg.global_batch_size, cfg.dims.describe()) == (4, 64, "dp 4 x tp 1 x pp 1")
