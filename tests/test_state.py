"""Training state: RNG as data, state dicts by parameter name, and the resume checks."""

import random

import numpy as np
import pytest
import torch

from ddpkit import checkpoint, state
from ddpkit.checkpoint import CheckpointError
from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.models import build_model
from ddpkit.parallel.ddp import wrap_ddp


def test_rng_states_round_trip_as_plain_data(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = checkpoint.save(tmp_path, 1, {"rng": [state.rng_state()]})
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    state.set_rng_state(checkpoint.load(path)["rng"][0])  # loaded with weights_only=True
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_resume_that_changes_training_is_refused_with_the_fix():
    saved = TrainConfig(world_size=2, micro_batch_size=8)
    state.check_compatible(state.meta(saved), saved.replace(world_size=1, micro_batch_size=16, steps=99))
    with pytest.raises(CheckpointError, match="keep micro x accum x world = 16"):
        state.check_compatible(state.meta(saved), saved.replace(world_size=1))
    with pytest.raises(CheckpointError, match=r"lr: 0\.001 -> 0\.1"):
        state.check_compatible(state.meta(saved), saved.replace(lr=0.1))


def test_another_torch_version_is_named_in_one_line():
    meta = state.meta(TrainConfig())
    assert state.torch_version_note(meta) is None
    note = state.torch_version_note({**meta, "torch_version": "2.4.1"})
    assert "torch 2.4.1" in note and str(torch.__version__) in note and "\n" not in note


def state_dicts_by_name(ctx):
    cfg = TrainConfig()
    model = wrap_ddp(build_model(cfg), ctx)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, cfg.input_width)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = state.model_and_optimizer(model, optimizer, rank0_only=False)
    fresh = wrap_ddp(build_model(cfg.replace(seed=5)), ctx)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    state.load_model_and_optimizer(fresh, fresh_opt, model_sd, optim_sd)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    moments = all(torch.equal(optimizer.state[a]["exp_avg_sq"], fresh_opt.state[b]["exp_avg_sq"])
                  for a, b in zip(model.parameters(), fresh.parameters()))
    return {"model_keys": sorted(model_sd), "optim_keys": sorted(optim_sd["state"]), "same": same, "moments": moments,
            "raw_keys": sorted(build_model(cfg).state_dict())}


def test_state_goes_by_parameter_name_whatever_wraps_the_model():
    for result in launch(state_dicts_by_name, world_size=2, output="none"):
        assert result["model_keys"] == result["raw_keys"] == result["optim_keys"]  # no "module." prefix, no indices
        assert result["same"] and result["moments"]  # and it loads back bit for bit


def test_a_checkpoint_of_the_index_keyed_format_is_refused_with_the_fix():
    cfg = TrainConfig()
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, cfg.input_width)).sum().backward()
    optimizer.step()
    old = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),  # what ddpkit 0.1 wrote
           "train": {"step": 1, "consumed_samples": cfg.global_batch_size}, "meta": {"ddpkit_version": "0.1.0"}}
    with pytest.raises(CheckpointError, match="keys its optimizer state by parameter index.*new --checkpoint-dir"):
        state.check_saved(old, cfg, expected_lr=1e-3)
