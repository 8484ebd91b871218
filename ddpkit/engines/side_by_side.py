"""One launch, every engine: the kit's strategies and DeepSpeed's ZeRO stages on the same job, same ranks.

:func:`run_all` is a rank function for :func:`ddpkit.launch.launch`; :func:`compare` launches it, after
checking in the calling process that DeepSpeed is installed (a missing extra is one line, before any rank
starts). On each rank it tries seed 003's DeepSpeed config as written, trains with it once its batch is
fixed for these ranks (``seed_config``), trains the kit's job with each of the kit's strategies (its
Trainer, the collectives of each step counted by :class:`ddpkit.engines.traffic.StepWindow`), then with
DeepSpeed at ZeRO stages 1, 2 and 3 (``deepspeed_run``), once more at stage 1 with DeepSpeed's default
gradient clipping, at stage 2 with the optimizer offloaded to DeepSpeed's compiled ``DeepSpeedCPUAdam``
(``cpu_adam``), and the tiny runs behind seed 003's table (:mod:`ddpkit.engines.seed_rows`). All runs
share the ranks' process group; each starts from the same seed, so each sees the same initial weights and
the same samples. Rank 0 prints a line as each run ends.
"""

from __future__ import annotations

import copy
import warnings

from ddpkit import train
from ddpkit.config import TrainConfig
from ddpkit.engines import deepspeed_run, require, seed_rows, traffic
from ddpkit.models import build_model
from ddpkit.runtime import RankContext

KIT_STRATEGIES = ("ddp", "zero1", "zero1-torch", "fsdp2")
STAGES = (1, 2, 3)
CPU_ADAM_STAGE = 2  # ZeRO-Offload's own design point: ZeRO-2 with the optimizer step on the CPU
CPU_ADAM_LOSS_TOL = 1e-6
"""DeepSpeedCPUAdam against torch's AdamW on the same fp32 job, step by step: measured 2.4e-7 over 4 steps
(and 1.3e-6 over 30: the two kernels round differently, and the difference grows as the steps go on)."""


def compare(cfg: TrainConfig, world_size: int = 2, seed_config: bool = False, cpu_adam: bool = False,
            **launch_options) -> dict:
    """Launch :func:`run_all` on ``world_size`` ranks and return rank 0's report. Raises
    :class:`~ddpkit.engines.MissingExtra` (one line) here, before any rank starts, without DeepSpeed."""
    from ddpkit.launch import launch

    require("deepspeed")
    deepspeed_run.import_deepspeed()  # imported once here: forked ranks inherit it
    return launch(run_all, cfg, seed_config, cpu_adam, world_size=world_size, **launch_options)[0]


def seed_config_error(ctx: RankContext) -> str:
    """What ``deepspeed.initialize`` says to seed 003's config, unchanged, on these ranks (its first error)."""
    deepspeed = deepspeed_run.import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(TrainConfig())
    try:
        deepspeed.initialize(model=model, config=copy.deepcopy(deepspeed_run.SEED_CONFIG),
                             model_parameters=model.parameters())
    except Exception as exc:  # noqa: BLE001 - the point is to show it
        return f"{type(exc).__name__}: {exc}"
    return ""


def run_all(ctx: RankContext, cfg: TrainConfig, seed_config: bool = True, cpu_adam: bool = False) -> dict:
    """Every run of the comparison on this rank (see the module docstring); rank 0's result is the report."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed collectives, as DeepSpeed calls them
    say = print if ctx.is_main else (lambda *a, **k: None)
    out: dict = {"seed_config_error": seed_config_error(ctx)}
    say("seed 003's config as written:", out["seed_config_error"][:160], flush=True)
    if seed_config:  # it needs DeepSpeedCPUAdam compiled (deepspeed_run.build_ops)
        out["seed_config_fixed"] = deepspeed_run.train_seed_config(ctx, cfg, cfg.steps)
        say("seed 003's config with its batch fixed: trained", cfg.steps, "steps", flush=True)
    out["kit"] = {}
    for strategy in KIT_STRATEGIES:
        window = traffic.StepWindow()
        summary = train.Trainer(ctx, cfg.replace(strategy=strategy), hooks=[window]).fit()
        out["kit"][strategy] = {"losses": [x["loss"] for x in summary["losses"]], "param_sha256": summary["param_sha256"],
                                "state_bytes": summary["state_bytes_per_rank"], "collectives_per_step": window.per_step}
        say(f"kit {strategy}: done", flush=True)
    out["deepspeed"] = {}
    for stage in STAGES:
        out["deepspeed"][stage] = deepspeed_run.train_engine(ctx, cfg, deepspeed_run.cpu_config(cfg, ctx.world_size, stage))
        say(f"DeepSpeed ZeRO-{stage}: done", flush=True)
    out["default_clipping"] = deepspeed_run.train_engine(
        ctx, cfg, deepspeed_run.cpu_config(cfg, ctx.world_size, 1, clipping=None))
    say("DeepSpeed ZeRO-1 with gradient_clipping left out: done", flush=True)
    if cpu_adam:  # needs DeepSpeedCPUAdam compiled (deepspeed_run.build_ops)
        out["cpu_adam"] = deepspeed_run.train_engine(
            ctx, cfg, deepspeed_run.cpu_config(cfg, ctx.world_size, CPU_ADAM_STAGE, cpu_adam=True))
        say(f"DeepSpeed ZeRO-{CPU_ADAM_STAGE} with DeepSpeedCPUAdam (optimizer offloaded): done", flush=True)
    out["seed_rows"] = seed_rows.run(ctx, cfg)
    say("tensor, pipeline, FSDP2 offload and bf16 runs for seed 003's table: done", flush=True)
    return out
