"""Tiny real runs behind seed 003's comparison table: the rows notebook 22 can prove on two CPU ranks.

Seed 003's table says PyTorch does tensor and pipeline parallelism "manually" and that FSDP has CPU
offloading and mixed precision. Looking up an API proves none of that; a run does. :func:`run` trains, on
the ranks it is given (two here), a few steps of each:

* the kit's tiny GPT under DDP (the reference), under tensor parallelism (``tp=2``: each block's weights
  split over the two ranks, one data-parallel replica) and under pipeline parallelism (``pp=2``: one
  block per rank, two micro-batches), all on the same global batch of the same samples;
* FSDP2 (``fully_shard``) on a small MLP (``ddpkit.parallel.fsdp_depth``, notebook 10b's), as it is,
  with ``CPUOffloadPolicy`` and with ``MixedPrecisionPolicy(param_dtype=bfloat16)``.

:func:`verdicts` turns the results into one ``{"holds", "evidence"}`` per row. Tensor and pipeline
parallelism change the order of the sums (a split matmul, a loss averaged over micro-batches), so their
losses are compared within :data:`LOSS_TOL`; FSDP2 with CPU offload must give FSDP2's losses exactly (on a
CPU-only machine the policy moves nothing, which is all it can show here), and bf16 mixed precision within
:data:`BF16_TOL` of fp32, with bf16 activations.
"""

from __future__ import annotations

from ddpkit import train
from ddpkit.config import TrainConfig
from ddpkit.parallel import fsdp_depth
from ddpkit.runtime import RankContext

LOSS_TOL = 1e-5  # tp=2 and pp=2 against DDP, step by step (measured: 4.8e-7 and 2.4e-7 over 4 steps)
BF16_TOL = 1e-3  # FSDP2 with bf16 parameters against fp32 on notebook 10b's MLP (measured: 1.7e-5 over 3 steps)


def layouts(cfg: TrainConfig, world_size: int) -> dict[str, TrainConfig]:
    """The GPT job under DDP, tp and pp, each with the same global batch (micro x accumulation x dp)."""
    gpt = cfg.replace(model="gpt", strategy="ddp", world_size=world_size)
    return {"ddp": gpt, "tp": gpt.replace(tp=world_size, micro_batch_size=gpt.micro_batch_size * world_size),
            "pp": gpt.replace(pp=world_size, grad_accum=gpt.grad_accum * world_size)}


def run(ctx: RankContext, cfg: TrainConfig) -> dict:
    """Every run of the module docstring on this rank (rank 0's result is the evidence)."""
    out = {}
    for name, job in layouts(cfg, ctx.world_size).items():
        s = train.run(ctx, job)
        out[name] = {"losses": [x["loss"] for x in s["losses"]], "data_sha256": s["data_sha256"],
                     "layout": [s["dp"], s["tp"], s["pp"]], "params": s["state_bytes_per_rank"]["params"]}
    for name, options in (("fsdp2", {}), ("fsdp2 offload", {"offload": True}), ("fsdp2 bf16", {"mixed_precision": True})):
        r = fsdp_depth.run_fsdp(ctx, **options)
        out[name] = {"losses": r["losses"], "forward_dtype": r["forward_dtype"], "param_device": r["param_device"]}
    return out


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")


def verdicts(runs: dict, world_size: int) -> dict[str, dict]:
    """``{row: {"holds", "evidence"}}`` for the rows :func:`run` backs."""
    ddp, out = runs["ddp"], {}
    for name, row, layout in (("tp", "Tensor parallelism", [1, world_size, 1]), ("pp", "Pipeline parallelism", [1, 1, world_size])):
        r, gap = runs[name], _gap(runs[name]["losses"], ddp["losses"])
        holds = r["layout"] == layout and r["data_sha256"] == ddp["data_sha256"] and gap <= LOSS_TOL and r["params"] < ddp["params"]
        out[row] = {"holds": holds, "evidence": f"kit {name}={world_size} (dp x tp x pp = {' x '.join(map(str, r['layout']))}): "
                    f"DDP's samples, losses within {gap:.1e} of DDP's, {r['params']} B of weights per rank vs {ddp['params']}"}
    plain, off, bf16 = runs["fsdp2"], runs["fsdp2 offload"], runs["fsdp2 bf16"]
    out["CPU offloading"] = {"holds": off["losses"] == plain["losses"] and off["param_device"] == "cpu",
                             "evidence": "FSDP2 + CPUOffloadPolicy trained with FSDP2's losses exactly, shards on "
                                         f"{off['param_device']} (on a CPU-only machine it has nothing to move)"}
    gap = _gap(bf16["losses"], plain["losses"])
    out["Mixed precision"] = {"holds": bf16["forward_dtype"] == "bfloat16" and 0 < gap <= BF16_TOL,
                              "evidence": f"FSDP2 + MixedPrecisionPolicy(bf16): {bf16['forward_dtype']} forward, "
                                          f"losses within {gap:.1e} of fp32's (and not equal: bf16 rounds)"}
    return out
