"""Pipeline parallelism: the layers split into stages, micro-batches passed along from stage to stage.

With p stages, stage s holds a contiguous range of layers and sends its output activations to stage
s+1 (and, in backward, the gradient of its input to stage s-1): point-to-point messages of one
activation, which tolerate slower links than tensor parallelism's all-reduces. A batch is cut into m
**micro-batches** so that the stages can work on different ones at once. What is left idle is the
**bubble**: stage s cannot start before s micro-batch forwards have passed through the stages before
it, and must wait as long for the last backwards. With a forward taking t_f and a backward t_b on every
stage, a step takes (m + p - 1)(t_f + t_b) while each stage is busy m(t_f + t_b), so the idle share is

    bubble = (p - 1) / (m + p - 1)

and shrinks as m grows. Two schedules with that same bubble (:func:`gpipe`, :func:`one_f_one_b`):

* **GPipe**: every stage runs all m forwards, then all m backwards. Simple, but stage 0 keeps the
  activations of **all m** micro-batches alive until their backwards;
* **1F1B**: after a warm-up of p - s - 1 forwards, stage s alternates one forward and one backward, so
  a micro-batch's activations are freed as soon as possible: at most **p - s** in flight, whatever m.

:func:`simulate` runs a schedule on a clock (checking every dependency: a forward needs the previous
stage's forward of that micro-batch, a backward the next stage's backward) and gives its timeline, its
bubble and the activations each stage holds; :func:`run_pipeline` runs the same schedules for real with
``torch.distributed.pipelining`` and measures them. Interleaved virtual stages, the zero-bubble split of
the backward and ZB-V are in :mod:`ddpkit.parallel.pipeline_schedules`.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

SCHEDULES = ("gpipe", "1f1b")
MIN_1F1B_TORCH = (2, 8)  # Schedule1F1B on gloo hangs before (seen with 2.4.1 and 2.7.1; 2.8.0 works)


def runnable_schedules(version: str | None = None) -> tuple[str, ...]:
    """The schedules :func:`run_pipeline` can run with this torch on gloo."""
    major, minor = (int(x) for x in (version or torch.__version__).split("+")[0].split(".")[:2])
    return SCHEDULES if (major, minor) >= MIN_1F1B_TORCH else ("gpipe",)


@dataclass(frozen=True)
class Action:
    """One unit of work: the forward (``F``) or backward (``B``) of micro-batch ``micro`` on ``stage``."""

    kind: str
    stage: int
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


def gpipe(p: int, m: int) -> list[list[Action]]:
    """Each stage's actions in order: all forwards, then all backwards."""
    return [[Action("F", s, i) for i in range(m)] + [Action("B", s, i) for i in range(m)] for s in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """Each stage's actions in order: p - s - 1 warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards."""
    orders = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        order = [Action("F", s, i) for i in range(warmup)]
        forward, backward = warmup, 0
        while forward < m:
            order += [Action("F", s, forward), Action("B", s, backward)]
            forward, backward = forward + 1, backward + 1
        order += [Action("B", s, i) for i in range(backward, m)]
        orders.append(order)
    return orders


def schedule(name: str, p: int, m: int) -> list[list[Action]]:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    return gpipe(p, m) if name == "gpipe" else one_f_one_b(p, m)


def predicted_bubble(p: int, m: int) -> float:
    """(p - 1) / (m + p - 1): the idle share of every schedule that keeps stages in lock-step."""
    return (p - 1) / (m + p - 1)


def simulate(orders: list[list[Action]], forward_s: float = 1.0, backward_s: float = 2.0) -> list[dict]:
    """Run each stage's actions in its order on a clock: an action starts when its stage is free and its
    dependency is done (F(s, i) after F(s-1, i); B(s, i) after B(s+1, i), and after F(s, i)). Returns the
    timeline (stage, kind, micro, start, end). Raises ValueError if an order can never finish (a
    backward before its own forward, or a cycle between stages)."""
    p = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    position, free_at, timeline = [0] * p, [0.0] * p, []
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if position[s] >= len(orders[s]):
                continue
            a = orders[s][position[s]]
            needs = [("F", s - 1, a.micro)] if a.kind == "F" and s > 0 else []
            if a.kind == "B":
                needs = [("F", s, a.micro)] + ([("B", s + 1, a.micro)] if s < p - 1 else [])
            if all(n in done for n in needs):
                start = max([free_at[s]] + [done[n] for n in needs])
                end = start + (forward_s if a.kind == "F" else backward_s)
                done[(a.kind, s, a.micro)] = free_at[s] = end
                timeline.append({"stage": s, "kind": a.kind, "micro": a.micro, "start": start, "end": end})
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: str(orders[s][position[s]]) for s in range(p) if position[s] < len(orders[s])}
            raise ValueError(f"schedule deadlocks: each stage waits on another ({stuck})")
    return timeline


def bubble(timeline: list[dict]) -> float:
    """Idle share of a timeline: 1 - busy time / (stages x the span from the first start to the last end)."""
    stages = {e["stage"] for e in timeline}
    span = max(e["end"] for e in timeline) - min(e["start"] for e in timeline)
    busy = sum(e["end"] - e["start"] for e in timeline)
    return 1.0 - busy / (len(stages) * span)


def in_flight(timeline: list[dict], stage: int) -> int:
    """The most micro-batches whose activations ``stage`` holds at once: forward done, backward not."""
    # at equal times a forward's end counts before a backward's start: the activation exists until then
    events = sorted((e["end"] if e["kind"] == "F" else e["start"], -1 if e["kind"] == "F" else 1)
                    for e in timeline if e["stage"] == stage)
    held = peak = 0
    for _, negated in events:
        held -= negated
        peak = max(peak, held)
    return peak


# --------------------------------------------------------------------------- the same schedules, for real

class GPTStage(nn.Module):
    """Blocks ``start:end`` of a :class:`~ddpkit.models.TinyGPT`, with the embeddings on the first
    stage and the final norm and head on the last (the same module objects: gradients land in them).
    It runs exactly the whole model's operations, in its order, so a pipeline computes the same numbers."""

    def __init__(self, model: nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.first, self.last = start == 0, end == len(model.blocks)
        self.tok_emb, self.pos_emb = (model.tok_emb, model.pos_emb) if self.first else (None, None)
        self.blocks = nn.ModuleList(model.blocks[start:end])
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if self.last else (None, None)
        self.activation_checkpointing = model.activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # token ids (B, T) -> embeddings (B, T, C)
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x  # (B, T, vocab) on the last stage


def stage_bounds(n_layers: int, p: int) -> list[tuple[int, int]]:
    """Contiguous block ranges, as even as possible; refuses more stages than blocks."""
    if p > n_layers:
        raise ValueError(f"pp {p} is more stages than the model's {n_layers} blocks: use --pp <= {n_layers}")
    cuts = [round(i * n_layers / p) for i in range(p + 1)]
    return list(zip(cuts, cuts[1:]))


def _timed(record: list, kind: str, fn, device: torch.device = torch.device("cpu")):
    """``fn`` with each call's (start, end) on the host's monotonic clock, shared by the ranks; on a GPU the
    end waits for the stream, so that it is when the chunk's work finished, not when it was queued."""
    def wrapper(*args, **kwargs):
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            record.append({"kind": kind, "start": start, "end": time.monotonic()})
    return wrapper


def micro_batch_loss(out: torch.Tensor, target: torch.Tensor, n_micro: int) -> torch.Tensor:
    """One micro-batch's share of the batch loss: its mean loss divided by the number of micro-batches.
    The schedule sums the micro-batches' gradients, so that sum is the gradient of the whole batch's mean
    loss, the unsplit model's (left undivided, every gradient would be ``n_micro`` times too large)."""
    from ddpkit.models import loss_fn

    return loss_fn(out, target) / n_micro


def run_pipeline(ctx, cfg, schedule_name: str, n_micro: int, micro: int, repeats: int = 1) -> dict:
    """Train one step of ``cfg``'s GPT on ``n_micro`` micro-batches of ``micro`` sequences, pipelined over
    the world with ``torch.distributed.pipelining`` (a function for ``ddpkit.launch``), ``repeats`` times. Returns, from every stage: the largest
    difference between its parameters' gradients and the unsplit model's on the same batch, each
    forward and backward chunk's (start, end) on the shared monotonic clock (the last repeat), and the
    measured activation bytes of one micro-batch on this stage."""
    from torch.distributed.pipelining import PipelineStage

    from ddpkit.errors import UserError
    from ddpkit.models import build_model, loss_fn
    from ddpkit.parallel.memory import activation_bytes

    if schedule_name not in runnable_schedules():
        raise UserError(f"torch.distributed.pipelining's {schedule_name} schedule hangs on gloo before torch "
                        f"{'.'.join(map(str, MIN_1F1B_TORCH))} (this is {torch.__version__.split('+')[0]}): use gpipe "
                        f"or a newer torch")
    p, s, device = ctx.world_size, ctx.rank, ctx.device
    batch = n_micro * micro
    model = build_model(cfg).to(device)
    start, end = stage_bounds(cfg.n_layers, p)[s]
    module = GPTStage(model, start, end)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len)).to(device)
    example = tokens[:micro] if s == 0 else torch.zeros(micro, cfg.seq_len, cfg.d_model, device=device)
    shapes = {}
    if inspect.signature(PipelineStage.__init__).parameters["input_args"].default is inspect.Parameter.empty:
        # an older torch infers shapes at construction by running the stage on empty tensors, which an
        # embedding cannot take: give it the output shape too, so that it runs nothing
        width = cfg.vocab_size if s == p - 1 else cfg.d_model
        shapes = {"input_args": (example,), "output_args": (torch.zeros(micro, cfg.seq_len, width, device=device),)}
    timeline: list[dict] = []
    pipe = _timed_schedule(ctx, module, schedule_name, n_micro, timeline, shapes)
    for _ in range(repeats):
        _timed_step(ctx, module, pipe, tokens, timeline)
    whole = build_model(cfg).to(device)
    loss_fn(whole(tokens), tokens).backward()
    names = {id(q): n for n, q in model.named_parameters()}
    reference = dict(whole.named_parameters())
    grad_diff = max(float((q.grad - reference[names[id(q)]].grad).abs().max()) for q in module.parameters())
    probe = example if s == 0 else torch.randn(micro, cfg.seq_len, cfg.d_model, device=device, requires_grad=True)
    return {"stage": s, "blocks": [start, end], "grad_diff": grad_diff, "timeline": timeline,
            "activation_bytes_per_micro": activation_bytes(module, probe)}


def _timed_schedule(ctx, module, schedule_name: str, n_micro: int, timeline: list, shapes: dict):
    """A ``PipelineStage`` of ``module`` for this rank, its forward and backward chunks recorded into
    ``timeline``, under torch's GPipe or 1F1B schedule for ``n_micro`` micro-batches."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(module, ctx.rank, ctx.world_size, ctx.device, group=dist.group.WORLD, **shapes)
    stage.forward_one_chunk = _timed(timeline, "F", stage.forward_one_chunk, ctx.device)
    stage.backward_one_chunk = _timed(timeline, "B", stage.backward_one_chunk, ctx.device)
    cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
    options = {"scale_grads": False} if "scale_grads" in inspect.signature(cls.__init__).parameters else {}
    return cls(stage, n_micro, loss_fn=lambda out, target: micro_batch_loss(out, target, n_micro), **options)


def _timed_step(ctx, module, pipe, tokens: torch.Tensor, timeline: list) -> None:
    """One pipelined step from a barrier, with ``timeline`` holding only its chunks."""
    timeline.clear()
    module.zero_grad(set_to_none=True)
    dist.barrier(**({"device_ids": [ctx.device.index]} if ctx.device.type == "cuda" else {}))
    if ctx.rank == 0:
        pipe.step(tokens)
    elif ctx.rank == ctx.world_size - 1:
        pipe.step(target=tokens)
    else:
        pipe.step()


def bubble_pairs(ctx, cfg, schedule_name: str, few: int, many: int, micro: int, pairs: int) -> dict:
    """Notebook 13's timing lesson in one start of the ranks (a function for ``ddpkit.launch``): ``pairs``
    pairs of steps back to back, one on ``few`` micro-batches and one on ``many`` (which goes first
    alternates from pair to pair), each timed chunk by chunk. Returns this stage's timelines, keyed by
    ``(pair, n_micro)``, for :func:`measured_timeline` and :func:`bubble` in the caller. A pair taken within
    a few hundred milliseconds meets the same load on both of its steps; a pair of separate launches
    seconds apart does not. Both schedules drive the same stage module, one ``PipelineStage`` each."""
    from ddpkit.models import build_model

    model = build_model(cfg).to(ctx.device)
    start, end = stage_bounds(cfg.n_layers, ctx.world_size)[ctx.rank]
    module = GPTStage(model, start, end)
    torch.manual_seed(0)
    tokens = {m: torch.randint(0, cfg.vocab_size, (m * micro, cfg.seq_len)).to(ctx.device) for m in (few, many)}
    timeline: list[dict] = []
    pipes = {m: _timed_schedule(ctx, module, schedule_name, m, timeline, {}) for m in (few, many)}
    for m in (few, many):  # warm-up: the first step of a schedule sets up its buffers
        _timed_step(ctx, module, pipes[m], tokens[m], timeline)
    out = {}
    for pair in range(pairs):
        for m in ((few, many) if pair % 2 == 0 else (many, few)):
            _timed_step(ctx, module, pipes[m], tokens[m], timeline)
            out[(pair, m)] = list(timeline)
    return {"stage": ctx.rank, "timelines": out}


def bubble_drops(results: list[dict], few: int, many: int) -> list[float]:
    """Per pair of :func:`bubble_pairs`: the bubble with ``few`` micro-batches minus the one with ``many``."""
    def bubble_of(pair: int, m: int) -> float:
        return bubble(measured_timeline([{"stage": r["stage"], "timeline": r["timelines"][(pair, m)]} for r in results]))

    pairs = sorted({pair for pair, _ in results[0]["timelines"]})
    return [bubble_of(pair, few) - bubble_of(pair, many) for pair in pairs]


def measured_timeline(results: list[dict]) -> list[dict]:
    """Every stage's recorded chunks on one clock, starting at 0, with micro-batch numbers in order."""
    origin = min(e["start"] for r in results for e in r["timeline"])
    out = []
    for r in results:
        counts = {"F": 0, "B": 0}
        for e in sorted(r["timeline"], key=lambda e: e["start"]):
            out.append({"stage": r["stage"], "kind": e["kind"], "micro": counts[e["kind"]],
                        "start": e["start"] - origin, "end": e["end"] - origin})
            counts[e["kind"]] += 1
    return out
