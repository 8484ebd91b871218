"""ZeRO stage 1: every rank keeps the whole model but only 1/N of the optimizer state.

DDP keeps N identical copies of AdamW's two moments (8 bytes per parameter in fp32), and every rank
runs the same update on every parameter. ZeRO-1 (Rajbhandari et al., 2020) cuts that redundancy:

1. the parameters are viewed as one flat vector of P numbers, cut into N shards of ceil(P/N);
2. after backward, a **reduce-scatter** of the gradients (instead of DDP's all-reduce) leaves each
   rank holding the averaged gradient of its own shard only;
3. each rank runs AdamW on its shard: an fp32 master copy of those parameters and their two moments,
   **12 bytes x ceil(P/N)** per rank (instead of 8 x P);
4. an **all-gather** of the updated shards gives every rank the whole new model again.

Reduce-scatter plus all-gather is exactly the two halves of a ring all-reduce (``comm.py``), so ZeRO-1
moves the same bytes as DDP and saves memory for free. With 2 ranks and gradient clipping off, the
numbers it adds are the same numbers in the same order as DDP's, so the parameters stay **bitwise**
equal to DDP + AdamW's; with clipping on, the norm is summed from the shards in another order and the
last bits differ.

:class:`ZeroAdamW` is that optimizer, written from scratch, with a torch optimizer's ``state_dict``
contract: ``state_dict()`` returns the whole AdamW state (gathered, keyed by parameter index, exactly
what ``torch.optim.AdamW`` would return) and ``load_state_dict`` takes one and keeps this rank's shard.
Checkpoints use neither: :meth:`ZeroAdamW.held_state` names the chunks of each moment that this rank's
flat range covers, so a ``dcp`` checkpoint holds each rank's own shard, written by that rank alone, and
still loads into DDP or FSDP2 (``held_state.py``). :class:`TorchZeroStrategy` runs PyTorch's own
``ZeroRedundancyOptimizer`` (under DDP) for comparison: it shards whole parameters, not a flat vector.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from ddpkit.metrics import CommTimer
from ddpkit.parallel.base import Strategy, _param_names, tensor_bytes
from ddpkit.parallel.chunks import adam_state, flat_chunked, set_hyperparameters
from ddpkit.parallel.comm import all_gather_into_tensor, reduce_scatter_tensor
from ddpkit.parallel.ddp import DDPStrategy
from ddpkit.parallel.held_state import MOMENTS, HeldState, param_groups


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW whose state is sharded over ``group`` (ZeRO stage 1; see the module docstring).

    ``param_groups`` hold the model's parameters, as in any optimizer (so ``zero_grad``, a learning-rate
    schedule and ``GradScaler`` work unchanged); the update itself runs in :attr:`inner`, a plain
    ``torch.optim.AdamW`` over :attr:`master`, this rank's flat shard.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.01, betas=(0.9, 0.999),
                 eps: float = 1e-8, group=None, timer: CommTimer | None = None) -> None:
        params = [p for p in params if p.requires_grad]
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps})
        if len(self.param_groups) != 1:
            raise ValueError("ZeroAdamW supports one parameter group")
        self.params, self.group, self.timer = params, group, timer or CommTimer()
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = math.ceil(self.numel / self.world)  # the last shard is padded
        self.lo = min(self.numel, self.rank * self.shard_numel)
        self.hi = min(self.numel, self.lo + self.shard_numel)
        self.master = self._flat_params()[self.lo:self.hi].clone()  # this rank's fp32 master weights
        self.inner = torch.optim.AdamW([self.master], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._reduced = False

    # ---------------------------------------------------------------- the three phases

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter: the averaged gradient of this rank's shard becomes ``master.grad`` (once per step)."""
        if self._reduced:
            return
        flat = torch.zeros(self.shard_numel * self.world, dtype=self.master.dtype, device=self.master.device)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        flat.div_(self.world)  # what DDP does to each bucket before summing: the same bits
        shard = torch.empty(self.shard_numel, dtype=flat.dtype, device=flat.device)
        with self.timer.timed(flat.numel() * flat.element_size()):
            reduce_scatter_tensor(shard, flat, self.group) if self.world > 1 else shard.copy_(flat)
        self.master.grad = shard[:self.hi - self.lo]
        self._reduced = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm: each rank holds a shard, so the squared norms are summed over ranks."""
        self.reduce_gradients()
        squared = torch.linalg.vector_norm(self.master.grad).pow(2).reshape(1)
        if self.world > 1:
            dist.all_reduce(squared, group=self.group)
        total = squared.sqrt()[0]
        self.master.grad.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the model's gradients and this rank's reduced shard of them (a step may be skipped after
        clipping reduced them: the next step must reduce its own)."""
        super().zero_grad(set_to_none=set_to_none)
        self.master.grad, self._reduced = None, False

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """Reduce-scatter (if clipping has not already), AdamW on the shard, all-gather the parameters."""
        if closure is not None:
            raise ValueError("ZeroAdamW does not take a closure")
        self.reduce_gradients()
        for key in ("lr", "weight_decay", "betas", "eps"):  # a schedule sets them on param_groups
            self.inner.param_groups[0][key] = self.param_groups[0][key]
        self.inner.step()
        self.master.grad, self._reduced = None, False
        padded = torch.zeros(self.shard_numel, dtype=self.master.dtype, device=self.master.device)
        padded[:self.hi - self.lo] = self.master
        full = torch.empty(self.shard_numel * self.world, dtype=padded.dtype, device=padded.device)
        with self.timer.timed(full.numel() * full.element_size()):
            all_gather_into_tensor(full, padded, self.group) if self.world > 1 else full.copy_(padded)
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    # ---------------------------------------------------------------- the state_dict contract

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(self.shard_numel, dtype=shard.dtype, device=shard.device)
        padded[:shard.numel()] = shard
        full = torch.empty(self.shard_numel * self.world, dtype=shard.dtype, device=shard.device)
        all_gather_into_tensor(full, padded, self.group) if self.world > 1 else full.copy_(padded)
        return full[:self.numel]

    def state_dict(self) -> dict:
        """The whole AdamW state, as ``torch.optim.AdamW.state_dict()`` would give it (collective)."""
        inner = self.inner.state_dict()
        group = {**inner["param_groups"][0], **{k: v for k, v in self.param_groups[0].items() if k != "params"}}
        group["params"] = list(range(len(self.params)))
        saved = inner["state"].get(0)
        state = {}
        if saved is not None:
            full = {key: self._gather(saved[key]) for key in MOMENTS}
            offset = 0
            for i, p in enumerate(self.params):
                state[i] = {"step": saved["step"].clone(),
                            **{key: full[key][offset:offset + p.numel()].view_as(p).clone() for key in MOMENTS}}
                offset += p.numel()
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take a whole AdamW state (ours or ``torch.optim.AdamW``'s) and keep this rank's shard. The
        master weights are refreshed from the model, so load the model first."""
        group = state_dict["param_groups"][0]
        if len(group["params"]) != len(self.params) or len(state_dict["param_groups"]) != 1:
            raise ValueError(f"optimizer state has {len(group['params'])} parameters, this model has {len(self.params)}")
        for key in ("lr", "weight_decay", "betas", "eps"):
            self.param_groups[0][key] = group[key]
        inner_group = {**self.inner.param_groups[0], **{k: group[k] for k in ("lr", "weight_decay", "betas", "eps")}}
        inner_group = {k: v for k, v in inner_group.items() if k != "params"}
        inner_state = {}
        by_index = [state_dict["state"].get(i, state_dict["state"].get(str(i))) for i in group["params"]]
        if any(entry is not None for entry in by_index):
            shard = {key: torch.cat([entry[key].reshape(-1) for entry in by_index])[self.lo:self.hi].clone()
                     for key in MOMENTS}
            step = by_index[0]["step"]
            inner_state = {0: {"step": torch.as_tensor(step, dtype=torch.float32).clone(), **shard}}
        self.inner.load_state_dict({"state": inner_state, "param_groups": [{**inner_group, "params": [0]}]})
        with torch.no_grad():
            self.master.copy_(self._flat_params()[self.lo:self.hi])
        self._reduced = False

    # ---------------------------------------------------------------- the state as this rank holds it

    def held_state(self, names: list[str]) -> dict:
        """This rank's AdamW state keyed by parameter name (``names``, in ``params`` order): the step
        counter, and each moment as the chunks of it that lie in ``[lo, hi)`` (views of the shard, no copy;
        created as a fresh AdamW would if no step has run)."""
        inner = adam_state(self.inner, [self.master])[0]
        state, offset = {}, 0
        for name, p in zip(names, self.params):
            start = max(offset, self.lo)
            stop = max(start, min(offset + p.numel(), self.hi))  # start == stop: nothing of p here
            moments = {k: flat_chunked(inner[k][start - self.lo:stop - self.lo], tuple(p.shape), start - offset)
                       for k in MOMENTS}  # empty where the parameter lies outside this rank's range
            state[name] = {"step": inner["step"], **moments}
            offset += p.numel()
        return state

    def param_groups_by_name(self, names: list[str]) -> list[dict]:
        """The one parameter group as ``torch.optim.AdamW`` would save it, with parameter names."""
        outer = {k: v for k, v in self.param_groups[0].items() if k != "params"}  # where a schedule sets lr
        return [{**param_groups(self.inner, names)[0], **outer, "params": list(names)}]

    @torch.no_grad()
    def refresh_master(self) -> None:
        """The master shard from the model's parameters (after they were loaded), parameter by parameter:
        the flat vector of all of them is never built."""
        offset = 0
        for p in self.params:
            start, stop = max(offset, self.lo), min(offset + p.numel(), self.hi)
            if start < stop:
                self.master[start - self.lo:stop - self.lo].copy_(p.detach().reshape(-1)[start - offset:stop - offset])
            offset += p.numel()
        self._reduced = False

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: the master shard and its two moments."""
        moments = self.inner.state.get(self.master, {})
        return tensor_bytes(self.master) + sum(tensor_bytes(moments[k]) for k in MOMENTS if k in moments)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (or the model itself)."""
    return model.module if hasattr(model, "module") else model


class ZeroStrategy(HeldState, Strategy):
    """ZeRO-1 from scratch: no DDP; the optimizer reduce-scatters gradients and all-gathers parameters.

    Its state as held: the whole model (every rank keeps it), and for every parameter its moments'
    chunks that fall in this rank's flat range ``[lo, hi)``: a 2-D weight's range may start and end
    mid-row, so it is up to three rectangles (:func:`~ddpkit.parallel.chunks.flat_chunked`)."""

    name = "zero1"

    def build_optimizer(self, model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        self.timer = CommTimer(self.ctx.device if self.ctx else None)
        group = self.ctx.dp_group if self.ctx and self.ctx.is_distributed else None
        self.optimizer = ZeroAdamW(model.parameters(), lr=lr, weight_decay=weight_decay, group=group, timer=self.timer)
        return self.optimizer

    def no_sync(self, model: torch.nn.Module) -> ContextManager:
        return contextlib.nullcontext()  # gradients are only reduced in the optimizer step

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return self.optimizer.clip_grad_norm_(max_norm)

    def comm_timer(self, model: torch.nn.Module) -> CommTimer:
        return self.timer

    @property
    def overflow_group(self):
        return self.ctx.dp_group  # each rank unscales its own, unreduced gradients

    def model_names(self, model) -> list[str]:
        return list(model.state_dict())

    def held_state(self, model, optimizer) -> tuple[dict, dict]:
        model_state = dict(model.state_dict())  # detached views of the live parameters
        if optimizer is None:
            return model_state, {}
        names = _param_names(model)
        return model_state, {"state": optimizer.held_state(names), "param_groups": optimizer.param_groups_by_name(names)}

    def after_load(self, model, optimizer, groups) -> None:
        if optimizer is not None and groups is None:  # weights only: AdamW starts afresh
            optimizer.inner.state.clear()
        elif optimizer is not None:
            for target in (optimizer, optimizer.inner):
                set_hyperparameters(target, groups)
        self.optimizer.refresh_master()

    def optimizer_bytes(self, optimizer) -> int:
        return optimizer.state_bytes()


class TorchZeroStrategy(HeldState, DDPStrategy):
    """PyTorch's ``ZeroRedundancyOptimizer`` (AdamW inside) under DDP: DDP all-reduces the gradients,
    each rank updates the whole parameters assigned to it, then broadcasts them.

    Its state as held: the whole model, and the AdamW state of the parameters this rank updates (its
    local optimizer's, ``optimizer.optim``). ``ZeroRedundancyOptimizer.consolidate_state_dict`` is not
    used: it broadcasts every rank's partition to every rank of the group (its ``to`` is a rank *in the
    group*), where a ``full`` save needs the state on one rank only."""

    name = "zero1-torch"

    def build_optimizer(self, model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        group = self.ctx.dp_group if self.ctx and self.ctx.is_distributed else None
        self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                                 process_group=group, lr=lr, weight_decay=weight_decay)
        return self.optimizer

    def model_names(self, model) -> list[str]:
        return list(_unwrap(model).state_dict())

    def held_state(self, model, optimizer) -> tuple[dict, dict]:
        raw = _unwrap(model)
        model_state = dict(raw.state_dict())
        if optimizer is None:
            return model_state, {}
        name_of = {id(p): name for name, p in raw.named_parameters()}
        local = optimizer.optim.param_groups[0]["params"]  # the parameters this rank updates
        entries = adam_state(optimizer.optim, local)
        state = {name_of[id(p)]: entry for p, entry in zip(local, entries)}
        return model_state, {"state": state, "param_groups": param_groups(optimizer.optim, _param_names(raw))}

    def after_load(self, model, optimizer, groups) -> None:
        if optimizer is None:
            return
        if groups is None:
            optimizer.optim.state.clear()
            return
        for target in (optimizer, optimizer.optim):
            set_hyperparameters(target, groups)

    def optimizer_bytes(self, optimizer) -> int:
        return super().optimizer_bytes(optimizer.optim)  # the local AdamW inside: this rank's parameters only
