"""Pipeline parallelism in the trainer: every rank holds one stage; a step runs 1F1B (or GPipe, or ZB-H1).

With ``--pp P`` the GPT's blocks are cut into P contiguous stages (:func:`~ddpkit.parallel.pipeline.stage_bounds`).
The P ranks of one data-parallel replica (same dp and tp coordinates) hold one stage each and pass
activations forward, and their gradients back, as point-to-point messages. The step's ``grad_accum``
micro-batches are the pipeline's m micro-batches: raise ``--grad-accum`` to shrink the bubble
(P - 1) / (m + P - 1).

The executor runs the schedule that our own generator makes (``--pp-schedule``: 1F1B by default, GPipe,
or ZB-H1 from :mod:`~ddpkit.parallel.pipeline_schedules`): this stage's actions in order. ZB-H1 splits a
backward in two: ``I`` computes only the gradient of the stage's input (``torch.autograd.backward`` with
``inputs=[x]``, the graph kept) and sends it on at once; ``W`` later computes the weights' gradients
through the same graph (``inputs=`` the stage's parameters). The weight gradients are the same numbers as
a whole backward's, so the trained weights are 1F1B's to the bit.

The messages follow :func:`exchange_plan`: before each action, the send of what the previous action
produced and the receive the action needs are posted **together** (``batch_isend_irecv``), as torch's own
pipelining does. On NCCL a send does not complete until its
receive is posted, and a rank's operations run in the order they were issued; posted one at a time,
stage 0 of a 1F1B schedule issues S(a0) S(a1) R(g0) while stage 1 issues R(a0) S(g0) R(a1), and once an
activation is larger than NCCL's buffers both wait forever: S(a1) for R(a1), which is queued behind
S(g0), which waits for R(g0), which is queued behind S(a1). ``rendezvous.py`` replays every rank's
recorded messages under that rule and proves the batched plan free of such cycles, for every schedule
and layout the kit runs.

Where a stage's step differs from the whole model's:

* stage 0 embeds the token ids; every other stage receives a (B, T, C) activation from the one before;
* the last stage computes the loss and starts backward from it; every other stage starts backward from
  the gradient that the next stage sends back;
* only the last stage knows the loss: it broadcasts the step's loss sums over the pipeline group, so
  every rank reports the same global loss;
* gradients are averaged across data-parallel replicas by one all-reduce of all of the stage's gradients
  over its own dp group, divided by dp first as DDP does (with dp = 2 the sum is bitwise DDP's);
* the clip norm is the whole model's: squared norms summed over the stages (and tp shards);
* state goes in and out in the unsplit model's layout, keyed by its parameter names, so a checkpoint
  written under one layout (pp, tp, dp) resumes under any other, plain DDP included; each stage writes
  and reads only its own parameters (``held_state.py``).

Every rank builds the whole model (from the seed, so identical everywhere) and then keeps only its
stage's weights: the other layers move to the ``meta`` device (shapes, no storage), so parameter,
gradient and optimizer memory per rank fall with P. Each stage runs exactly the whole model's
operations on the same samples, so the losses match DDP's to float rounding.

Composes with tensor parallelism: each stage's blocks are split over the tp group (``tensor.py``), and
each tp rank exchanges activations with the same tp rank of the neighbouring stages (each sends its
full copy: simple, and the messages are small next to the all-reduces inside a block).

Composes with context parallelism (``--cp``): each stage's attentions become ring attention over the
cp group (ranks of the same stage, dp and tp coordinates, each holding two of the sequence's 2 x cp
chunks, ``context.py``); activations travel between the same cp ranks of neighbouring stages, each its
positions only; the last stage's loss sums are averaged over cp, and the gradients over dp x cp, for the
reason ``context_strategy.py`` gives.

Communication reported (``comm_s``, ``comm_bytes``): the message exchanges (their wait is the pipeline's
bubble as this rank sees it; bytes received), and the data-parallel all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.metrics import CommTimer
from ddpkit.models import loss_fn
from ddpkit.parallel.base import Strategy
from ddpkit.parallel.chunks import adam_state
from ddpkit.parallel.held_state import MOMENTS, HeldState, param_groups
from ddpkit.parallel.pipeline import Action, GPTStage, stage_bounds
from ddpkit.parallel.pipeline_schedules import generate

ACTIVATION_DTYPE = torch.float32  # what travels between stages (a block's residual stream is fp32 under autocast too)


@dataclass(frozen=True)
class Message:
    """One point-to-point message of a stage: ``send`` or ``recv`` of micro-batch ``micro``'s ``activation``
    (forward) or ``grad`` (backward), with the neighbouring stage ``peer``."""

    kind: str
    what: str
    micro: int
    peer: int


def exchange_plan(order: list[Action], stage: int, p: int) -> list[list[Message]]:
    """The message batches of ``stage`` running ``order``: batch k is posted before action k (and the
    last one after the final action) and holds the send of what action k-1 produced and the receive that
    action k needs, so that the two progress together."""
    def needs(a: Action) -> list[Message]:
        if a.kind == "F" and stage > 0:
            return [Message("recv", "activation", a.micro, stage - 1)]
        if a.kind in "BI" and stage < p - 1:  # an input gradient starts from the next stage's
            return [Message("recv", "grad", a.micro, stage + 1)]
        return []

    def makes(a: Action) -> list[Message]:
        if a.kind == "F" and stage < p - 1:
            return [Message("send", "activation", a.micro, stage + 1)]
        if a.kind in "BI" and stage > 0:
            return [Message("send", "grad", a.micro, stage - 1)]
        return []

    batches, previous = [], []
    for a in order:
        batches.append(previous + needs(a))
        previous = makes(a)
    return batches + [previous]


class PipelineStrategy(HeldState, Strategy):
    """One stage of the GPT per rank, micro-batches scheduled 1F1B, gradients averaged over dp (see the module docstring)."""

    name = "ddp"
    schedule_name = "1f1b"
    """``1f1b``, ``gpipe`` or ``zero-bubble`` (the trainer sets it from ``--pp-schedule``)."""
    batch_messages = True
    """Post each batch of :func:`exchange_plan` together. False posts its messages one at a time (each
    receive waited for, each send not), the way that deadlocks on NCCL: kept to show that it does."""

    # ------------------------------------------------------------------ building

    def wrap(self, model: nn.Module) -> nn.Module:
        """Split the model (over tp first, if asked), keep this rank's stage, drop the rest's weights."""
        ctx = self.ctx
        if ctx.dims.tp > 1:
            from ddpkit.parallel.tensor import parallelize

            parallelize(model, ctx.tp_group)
        self.dp_cp_group = ctx.dp_group
        if ctx.dims.cp > 1:  # positions over cp: ring attention on this rank's heads, gradients over dp x cp
            from ddpkit.parallel.context import parallelize_context

            parallelize_context(model, ctx.mesh.get_group("cp"))
            dims = ctx.dims
            same = {}  # (pp, tp) -> the ranks that hold the same stage and slices: every dp and cp coordinate
            for r in range(dims.world_size):
                c = dims.coords(r)
                same.setdefault((c["pp"], c["tp"]), []).append(r)
            self.dp_cp_group, _ = dist.new_subgroups_by_enumeration(list(same.values()))  # collective: every rank, same order
        self.whole, self.timer = model, CommTimer(ctx.device)
        start, end = stage_bounds(len(model.blocks), ctx.dims.pp)[ctx.pp_rank]
        self.stage = GPTStage(model, start, end)
        name_of = {id(p): name for name, p in model.named_parameters()}
        self.names = [name_of[id(p)] for p in self.stage.parameters()]  # this stage's, in optimizer order
        self.order = list(name_of.values())  # the whole model's, as a DDP run's optimizer numbers them
        held = {id(m) for m in self.stage.modules()}
        for part in (model.tok_emb, model.pos_emb, *model.blocks, model.ln_f, model.lm_head):
            if id(part) not in held:
                part.to("meta")  # another stage's: shapes stay (and names), storage goes
        # one operation of every rank of the pipeline group first: NCCL requires it before a batch of
        # point-to-point operations that involves only some of them
        dist.all_reduce(torch.zeros(1, device=ctx.device), group=ctx.pp_group)
        return self.stage

    def build_optimizer(self, model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        self.optimizer = torch.optim.AdamW(self.stage.parameters(), lr=lr, weight_decay=weight_decay)
        return self.optimizer

    @property
    def overflow_group(self):
        return self.ctx.world_group  # stages (and tp shards) hold different gradients

    def comm_timer(self, model: nn.Module) -> CommTimer:
        return self.timer

    # ------------------------------------------------------------------ messages between stages

    @property
    def _first(self) -> bool:
        return self.ctx.pp_rank == 0

    @property
    def _last(self) -> bool:
        return self.ctx.pp_rank == self.ctx.dims.pp - 1

    def _recv(self, shape: tuple[int, ...], stage: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=ACTIVATION_DTYPE, device=self.ctx.device)
        with self.timer.timed(buffer.numel() * buffer.element_size()):
            dist.recv(buffer, src=self.ctx.stage_rank(stage), group=self.ctx.pp_group)
        return buffer

    def _exchange(self, batch: list[Message], outgoing: dict, shape: tuple[int, ...], pending: list) -> dict:
        """Post one batch of messages: ``outgoing`` holds what to send by (what, micro); returns what was
        received, by (what, micro). Batched, every operation has completed on return; one at a time
        (:attr:`batch_messages` False), sends are only waited for at the end of the step (``pending``)."""
        ops, received = [], {}
        for message in batch:
            peer = self.ctx.stage_rank(message.peer)
            if message.kind == "send":
                tensor = outgoing.pop((message.what, message.micro)).detach().to(ACTIVATION_DTYPE).contiguous()
                ops.append(dist.P2POp(dist.isend, tensor, peer, group=self.ctx.pp_group))
            else:
                buffer = torch.empty(shape, dtype=ACTIVATION_DTYPE, device=self.ctx.device)
                received[(message.what, message.micro)] = buffer
                ops.append(dist.P2POp(dist.irecv, buffer, peer, group=self.ctx.pp_group))
        if not ops:
            return received
        nbytes = sum(b.numel() * b.element_size() for b in received.values())
        with self.timer.timed(nbytes):
            if self.batch_messages:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            else:
                for op in ops:
                    if op.op is dist.isend:
                        pending.append((dist.isend(op.tensor, op.peer, group=op.group), op.tensor))
                    else:
                        dist.recv(op.tensor, op.peer, group=op.group)
        return received

    def _activation_shape(self, tokens: torch.Tensor) -> tuple[int, int, int]:
        return (*tokens.shape, self.whole.tok_emb.embedding_dim)  # (B, T) -> (B, T, C)

    # ------------------------------------------------------------------ the step

    def forward_backward(self, model: nn.Module, micro_batches: list[dict], run: Callable) -> None:
        """Run this stage's actions of the schedule over the step's micro-batches, then share the loss
        and average the gradients. ``run`` is the step's :class:`~ddpkit.step.MicroStep`: its parts (to
        device, autocast, loss, backward, record) are used one by one."""
        s, p = self.ctx.pp_rank, self.ctx.dims.pp
        micro_batches = [self._shard(b) for b in micro_batches]
        order = generate(self.schedule_name, p, len(micro_batches), 1)[s]
        plan = exchange_plan(order, s, p)
        shape = self._activation_shape(micro_batches[0]["inputs"])  # every message is one (B, T, C)
        inputs, outputs, losses, sums, outgoing, pending, deferred = {}, {}, {}, {}, {}, [], {}
        if not self._last:  # fp16: the scaler takes its first scale when it first scales, and only the last
            run.scaler.scale(torch.zeros((), device=self.ctx.device))  # stage scales a loss; the others unscale
        for k, action in enumerate(order):
            received = self._exchange(plan[k], outgoing, shape, pending)
            i = action.micro
            if action.kind == "F":
                tokens, targets = run.to_device(micro_batches[i])
                x = tokens if self._first else received[("activation", i)].requires_grad_(True)
                with run.timer("forward_s"), run.autocast():
                    out = self.stage(x)
                    if self._last:
                        per_sample = loss_fn(out, targets, reduction="none")  # (B,)
                        losses[i], sums[i] = run.loss(per_sample), per_sample.detach().sum()
                inputs[i], outputs[i] = x, out
                outgoing[("activation", i)] = out
            elif action.kind == "W":  # the weights' gradients, through the graph that I kept
                with run.timer("backward_s"):
                    torch.autograd.backward(*deferred.pop(i), inputs=[q for q in self.stage.parameters() if q.requires_grad])
            else:
                x, out = inputs.pop(i), outputs.pop(i)
                if action.kind == "I":  # the input's gradient only (none on the first stage), sent on at once
                    start = run.scaler.scale(losses.pop(i)) if self._last else out
                    deferred[i] = (start, None if self._last else received[("grad", i)].to(out.dtype))
                    if not self._first:
                        with run.timer("backward_s"):
                            torch.autograd.backward(*deferred[i], inputs=[x], retain_graph=True)
                elif self._last:
                    run.backward(losses.pop(i))
                else:
                    with run.timer("backward_s"):
                        out.backward(received[("grad", i)].to(out.dtype))
                if not self._first:
                    outgoing[("grad", i)] = x.grad
        self._exchange(plan[-1], outgoing, shape, pending)
        for work, _ in pending:  # the messages must have left before their buffers go
            work.wait()
        for i, loss_sum in enumerate(self._loss_sums(sums, len(micro_batches))):
            run.record(loss_sum, micro_batches[i])
        self._average_gradients()

    def _loss_sums(self, sums: dict, m: int) -> torch.Tensor:
        """The last stage's per-micro-batch loss sums, on every stage of the pipeline."""
        if self._last:
            shared = torch.stack([sums[i] for i in range(m)]).to(torch.float32)
        else:
            shared = torch.empty(m, dtype=torch.float32, device=self.ctx.device)
        dist.broadcast(shared, src=self.ctx.stage_rank(self.ctx.dims.pp - 1), group=self.ctx.pp_group)
        return self._mean_over_cp(shared)

    # ------------------------------------------------------------------ context parallelism

    def _shard(self, batch: dict) -> dict:
        """This rank's positions of a micro-batch (the whole batch without context parallelism)."""
        n = self.ctx.dims.cp
        if n == 1:
            return batch
        from ddpkit.parallel.context import shard_sequence

        r = self.ctx.dims.coords(self.ctx.rank)["cp"]
        return {**batch, "inputs": shard_sequence(batch["inputs"], r, n, 1),
                "targets": shard_sequence(batch["targets"], r, n, 1)}

    def _mean_over_cp(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss over this rank's positions -> over whole sequences (the cp shards are equal in size)."""
        if self.ctx.dims.cp == 1:
            return loss
        dist.all_reduce(loss, group=self.ctx.mesh.get_group("cp"))
        return loss / self.ctx.dims.cp

    def _average_gradients(self) -> None:
        """Mean over the data-parallel (and context-parallel) peers of this stage: one all-reduce of every
        gradient at once."""
        n = self.ctx.dp_size * self.ctx.dims.cp
        if n == 1:
            return
        grads = [q.grad for q in self.stage.parameters() if q.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(n)
        with self.timer.timed(flat.numel() * flat.element_size()):
            dist.all_reduce(flat, group=self.dp_cp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the whole model's gradient norm: every stage's (and tp shard's) squares, summed."""
        if self.ctx.dims.tp > 1:
            from ddpkit.parallel.tensor import grad_norm_squared

            squared = grad_norm_squared(self.whole, self.ctx.tp_group)
        else:
            squared = sum((q.grad.detach().double().pow(2).sum() for q in self.stage.parameters() if q.grad is not None),
                          torch.zeros((), dtype=torch.float64, device=self.ctx.device))
        squared = squared.to(self.ctx.device)
        dist.all_reduce(squared, group=self.ctx.pp_group)
        total = squared.sqrt().float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # what torch's clip_grad_norm_ multiplies by
        for q in self.stage.parameters():
            if q.grad is not None:
                q.grad.mul_(coef.to(q.grad.device))
        return total

    def eval_loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """A forward-only pass through the pipeline; the last stage's loss, on every stage."""
        s = self.ctx.pp_rank
        batch = self._shard({"inputs": inputs, "targets": targets})
        inputs, targets = batch["inputs"], batch["targets"]
        with torch.no_grad():
            x = inputs if self._first else self._recv(self._activation_shape(inputs), s - 1)
            out = self.stage(x)
            if not self._last:
                dist.send(out.to(ACTIVATION_DTYPE).contiguous(), dst=self.ctx.stage_rank(s + 1), group=self.ctx.pp_group)
            loss = loss_fn(out, targets).reshape(1) if self._last else torch.empty(1, device=self.ctx.device)
            dist.broadcast(loss, src=self.ctx.stage_rank(self.ctx.dims.pp - 1), group=self.ctx.pp_group)
        return float(self._mean_over_cp(loss))

    # ------------------------------------------------------------------ state in and out, in the unsplit layout

    def _chunked(self, per_param: dict) -> dict:
        if self.ctx.dims.tp > 1:
            from ddpkit.parallel.tensor import chunked_state

            return chunked_state(self.whole, per_param)
        return per_param

    def model_names(self, model) -> list[str]:
        return list(self.order)

    def held_state(self, model, optimizer) -> tuple[dict, dict]:
        """This stage's parameters only (each tp slice as its chunks), keyed by the whole model's names."""
        params = list(self.stage.parameters())
        model_state = self._chunked({name: q.detach() for name, q in zip(self.names, params)})
        if optimizer is None:
            return model_state, {}
        state = {name: {k: (self._chunked({name: v})[name] if k in MOMENTS else v) for k, v in entry.items()}
                 for name, entry in zip(self.names, adam_state(optimizer, params))}  # moments: their parameter's layout
        return model_state, {"state": state, "param_groups": param_groups(optimizer, self.order)}
