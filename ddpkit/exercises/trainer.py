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


def _config_answers(cls, cases: list[tuple[int, int, int]]) -> dict:
    """What the learner's config class says for each (micro, accum, world), in its process."""
    from ddpkit.exercises import learner

    cls = learner.real(cls)
    if not dataclasses.is_dataclass(cls):
        return {"dataclass": False, "name": getattr(cls, "__name__", "TrainConfig")}
    answers = []
    for micro, accum, world in cases:
        try:
            cfg = cls(micro_batch_size=micro, grad_accum_steps=accum, world_size=world)
        except TypeError as exc:
            return {"dataclass": True, "type_error": str(exc)}
        answers.append(cfg.global_batch_size)
    return {"dataclass": True, "answers": answers}


@graded("00_build_it_live", "config")
def check_config_class(cls) -> Result:
    import random

    from ddpkit.exercises import learner

    rng = random.SystemRandom()
    cases = [(8, 2, 2), (4, 1, 8), (16, 4, 1), (rng.randint(1, 64), rng.randint(1, 8), rng.randint(2, 16))]
    try:
        found = learner.run(_config_answers, cls, cases)
    except NotImplementedError:
        return not_implemented("TrainConfig")
    except learner.Raised as exc:
        return Result(False, exc.sentence("TrainConfig"))
    if not found["dataclass"]:
        return Result(False, f"{found.get('name', 'TrainConfig')} is not a dataclass: decorate it with @dataclass")
    if "type_error" in found:
        return Result(False, f"TrainConfig(micro_batch_size=..., grad_accum_steps=..., world_size=...) failed "
                             f"({learner.short(found['type_error'], 70)}): give it those three fields")
    for (micro, accum, world), got in zip(cases, found["answers"]):
        if got != micro * accum * world:
            return Result(False, f"micro {micro} x accum {accum} x world {world} gave global_batch_size "
                                 f"{got!r:.20}: it must count every sample of a step, on every rank")
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
    import random

    from ddpkit import train
    from ddpkit.config import TrainConfig
    from ddpkit.launch import launch

    seed = random.SystemRandom().randrange(1, 10_000)  # drawn now: the final weights cannot be known in advance
    cfg = TrainConfig(world_size=2, steps=steps, log_every=1000, seed=seed)
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
    return Result(True, f"bitwise ddpkit train: the same param_sha256 after {steps} steps on 2 ranks (seed {seed})")


def _built(fn) -> dict:
    """The model's initial weights and the optimizer's first settings, as the learner's function builds them."""
    import torch

    from ddpkit.config import TrainConfig

    model, optimizer = fn(TrainConfig())
    group = optimizer.param_groups[0]
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "adamw": isinstance(optimizer, torch.optim.AdamW), "optimizer": type(optimizer).__name__,
            "lr": float(group["lr"]), "weight_decay": float(group["weight_decay"]),
            "same_params": {id(p) for p in group["params"]} == {id(p) for p in model.parameters()}}


@graded("00_build_it_live", "model_and_optimizer")
def check_model_and_optimizer(fn) -> Result:
    """``fn(cfg) -> (model, optimizer)``: ddpkit's model for ``cfg`` (its seeded initial weights) and AdamW at
    the schedule's first learning rate with the config's weight decay."""
    import torch

    from ddpkit.config import TrainConfig
    from ddpkit.exercises import learner
    from ddpkit.models import build_model
    from ddpkit.step import lr_at

    cfg = TrainConfig()
    try:
        built = learner.run(_built, fn)
    except NotImplementedError:
        return not_implemented(getattr(fn, "__name__", "build_model_and_optimizer"))
    except learner.Raised as exc:
        return Result(False, exc.sentence("build_model_and_optimizer"))
    except Exception as exc:  # noqa: BLE001 - called here, outside the sandbox
        return Result(False, f"it raised {type(exc).__name__}: {learner.short(str(exc))}")
    reference = build_model(cfg).state_dict()
    state = built["state"]
    if list(state) != list(reference) or any(not torch.equal(state[k], reference[k]) for k in reference):
        return Result(False, "the initial weights differ from build_model(cfg)'s: build the model from the config's seed")
    if not built["adamw"]:
        return Result(False, f"the optimizer is {built['optimizer'][:40]}, not torch.optim.AdamW")
    if abs(built["lr"] - lr_at(cfg, 0)) > 1e-12 or abs(built["weight_decay"] - cfg.weight_decay) > 1e-12:
        return Result(False, "the optimizer's first learning rate or weight decay is not the config's: where does the "
                             "schedule start, and which weight decay does the config give?")
    if not built["same_params"]:
        return Result(False, "the optimizer does not hold this model's parameters")
    return Result(True, "ddpkit's initial weights and AdamW at the schedule's first learning rate")
