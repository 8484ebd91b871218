"""Pipeline parallelism in the trainer: every rank holds one stage, and a step runs a 1F1B schedule.

With ``--pp P`` the GPT's blocks are cut into P contiguous stages (:func:`~ddpkit.parallel.pipeline.stage_bounds`).
The P ranks of one data-parallel replica (same dp and tp coordinates) hold one stage each and pass
activations forward, and their gradients back, as point-to-point messages. The step's ``grad_accum``
micro-batches are the pipeline's m micro-batches: raise ``--grad-accum`` to shrink the bubble
(P - 1) / (m + P - 1).

The executor runs the schedule that our own generator makes (:func:`~ddpkit.parallel.pipeline.one_f_one_b`):
this stage's actions in order, sends posted without waiting (``isend``), receives waited for. The
schedule's dependencies are acyclic (:func:`~ddpkit.parallel.pipeline.simulate` checks it), so no rank
waits for a message that its peer will never send.

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
  written under one layout (pp, tp, dp) resumes under any other, plain DDP included.

Every rank builds the whole model (from the seed, so identical everywhere) and then keeps only its
stage's weights: the other layers move to the ``meta`` device (shapes, no storage), so parameter,
gradient and optimizer memory per rank fall with P. Each stage runs exactly the whole model's
operations on the same samples, so the losses match DDP's to float rounding.

Composes with tensor parallelism: each stage's blocks are split over the tp group (``tensor.py``), and
each tp rank exchanges activations with the same tp rank of the neighbouring stages (each sends its
full copy: simple, and the messages are small next to the all-reduces inside a block).

Communication reported (``comm_s``, ``comm_bytes``): the receives, whose wait is the pipeline's bubble
as this rank sees it, and the data-parallel all-reduce.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.metrics import CommTimer
from ddpkit.models import loss_fn
from ddpkit.parallel.base import Strategy
from ddpkit.parallel.pipeline import GPTStage, schedule, stage_bounds
from ddpkit.parallel.zero import MOMENTS, _ReplicatedStateMixin

ACTIVATION_DTYPE = torch.float32  # what travels between stages (a block's residual stream is fp32 under autocast too)


class PipelineStrategy(_ReplicatedStateMixin, Strategy):
    """One stage of the GPT per rank, micro-batches scheduled 1F1B, gradients averaged over dp (see the module docstring)."""

    name = "ddp"
    schedule_name = "1f1b"

    # ------------------------------------------------------------------ building

    def wrap(self, model: nn.Module) -> nn.Module:
        """Split the model (over tp first, if asked), keep this rank's stage, drop the rest's weights."""
        ctx = self.ctx
        if ctx.dims.tp > 1:
            from ddpkit.parallel.tensor import parallelize

            parallelize(model, ctx.tp_group)
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
        return self.stage

    def build_optimizer(self, model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.stage.parameters(), lr=lr, weight_decay=weight_decay)

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

    def _send(self, tensor: torch.Tensor, stage: int, pending: list) -> None:
        message = tensor.detach().to(ACTIVATION_DTYPE).contiguous()
        pending.append((dist.isend(message, dst=self.ctx.stage_rank(stage), group=self.ctx.pp_group), message))

    def _activation_shape(self, tokens: torch.Tensor) -> tuple[int, int, int]:
        return (*tokens.shape, self.whole.tok_emb.embedding_dim)  # (B, T) -> (B, T, C)

    # ------------------------------------------------------------------ the step

    def forward_backward(self, model: nn.Module, micro_batches: list[dict], run: Callable) -> None:
        """Run this stage's actions of the schedule over the step's micro-batches, then share the loss
        and average the gradients. ``run`` is the step's :class:`~ddpkit.step.MicroStep`: its parts (to
        device, autocast, loss, backward, record) are used one by one."""
        s, p = self.ctx.pp_rank, self.ctx.dims.pp
        inputs, outputs, losses, sums, pending = {}, {}, {}, {}, []
        for action in schedule(self.schedule_name, p, len(micro_batches))[s]:
            i = action.micro
            if action.kind == "F":
                tokens, targets = run.to_device(micro_batches[i])
                x = tokens if self._first else self._recv(self._activation_shape(tokens), s - 1).requires_grad_(True)
                with run.timer("forward_s"), run.autocast():
                    out = self.stage(x)
                    if self._last:
                        per_sample = loss_fn(out, targets, reduction="none")  # (B,)
                        losses[i], sums[i] = run.loss(per_sample), per_sample.detach().sum()
                if not self._last:
                    self._send(out, s + 1, pending)
                inputs[i], outputs[i] = x, out
            else:
                x, out = inputs.pop(i), outputs.pop(i)
                if self._last:
                    run.backward(losses.pop(i))
                else:
                    grad = self._recv(tuple(out.shape), s + 1)
                    with run.timer("backward_s"):
                        out.backward(grad.to(out.dtype))
                if not self._first:
                    self._send(x.grad, s - 1, pending)
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
        return shared

    def _average_gradients(self) -> None:
        """Mean over the data-parallel replicas of this stage: one all-reduce of every gradient at once."""
        if self.ctx.dp_size == 1:
            return
        grads = [q.grad for q in self.stage.parameters() if q.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.ctx.dp_size)
        with self.timer.timed(flat.numel() * flat.element_size()):
            dist.all_reduce(flat, group=self.ctx.dp_group)
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
        with torch.no_grad():
            x = inputs if self._first else self._recv(self._activation_shape(inputs), s - 1)
            out = self.stage(x)
            if not self._last:
                dist.send(out.to(ACTIVATION_DTYPE).contiguous(), dst=self.ctx.stage_rank(s + 1), group=self.ctx.pp_group)
            loss = loss_fn(out, targets).reshape(1) if self._last else torch.empty(1, device=self.ctx.device)
            dist.broadcast(loss, src=self.ctx.stage_rank(self.ctx.dims.pp - 1), group=self.ctx.pp_group)
        return float(loss)

    # ------------------------------------------------------------------ state in and out, in the unsplit layout

    def _full(self, per_param: dict) -> dict:
        if self.ctx.dims.tp > 1:
            from ddpkit.parallel.tensor import full_state

            return full_state(self.whole, per_param)
        return {name: t.detach() for name, t in per_param.items()}

    def _local(self, per_param: dict) -> dict:
        if self.ctx.dims.tp > 1:
            from ddpkit.parallel.tensor import local_state

            return local_state(self.whole, per_param)
        return per_param

    def state_dicts(self, model, optimizer, rank0_only: bool = True) -> tuple[dict, dict]:
        """The whole model's state, gathered from the stages (collective over the pipeline group)."""
        params = self._full(dict(zip(self.names, self.stage.parameters())))
        model_state = {name: t.cpu().clone() for name, t in params.items()}
        saved = optimizer.state_dict()
        state = {}
        for index, entry in saved["state"].items():  # each moment has its parameter's layout
            name = self.names[int(index)]
            moments = {k: self._full({name: entry[k]})[name].cpu().clone() for k in MOMENTS if k in entry}
            state[name] = {**entry, **moments}
        parts = [None] * self.ctx.dims.pp
        dist.all_gather_object(parts, (model_state, state), group=self.ctx.pp_group)
        merged_model, merged_state = {}, {}
        for stage_model, stage_state in parts:
            merged_model.update(stage_model)
            merged_state.update(stage_state)
        groups = [{**g, "params": list(self.order)} for g in saved["param_groups"]]
        return ({name: merged_model[name] for name in self.order},
                {"state": {name: merged_state[name] for name in self.order if name in merged_state},
                 "param_groups": groups})

    def load_state_dicts(self, model, optimizer, model_state: dict, optimizer_state: dict | None) -> None:
        """Whole-model state dicts in (from any layout); this stage takes its own parameters' part."""
        local = self._local({name: model_state[name] for name in self.names})
        with torch.no_grad():
            for name, q in zip(self.names, self.stage.parameters()):
                q.copy_(local[name])
        if optimizer is None or optimizer_state is None:
            return
        state = {}
        for index, name in enumerate(self.names):
            if name in optimizer_state["state"]:
                entry = optimizer_state["state"][name]
                moments = {k: self._local({name: entry[k]})[name].clone() for k in MOMENTS if k in entry}
                state[index] = {**entry, **moments}
        groups = [{**g, "params": list(range(len(self.names)))} for g in optimizer_state["param_groups"]]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
