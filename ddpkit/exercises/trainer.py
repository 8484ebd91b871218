"""Checks for the build-it-live track (``exercises/00_build_it_live.ipynb``): the config cell, and the
finished trainer, which must reproduce ``ddpkit train`` bit for bit.

``check_config_class(cls)``: a dataclass with ``micro_batch_size``, ``grad_accum_steps`` and ``world_size``
whose ``global_batch_size`` is their product, whatever the topology.

``check_trainer(run)``: ``run(ctx, cfg) -> dict`` trains ``cfg`` (a ``ddpkit.config.TrainConfig``: the
default MLP) on this rank and returns the model's ``state_dict()``. The check runs it on 2 real ranks and
runs ``ddpkit.train.run`` on the same config; the two final parameter hashes (``param_sha256``) must be
equal: same initial weights, same samples in the same order, same loss, one all-reduce, same clipping,
same AdamW and learning-rate schedule.
"""

from __future__ import annotations

import dataclasses

from ddpkit.exercises import Result, Wrong, graded, not_implemented, run_on_ranks

STEPS = 12


@graded("00_build_it_live", "config")
def check_config_class(cls) -> Result:
    try:
        if not dataclasses.is_dataclass(cls):
            return Result(False, f"{getattr(cls, '__name__', cls)} is not a dataclass: decorate it with @dataclass")
        cases = [(8, 2, 2, 32), (4, 1, 8, 32), (16, 4, 1, 64)]
        for micro, accum, world, want in cases:
            cfg = cls(micro_batch_size=micro, grad_accum_steps=accum, world_size=world)
            if cfg.global_batch_size != want:
                return Result(False, f"micro {micro} x accum {accum} x world {world} gave global_batch_size "
                                     f"{cfg.global_batch_size}: it must count every sample of a step, on every rank")
    except NotImplementedError:
        return not_implemented("TrainConfig")
    except TypeError as exc:
        return Result(False, f"TrainConfig(micro_batch_size=..., grad_accum_steps=..., world_size=...) failed ({exc}): "
                             f"give it those three fields")
    return Result(True, "global_batch_size = micro x accum x world, on the config, for every topology tried")


def _learner(ctx, run, cfg) -> str:
    from ddpkit import metrics

    state = run(ctx, cfg)
    if not isinstance(state, dict) or not state:
        raise Wrong("run returned no state dict: return model.state_dict() of the unwrapped model")
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    return metrics.state_sha256(state)


@graded("00_build_it_live", "run")
def check_trainer(run, steps: int = STEPS) -> Result:
    from ddpkit import train
    from ddpkit.config import TrainConfig
    from ddpkit.launch import launch

    cfg = TrainConfig(world_size=2, steps=steps, log_every=1000)
    hashes = run_on_ranks(getattr(run, "__name__", "run"), _learner, run, cfg, world_size=2, timeout=30)
    if isinstance(hashes, Result):
        return hashes
    if hashes[0] != hashes[1]:
        return Result(False, "the two ranks end with different parameters: wrap the model in DDP (or average the gradients) "
                             "and step every rank on the same gradient")
    reference = launch(train.run, cfg, world_size=2, output="none", progress="off")[0]["param_sha256"]
    if hashes[0] != reference:
        return Result(False, f"after {steps} steps the parameters differ from ddpkit train's: compare, in order, the "
                             f"initial weights, the sampler's order, the loss, clipping and the learning-rate schedule")
    return Result(True, f"bitwise ddpkit train: the same param_sha256 after {steps} steps on 2 ranks ({reference[:16]})")


@graded("00_build_it_live", "model_and_optimizer")
def check_model_and_optimizer(fn) -> Result:
    """``fn(cfg) -> (model, optimizer)``: ddpkit's model for ``cfg`` (its seeded initial weights) and AdamW at
    the schedule's first learning rate with the config's weight decay."""
    import torch

    from ddpkit.config import TrainConfig
    from ddpkit.models import build_model
    from ddpkit.step import lr_at

    cfg = TrainConfig()
    try:
        model, optimizer = fn(cfg)
    except NotImplementedError:
        return not_implemented(getattr(fn, "__name__", "build_model_and_optimizer"))
    except Exception as exc:  # noqa: BLE001
        return Result(False, f"it raised {type(exc).__name__}: {exc}")
    reference = build_model(cfg)
    if any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values())):
        return Result(False, "the initial weights differ from build_model(cfg)'s: build the model from the config's seed")
    if not isinstance(optimizer, torch.optim.AdamW):
        return Result(False, f"the optimizer is {type(optimizer).__name__}, not torch.optim.AdamW")
    group = optimizer.param_groups[0]
    if abs(group["lr"] - lr_at(cfg, 0)) > 1e-12 or abs(group["weight_decay"] - cfg.weight_decay) > 1e-12:
        return Result(False, "the optimizer's first learning rate or weight decay is not the config's: where does the "
                             "schedule start, and which weight decay does the config give?")
    if {id(p) for p in optimizer.param_groups[0]["params"]} != {id(p) for p in model.parameters()}:
        return Result(False, "the optimizer does not hold this model's parameters")
    return Result(True, "ddpkit's initial weights and AdamW at the schedule's first learning rate")
