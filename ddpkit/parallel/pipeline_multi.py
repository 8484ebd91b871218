"""Several stages per rank, for real: ``torch.distributed.pipelining``'s interleaved 1F1B, zero-bubble and
ZB-V schedules on the tiny GPT, timed action by action.

Each rank builds the whole GPT from the seed, cuts it into p * v chunks with
:func:`~ddpkit.parallel.pipeline.stage_bounds`, keeps the chunks its schedule gives it (rank r holds r,
r + p, ... for the looped schedules; r and 2p - 1 - r for ZB-V) as ``PipelineStage`` objects, and runs
one step. Every forward, backward (full or input-gradient) and weight-gradient call is timed on the
host's monotonic clock, with its chunk and micro-batch, so that the order torch ran can be compared
with :mod:`ddpkit.parallel.pipeline_schedules`' and the idle time measured.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddpkit.parallel import pipeline
from ddpkit.parallel.pipeline import GPTStage, runnable_schedules, stage_bounds
from ddpkit.parallel.pipeline_schedules import chunks_per_rank, stage_ranks

CLASSES = {"interleaved": "ScheduleInterleaved1F1B", "zero-bubble": "ScheduleInterleavedZeroBubble",
           "zbv": "ScheduleZBVZeroBubble"}


def schedule_class(name: str):
    """torch's class for a schedule name; a clear refusal where this torch lacks it or it is not tried."""
    from torch.distributed import pipelining

    from ddpkit.errors import UserError

    if name not in CLASSES:
        raise UserError(f"no multi-stage schedule {name!r}: use one of {', '.join(CLASSES)}")
    cls = getattr(pipelining, CLASSES[name], None)
    if cls is None or "1f1b" not in runnable_schedules():
        raise UserError(f"{CLASSES[name]} is not run here on torch {torch.__version__.split('+')[0]} (missing, or "
                        f"older than 2.8, where Schedule1F1B hangs on gloo and these were not tried): use torch >= 2.8")
    return cls


def _timed(record: list, rank: int, stage: int, kind, fn):
    """``fn`` recorded as (rank, chunk, kind, micro-batch, start, end); ``kind`` may depend on the call."""
    def wrapper(mb_index, *args, **kwargs):
        start = time.monotonic()
        try:
            return fn(mb_index, *args, **kwargs)
        finally:
            record.append({"rank": rank, "stage": stage, "kind": kind(kwargs) if callable(kind) else kind,
                           "micro": mb_index, "start": start, "end": time.monotonic()})
    return wrapper


def run_schedules(ctx, cfg, names: list[str], n_micro: int, micro: int, v: int = 2,
                  skip_weight_gradients: tuple[str, ...] = ()) -> dict:
    """One step of each schedule in ``names`` on ``n_micro`` micro-batches of ``micro`` sequences (a function
    for ``ddpkit.launch``; the world is the pipeline). Returns, per schedule: this rank's chunks, its actions
    in the order torch ran them with their times, and the largest difference between its parameters'
    gradients and the unsplit model's on the same batch (infinite if one is missing).

    ``skip_weight_gradients`` names split-backward schedules to run once more with every W made a no-op,
    as ``"<name>, W skipped"``: the negative control showing that W is what fills the weight gradients."""
    from torch.distributed.pipelining import PipelineStage

    from ddpkit.models import build_model, loss_fn

    p, r, device = ctx.world_size, ctx.rank, ctx.device
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (n_micro * micro, cfg.seq_len)).to(device)
    whole = build_model(cfg).to(device)
    loss_fn(whole(tokens), tokens).backward()
    reference = {n: q.grad for n, q in whole.named_parameters()}
    out = {}
    runs = [(n, False) for n in names] + [(n, True) for n in skip_weight_gradients]
    for name, skip_w in runs:
        cls = schedule_class(name)
        chunks = chunks_per_rank(name, v)
        n_stages = p * chunks
        owner = stage_ranks(p, chunks, "v" if name == "zbv" else "loop")
        model = build_model(cfg).to(device)
        bounds = stage_bounds(cfg.n_layers, n_stages)
        mine = [s for s in range(n_stages) if owner[s] == r]
        timeline: list[dict] = []
        stages = []
        for s in mine:
            stage = PipelineStage(GPTStage(model, *bounds[s]), s, n_stages, device, group=dist.group.WORLD)
            stage.forward_one_chunk = _timed(timeline, r, s, "F", stage.forward_one_chunk)
            stage.backward_one_chunk = _timed(timeline, r, s, lambda kw: "B" if kw.get("full_backward", True) else "I",
                                              stage.backward_one_chunk)
            weight = (lambda mb_index, **kw: None) if skip_w else stage.backward_weight_one_chunk
            stage.backward_weight_one_chunk = _timed(timeline, r, s, "W", weight)
            stages.append(stage)
        pipe = cls(stages, n_micro, loss_fn=lambda output, target: pipeline.micro_batch_loss(output, target, n_micro),
                   scale_grads=False)
        dist.barrier()
        pipe.step(*((tokens,) if 0 in mine else ()), **({"target": tokens} if n_stages - 1 in mine else {}))
        names_of = {id(q): n for n, q in model.named_parameters()}
        diff = max(float("inf") if q.grad is None else float((q.grad - reference[names_of[id(q)]]).abs().max())
                   for stage in stages for q in stage.submod.parameters())
        out[f"{name}, W skipped" if skip_w else name] = {"rank": r, "chunks": mine, "timeline": timeline, "grad_diff": diff}
    return out


def merged_timeline(results: list[dict], name: str) -> list[dict]:
    """Every rank's timed actions of one schedule on one clock starting at 0, in the order each ran them."""
    events = [e for res in results for e in res[name]["timeline"]]
    origin = min(e["start"] for e in events)
    return sorted((dict(e, start=e["start"] - origin, end=e["end"] - origin) for e in events),
                  key=lambda e: (e["rank"], e["start"]))


def mean_times(timeline: list[dict], v: int) -> dict[str, float]:
    """Measured mean time of each kind of action, scaled to a whole stage (v chunks), for the simulator."""
    out = {}
    for kind in "FBIW":
        spans = [e["end"] - e["start"] for e in timeline if e["kind"] == kind]
        if spans:
            out[kind] = v * sum(spans) / len(spans)
    return out
