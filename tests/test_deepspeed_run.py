"""DeepSpeed's ZeRO on the kit's job: DDP's losses exactly, and the comparison can fail (default clipping)."""

from __future__ import annotations

import pytest

from ddpkit import train
from ddpkit.config import TrainConfig
from ddpkit.engines import missing
from ddpkit.launch import launch

CFG = TrainConfig(steps=3, world_size=2, warmup_steps=0, grad_clip=0.0)


def _job(ctx, cfg):
    from ddpkit.engines import deepspeed_run

    kit = train.run(ctx, cfg)
    return {"ddp": [x["loss"] for x in kit["losses"]], "ddp_sha": kit["param_sha256"],
            1: deepspeed_run.train_engine(ctx, cfg, deepspeed_run.cpu_config(cfg, ctx.world_size, 1)),
            3: deepspeed_run.train_engine(ctx, cfg, deepspeed_run.cpu_config(cfg, ctx.world_size, 3)),
            "default": deepspeed_run.train_engine(ctx, cfg, deepspeed_run.cpu_config(cfg, ctx.world_size, 1, None))}


@pytest.fixture(scope="module")
def runs():
    reason = missing("deepspeed")
    if reason:
        pytest.skip(reason)
    from ddpkit.engines import deepspeed_run

    deepspeed_run.import_deepspeed()
    return launch(_job, CFG, world_size=2, output="none", progress="off")[0]


def test_zero_stages_equal_ddp_exactly(runs):
    for stage in (1, 3):
        assert runs[stage]["losses"] == runs["ddp"], stage
        assert runs[stage]["param_sha256"] == runs["ddp_sha"], stage


def test_default_clipping_is_the_negative_control(runs):
    # the same engine with gradient_clipping left out: DeepSpeed clips at 1.0, and the comparison sees it
    assert runs["default"]["clipping"] == 1.0
    assert runs["default"]["param_sha256"] != runs["ddp_sha"]


def test_stage3_holds_half_the_weights(runs):
    assert 2 * runs[3]["bytes"]["params"] == pytest.approx(runs[1]["bytes"]["params"], abs=64)
