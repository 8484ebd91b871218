"""The parallelism plane: how the model, its gradients and its optimizer state are split across ranks.

One file per idea: data-parallel strategies (``ddp.py``, ``zero.py``, ``fsdp.py``) behind the small
interface in ``base.py``; model parallelism (``tensor.py``: layers split across ranks, and
``tensor_strategy.py``: the trainer's replicas split so; ``pipeline.py``: layers in stages, and the
schedules; ``pipeline_strategy.py``: the trainer's step as a pipeline); what a rank holds, as chunks of
whole tensors, for checkpoints that stay sharded (``chunks.py``, ``held_state.py``); collectives and
what they cost (``comm.py``), and point-to-point patterns checked under NCCL's rule that a send waits
for its receive (``rendezvous.py``); memory per rank (``memory.py``); ``dims.py`` is the parallel
layout (dp x tp x pp) and its device mesh; ``fsdp_depth.py`` and ``fsdp_prefetch.py`` turn FSDP2's knobs on real ranks (resharding, mixed precision, meshes, offload; prefetch's memory and overlap), ``fsdp_tensor.py`` is tensor parallelism inside FSDP2, and ``fsdp_flags.py`` checks the FSDP2 flags of a config; ``context_strategy.py`` is the trainer's ``--cp``, ``expert_strategy.py`` its ``--experts`` and ``--ep``.
:func:`build_strategy` maps a config's ``strategy``
name (and its tp and pp degrees) to one. Strategy modules are imported on demand, so that importing the
layout (which the config does) stays cheap.
"""

from __future__ import annotations

import importlib

STRATEGIES = {  # name -> module:class
    "ddp": "ddpkit.parallel.ddp:DDPStrategy",
    "zero1": "ddpkit.parallel.zero:ZeroStrategy",
    "zero1-torch": "ddpkit.parallel.zero:TorchZeroStrategy",
    "fsdp2": "ddpkit.parallel.fsdp:FSDPStrategy",
    "hsdp": "ddpkit.parallel.fsdp:HSDPStrategy",
}


def strategy_options(cfg) -> dict:
    """The keyword arguments a config's strategy takes besides the rank context (FSDP2's knobs)."""
    if cfg is None or cfg.strategy not in ("fsdp2", "hsdp"):
        return {}
    options = {"reshard_after_forward": cfg.reshard_after_forward}
    if cfg.strategy == "hsdp":
        options["replicate"], options["shard"] = cfg.hsdp_mesh
    return options


def build_strategy(name: str, ctx, cfg=None):
    """The strategy a config names, for this rank (``cfg``, when given, supplies the strategy's options)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: use one of {', '.join(STRATEGIES)}")
    if ctx is not None and ctx.dims.pp > 1:  # one stage per rank (each split over tp, if asked), dp across
        from ddpkit.parallel.pipeline_strategy import PipelineStrategy

        return PipelineStrategy(ctx)
    options = strategy_options(cfg)
    if cfg is not None and cfg.experts:  # the MoE GPT over the world, its experts split over ep ranks
        from ddpkit.parallel.expert_strategy import ExpertParallelStrategy

        return ExpertParallelStrategy(ctx, cfg)
    if ctx is not None and ctx.dims.cp > 1:  # each sequence split over a cp group (heads over tp), DDP over dp x cp
        from ddpkit.parallel.context_strategy import ContextParallelStrategy, ContextTensorParallelStrategy

        return ContextTensorParallelStrategy(ctx) if ctx.dims.tp > 1 else ContextParallelStrategy(ctx)
    if ctx is not None and ctx.dims.tp > 1 and name == "fsdp2":  # tp inside each replica, FSDP2 across replicas
        from ddpkit.parallel.fsdp_tensor import FSDPTensorParallelStrategy

        return FSDPTensorParallelStrategy(ctx, **options)
    if ctx is not None and ctx.dims.tp > 1:  # each replica split over a tp group, DDP across replicas
        from ddpkit.parallel.tensor_strategy import TensorParallelStrategy

        return TensorParallelStrategy(ctx)
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)(ctx, **options)
