"""DeepSpeed's ZeRO stages 1, 2 and 3 on the kit's job: the same model, the same samples, the same AdamW.

DeepSpeed (``deepspeed.initialize(model=..., config=...)``) wraps a model in an *engine* that owns what
the kit's trainer spreads over its strategies: gradient averaging, the optimizer and its sharding (the
``zero_optimization.stage``), gradient clipping, the learning-rate schedule, mixed precision and the
batch arithmetic (``train_batch_size = micro batch x accumulation x data-parallel ranks``, checked).
The training loop becomes ``loss = engine(x)...; engine.backward(loss); engine.step()``.

To run it beside the kit on CPU ranks, four things change from a GPU config, each for a reason:

* ``deepspeed.init_distributed(dist_backend="gloo")``: DeepSpeed's CPU accelerator picks ``ccl`` (oneCCL)
  when Intel's ``oneccl_bindings_for_pytorch`` is installed and gloo otherwise; saying gloo makes it
  explicit. Under the kit's launcher the process group already exists and DeepSpeed uses it;
* ``"torch_adam": true`` in the optimizer's params: DeepSpeed's own Adam (``FusedAdam``; ``DeepSpeedCPUAdam``
  with ZeRO-Offload) is a C++ extension compiled on first use; torch's ``AdamW`` is the kit's optimizer;
* ``"gradient_clipping": 0.0``: DeepSpeed clips at 1.0 unless told otherwise (``GRADIENT_CLIPPING_DEFAULT``
  in ``deepspeed/runtime/constants.py``); torch clips only when ``clip_grad_norm_`` is called;
* the batch numbers fit two ranks, and bf16 is off (the kit's runs here are fp32).

``DS_ACCELERATOR=cpu`` is set before DeepSpeed is imported: its accelerator detection would otherwise
call ``torch.cuda.is_available()``, which starts the CUDA driver in the calling process (a notebook
kernel could then no longer fork ranks, see ``ddpkit/launch.py``). On Linux, DeepSpeed's CPU backend
compiles a shared-memory collective op (``ShareMemCommBuilder``, ``deepspeed/comm/torch.py``) the first
time a process group starts: minutes on a busy 2-core machine; ZeRO-Offload's ``DeepSpeedCPUAdam`` is
another compiled op. ``TORCH_EXTENSIONS_DIR`` points into this environment's own folder (``sys.prefix``),
so each build is done once per environment (:func:`build_ops`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader

from ddpkit import metrics
from ddpkit.config import TrainConfig
from ddpkit.data import ResumableDistributedSampler, build_dataset
from ddpkit.engines import require, traffic
from ddpkit.models import build_model, loss_fn
from ddpkit.runtime import RankContext, seed_everything
from ddpkit.step import global_loss_sum

SEED_CONFIG: dict = {  # seed 003's DEEPSPEED_CONFIG, value for value (an 8-GPU bf16 job)
    "train_batch_size": 256, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4,
                                                      "warmup_num_steps": 2000, "total_num_steps": 100000}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "none"}, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e8,
                          "stage3_param_persistence_threshold": 1e6, "gather_16bit_weights_on_model_save": True},
    "gradient_clipping": 1.0,
    "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True},
    "wall_clock_breakdown": True,
}


def extensions_dir() -> str:
    """Where torch keeps DeepSpeed's compiled ops for this environment (inside it: one build per venv)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")


def import_deepspeed():
    """``import deepspeed`` on the CPU accelerator, quietly (its start-up report is long). Without the extra,
    :class:`~ddpkit.engines.MissingExtra`'s one line (``pip install 'ddpkit[deepspeed]'``), not a traceback."""
    require("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    import logging

    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    return deepspeed


OPS = ("deepspeed_shm_comm", "cpu_adam")
"""The compiled ops the notebook loads: the CPU backend's shared-memory collectives, and ZeRO-Offload's
``DeepSpeedCPUAdam`` (seed 003's config offloads the optimizer)."""


def ops_built(ops: tuple[str, ...] = OPS) -> bool:
    """True when every op of ``ops`` is already compiled in this environment."""
    return all(os.path.isdir(os.path.join(extensions_dir(), op)) for op in ops)


def build_ops(ops: tuple[str, ...] = OPS) -> None:
    """Compile (or find) ``ops`` now, in this process: what the first process group (the shared-memory op,
    about 40 s on an idle 2-core machine) and the first engine with an offloaded optimizer (CPUAdam, about
    2.5 minutes of CPU) would otherwise do."""
    import_deepspeed()
    if "deepspeed_shm_comm" in ops:
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()
    if "cpu_adam" in ops:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load(verbose=False)


def cpu_config(cfg: TrainConfig, world_size: int, stage: int, clipping: float | None = 0.0,
               cpu_adam: bool = False) -> dict:
    """The kit's job as a DeepSpeed config: its batch, torch's AdamW at its lr and weight decay, ZeRO ``stage``.
    ``clipping=None`` leaves ``gradient_clipping`` out, so DeepSpeed's default applies. ``cpu_adam=True``
    offloads the optimizer to the CPU instead (ZeRO-Offload, stage 1 or more), which makes ``"AdamW"``
    DeepSpeed's compiled ``DeepSpeedCPUAdam`` (:func:`build_ops` first) with the same hyperparameters."""
    adam = {"lr": cfg.lr, "weight_decay": cfg.weight_decay} | ({} if cpu_adam else {"torch_adam": True})
    config = {
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * world_size,
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size, "gradient_accumulation_steps": cfg.grad_accum,
        "optimizer": {"type": "AdamW", "params": adam},
        "zero_optimization": {"stage": stage} | ({"offload_optimizer": {"device": "cpu"}} if cpu_adam else {}),
    }
    if clipping is not None:
        config["gradient_clipping"] = clipping
    return config


def seed_config_fixed(world_size: int) -> dict:
    """Seed 003's config with only its batch fixed for ``world_size`` ranks: 8 per rank x 4 accumulation steps
    x the ranks present. Everything else as the seed writes it: bf16, ZeRO-3 with the optimizer offloaded to
    the CPU (so DeepSpeed builds its compiled ``DeepSpeedCPUAdam``), clipping at 1.0, ``WarmupDecayLR``."""
    config = copy.deepcopy(SEED_CONFIG)
    config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
                                  * world_size)
    return config


def train_seed_config(ctx: RankContext, cfg: TrainConfig, steps: int) -> dict:
    """``steps`` optimizer steps of the kit's model and samples under :func:`seed_config_fixed`.

    One change to the data, not the config: bf16 makes DeepSpeed cast the model's weights to bf16
    (``engine.module`` holds bf16 tensors), and a float input must be cast to match, or the first linear
    layer fails ("mat1 and mat2 must have the same dtype"). An LLM's token ids need no cast, which is why
    the seed's code has none. Returns the effective settings, read from the engine, and each step's loss."""
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    config = seed_config_fixed(ctx.world_size)
    job = cfg.replace(micro_batch_size=config["train_micro_batch_size_per_gpu"],
                      grad_accum=config["gradient_accumulation_steps"])
    seed_everything(cfg.seed)
    model = build_model(job)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=config,
                                                           model_parameters=model.parameters())
    dtype = next(engine.module.parameters()).dtype
    batches, losses, lrs = kit_batches(ctx, job), [], []
    for _ in range(steps):
        lrs.append(engine.get_lr()[0])  # the lr this optimizer step uses
        loss_sum = 0.0
        for _ in range(job.grad_accum):
            batch = next(batches)
            per_sample = loss_fn(engine(batch["inputs"].to(dtype)).float(), batch["targets"], reduction="none")  # (B,)
            engine.backward(per_sample.mean())
            loss_sum += float(per_sample.detach().sum())
            engine.step()
        losses.append(global_loss_sum(ctx, loss_sum) / job.global_batch_size)
    inner, offload = getattr(engine.optimizer, "optimizer", engine.optimizer), engine.zero_offload_optimizer()
    out = {"losses": losses, "lrs": lrs, "weights_dtype": str(dtype).replace("torch.", ""),
           "stage": engine.zero_optimization_stage(), "optimizer": type(inner).__name__,
           "offload": str(getattr(offload.device, "value", offload.device)) if offload else "none",
           "clipping": engine.gradient_clipping(), "scheduler": type(scheduler).__name__,
           "global_batch": job.global_batch_size}
    engine.destroy()
    return out


def kit_batches(ctx: RankContext, cfg: TrainConfig):
    """This rank's micro-batches in the kit trainer's order (its sampler, its loader settings)."""
    dataset = build_dataset(cfg)
    sampler = ResumableDistributedSampler(len(dataset), ctx.dp_size, ctx.dp_rank, cfg.global_batch_size, cfg.seed)
    sampler.set_consumed(0)
    generator = torch.Generator()
    generator.manual_seed(cfg.seed * 1_000_003 + sampler.epoch)
    return iter(DataLoader(dataset, batch_size=cfg.micro_batch_size, sampler=sampler, drop_last=True,
                           generator=generator))


def train_engine(ctx: RankContext, cfg: TrainConfig, config: dict) -> dict:
    """``cfg.steps`` steps of the kit's model and data under a DeepSpeed engine built from ``config``.

    Returns the global loss of each step (computed as the kit's trainer computes it), the sha256 of the
    final weights (gathered from the shards under ZeRO-3), the bytes of parameters and optimizer state
    this rank holds, the optimizer the engine built, and the collectives issued per step from the second
    step on, counted twice: by the Flight Recorder as for every engine (:mod:`ddpkit.engines.traffic`), and
    by DeepSpeed's own communication logger (``deepspeed.comm``'s calls, by name), a cross-check."""
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    seed_everything(cfg.seed)
    model = build_model(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, config=copy.deepcopy(config), model_parameters=model.parameters())
    batches, losses, start = kit_batches(ctx, cfg), [], -1
    comms = deepspeed.comm.comm.comms_logger  # DeepSpeed's own record of every deepspeed.comm call
    for step in range(cfg.steps):
        if step == 1:  # count the steady state: from the second step on (the first also sets buffers up)
            deepspeed.comm.configure(enabled=True, prof_all=True)
            comms.comms_dict = {}
            start = traffic.last_record_id()
        loss_sum = 0.0
        for _ in range(cfg.grad_accum):
            batch = next(batches)
            per_sample = loss_fn(engine(batch["inputs"]), batch["targets"], reduction="none")  # (B,)
            engine.backward(per_sample.mean())  # the engine divides by the accumulation steps itself
            loss_sum += float(per_sample.detach().sum())
            engine.step()  # an optimizer step only at the accumulation boundary
        losses.append(global_loss_sum(ctx, loss_sum) / cfg.global_batch_size)  # the comparison's own: not counted
    deepspeed.comm.configure(enabled=False)
    counted = max(1, cfg.steps - 1)
    flight = traffic.per_step(traffic.since(start), counted) if cfg.steps > 1 else {}
    logged = {op: sum(record[0] for record in sizes.values()) / counted for op, sizes in comms.comms_dict.items()}
    comms.comms_dict = {}
    stage = engine.zero_optimization_stage()
    with gathered(deepspeed, model, stage):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    held = held_bytes(engine, model, stage)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    engine.destroy()
    return {"stage": stage, "losses": losses, "param_sha256": metrics.state_sha256(state), "bytes": held,
            "collectives_per_step": flight, "deepspeed_logged_per_step": logged,
            "clipping": engine.gradient_clipping(), "optimizer": type(inner).__name__}


@contextlib.contextmanager
def gathered(deepspeed, model: torch.nn.Module, stage: int):
    """Under ZeRO-3 each rank holds a shard of each parameter: gather them whole for a moment."""
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield
    else:
        yield


def held_bytes(engine, model: torch.nn.Module, stage: int) -> dict:
    """Bytes this rank holds: parameters (ZeRO-3: its partition ``ds_tensor`` of each), and optimizer state:
    the fp32 tensors the inner torch optimizer updates (a master copy of the shard under ZeRO-1/2; the
    partition itself under ZeRO-3 in fp32) plus AdamW's ``exp_avg`` and ``exp_avg_sq``."""
    if stage == 3:
        params = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    else:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
    inner = engine.optimizer.optimizer if stage else engine.optimizer
    masters = [p for group in inner.param_groups for p in group["params"]]
    moments = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    master_bytes = 0 if stage == 3 else sum(p.numel() * p.element_size() for p in masters)
    return {"params": params, "optimizer": master_bytes + moments,
            "optimizer_numel": sum(p.numel() for p in masters)}
