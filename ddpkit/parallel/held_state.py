"""State in and out for the strategies that split state themselves (ZeRO-1, tensor and pipeline parallel).

Each such strategy says one thing, :meth:`HeldState.held_state`: this rank's model and optimizer state,
keyed by the unsplit model's parameter names, every tensor either whole (replicated here) or a
:class:`~ddpkit.parallel.chunks.Chunked` naming the chunks this rank holds; every tensor is the live
one (a view, never a copy), and AdamW's state is created first if no step has run yet. Everything else
follows from it, and nothing is gathered to every rank:

* a ``dcp`` save writes those tensors (each rank its own chunks; a chunk several ranks hold, once);
* a ``dcp`` load fills them in place, whatever layout wrote the checkpoint; :meth:`after_load` then
  sets what is not a tensor (learning rate and the other hyper-parameters) and anything derived;
* a ``full`` save gathers whole tensors to rank 0 only (:func:`~ddpkit.parallel.chunks.gather_to_main`);
* a ``full`` load copies each rank's chunks out of the whole tensors it was given.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.parallel.chunks import fill_from_full, flatten, gather_to_main, set_hyperparameters, unflatten

MOMENTS = ("exp_avg", "exp_avg_sq")


def param_groups(optimizer: torch.optim.Optimizer, names: list[str]) -> list[dict]:
    """The optimizer's one group with the unsplit model's parameter names: what every strategy saves."""
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k not in ("params", "initial_lr")}
    return [{**hyper, "params": list(names)}]


class HeldState:
    """Mixin for a :class:`~ddpkit.parallel.base.Strategy` (see the module docstring)."""

    def held_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
        """(model state, optimizer state) as this rank holds it; ``optimizer`` None: model only."""
        raise NotImplementedError

    def model_names(self, model: torch.nn.Module) -> list[str]:
        """The unsplit model's state names, in order."""
        raise NotImplementedError

    def after_load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                   groups: list[dict] | None) -> None:
        """Finish a load whose tensors are in place: the saved hyper-parameters (``groups``, None for a
        weights-only load, which starts the optimizer afresh)."""
        if optimizer is None:
            return
        if groups is None:
            optimizer.state.clear()
        else:
            set_hyperparameters(optimizer, groups)

    # ---------------------------------------------------------------- the Strategy interface

    def sharded_state_dicts(self, model, optimizer) -> tuple[dict, dict]:
        return self.held_state(model, optimizer)

    def load_sharded_state_dicts(self, model, optimizer, model_state, optimizer_state) -> None:
        """A dcp load has filled the live tensors already: only what is not a tensor is left."""
        self.after_load(model, self.optimizer, None if optimizer is None else optimizer_state["param_groups"])

    def state_dicts(self, model, optimizer, rank0_only: bool = True) -> tuple[dict, dict]:
        """Whole model and optimizer state dicts on rank 0 (others: empty dicts), gathered chunk by chunk;
        ``rank0_only=False`` then broadcasts them (every rank holds everything: for a summary, not a save)."""
        model_state, optimizer_state = self.held_state(model, optimizer)
        whole = unflatten(gather_to_main(self.ctx, flatten({"model": model_state, "optimizer": optimizer_state["state"]})))
        out = [({}, {})]
        if self.ctx.is_main:
            names = self.model_names(model)
            state = whole.get("optimizer", {})
            out = [({name: whole["model"][name] for name in names},
                    {"state": {name: state[name] for name in names if name in state},
                     "param_groups": optimizer_state["param_groups"]})]
        if not rank0_only and self.ctx.is_distributed:
            dist.broadcast_object_list(out, src=0, group=self.ctx.world_group)
        return out[0]

    def load_state_dicts(self, model, optimizer, model_state: dict, optimizer_state: dict | None) -> None:
        """Whole state dicts in (from any strategy's ``full`` checkpoint): each rank copies its chunks."""
        with_optimizer = optimizer is not None and optimizer_state is not None
        held_model, held_optimizer = self.held_state(model, optimizer if with_optimizer else None)
        fill_from_full(held_model, model_state)
        if with_optimizer:
            fill_from_full(held_optimizer["state"], optimizer_state["state"])
        self.after_load(model, optimizer, optimizer_state["param_groups"] if with_optimizer else None)
