"""``--experts E --ep N``: the GPT's MLPs as mixtures of experts, the experts split over ep ranks.

Every rank is a data-parallel rank: it takes its own samples, so the global batch is micro x accum x
world, as under DDP. The ranks form a 2-D mesh ``(edp, ep)``, ep innermost (neighbours, as for tensor
parallelism): an **ep group** holds the E experts between them, E/ep each, and routes its tokens to
them with ``all_to_all_single`` (:class:`~ddpkit.parallel.expert_parallel.ExpertParallelMoE`, the
layer notebook 18 checks against the single-process :class:`~ddpkit.parallel.experts.MoE`); an **edp
group** is the world / ep ranks that hold the same experts.

**Which gradients are averaged over whom.** Each rank's loss is the mean over its own tokens and the
step's gradient must be the mean over all world ranks' losses (what DDP gives the dense model):

* a parameter every rank holds (attention, norms, embeddings, the router) gets from backward the
  gradient of this rank's loss alone: summed over the **world** and divided by the world size, as DDP;
* an expert's gradient already sums the losses of every rank of its ep group (their tokens reached it
  through the all-to-all, and came back through its backward): summed over the ranks that hold the
  same expert, the **edp group**, it covers every rank's loss once, and is divided by the world size.

Megatron-Core does the same (``DistributedDataParallel``: ``expert_gradient_scaling_factor`` is
1 / the data-parallel size, the sum taken over the expert-data-parallel group), and torchtitan shards
the experts with FSDP over the data-parallel ranks with the ep slice factored out (its
``dp_shard_mod_ep`` mesh dimension). Averaging the experts'
gradients over the edp group instead (dividing by its size) would make them ep times too large;
reducing them over the whole world would mix different experts' gradients (the tests' negative control).
With ep = 1 this is DDP of the MoE GPT over the world: every expert on every rank.

The gradients are reduced by hand after the step's last micro-batch, one flat buffer per group, so
every collective names its group. Clipping needs the norm of the whole gradient: the experts' part
is summed over the ep group (each rank holds other experts), the replicated part taken once.

**The load-balancing loss** is added to the gradient by each MoE layer (``AddAuxiliaryLoss``), outside
the loss the trainer scales; its coefficient is set per micro-batch to ``AUX_COEF x loss_scale /
accum``, the scaling the language-model loss gets (``step.py``), so that gradient accumulation and the
zero-loss warm-up pass treat both alike (fp16's GradScaler would not: ``--amp fp16`` is refused).

**State** is the model's without expert parallelism: :meth:`state_dicts` gathers every expert (weights
and Adam moments) over the ep group into whole (E, ...) tensors, and :meth:`load_state_dicts` keeps
this rank's slice. A ``full`` checkpoint therefore resumes under any ep that divides E, ep = 1
included. For ``dcp`` nothing is gathered (:meth:`held_state`): each expert tensor is described as
the rows [first, first + E/ep) of its whole (E, ...) tensor (a :class:`~ddpkit.parallel.chunks.Chunked`),
the rest whole; every rank writes its rows (the edp ranks that hold the same rows, once), and a load
fills this rank's rows in place from whatever layout wrote them, ep = 1 included.

The summary reports, per MoE layer, the tokens each expert took (kept assignments) and the assignments
dropped at capacity, summed over the ranks and the steps of this run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.metrics import CommTimer
from ddpkit.parallel.base import _param_names
from ddpkit.parallel.chunks import Chunked, adam_state
from ddpkit.parallel.ddp import DDPStrategy
from ddpkit.parallel.expert_parallel import ExpertParallelMoE
from ddpkit.parallel.experts import MoE
from ddpkit.parallel.held_state import MOMENTS, HeldState, param_groups

AUX_COEF = 1e-2  # the Switch Transformer's load-balancing coefficient (Fedus et al. 2021, arXiv 2101.03961)
EXPERT_KEY = ".experts."  # parameter names of the experts' stacked weights: blocks.{i}.mlp.experts.{w1,b1,w2,b2}


def is_expert(name: str) -> bool:
    return EXPERT_KEY in name


def moe_layers(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, (MoE, ExpertParallelMoE))]


class ExpertParallelStrategy(HeldState, DDPStrategy):
    """The MoE GPT over the world, its experts split over ep ranks (see the module docstring)."""

    name = "ddp"

    def __init__(self, ctx, cfg) -> None:
        super().__init__(ctx)
        self.ep, self.num_experts = cfg.ep, cfg.experts
        self.mesh = None
        if ctx is not None and self.ep > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(ctx.device.type, (ctx.world_size // self.ep, self.ep), mesh_dim_names=("edp", "ep"))
        self.totals: list[dict] | None = None
        self.timer = CommTimer(ctx.device if ctx else None)

    @property
    def ep_group(self):
        """The ranks that split the experts between them and exchange tokens."""
        return self.mesh.get_group("ep")

    @property
    def expert_grad_group(self):
        """The ranks whose expert gradients are summed: those holding the same experts."""
        return self.mesh.get_group("edp")

    # ------------------------------------------------------------------ model

    def build_optimizer(self, model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        self.optimizer = super().build_optimizer(model, lr, weight_decay)
        return self.optimizer

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """ep = 1: DDP over the world. ep > 1: each MoE becomes its expert-parallel form (this rank's
        experts sliced from the whole ones, identical on every rank from the seed); no DDP wrapper."""
        if self.ep == 1:
            return super().wrap(model)
        for block in model.blocks:
            block.mlp = ExpertParallelMoE(block.mlp, self.ep_group)
        return model

    def _scaled(self, run_micro_batch, count: bool):
        """``run_micro_batch`` with the auxiliary loss scaled like the loss; ``count`` adds the routing stats."""
        def run(batch: dict, loss_scale: float = 1.0) -> None:
            layers = moe_layers(self.model_of(run_micro_batch))
            for layer in layers:
                layer.aux_coef = AUX_COEF * loss_scale / run_micro_batch.accum
            run_micro_batch(batch, loss_scale)
            if count:
                self._count(layers)
        run.sums = run_micro_batch.sums
        return run

    @staticmethod
    def model_of(run_micro_batch) -> torch.nn.Module:
        model = run_micro_batch.model
        return model.module if hasattr(model, "module") else model

    def _count(self, layers: list) -> None:
        if self.totals is None:
            self.totals = [{"kept": [0] * self.num_experts, "routed": 0, "dropped": 0} for _ in layers]
        for total, layer in zip(self.totals, layers):
            total["kept"] = [a + b for a, b in zip(total["kept"], layer.stats["kept"])]
            total["routed"] += sum(layer.stats["routed"])
            total["dropped"] += layer.stats["dropped"]

    def prepare(self, model, run_micro_batch, example: dict) -> None:
        super().prepare(model, self._scaled(run_micro_batch, count=False), example)

    def forward_backward(self, model, micro_batches: list[dict], run_micro_batch) -> None:
        super().forward_backward(model, micro_batches, self._scaled(run_micro_batch, count=True))
        if self.ep > 1:
            self.reduce_gradients(model)

    # ------------------------------------------------------------------ gradients

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Replicated parameters: sum over the world; experts: sum over the edp group; both / world size.
        A gradient missing on this rank (no token reached its experts) counts as zeros, as under DDP."""
        world = self.ctx.world_size
        for expert, group in ((False, self.ctx.world_group), (True, self.expert_grad_group)):
            params = [p for n, p in model.named_parameters() if is_expert(n) == expert and p.requires_grad]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params]).div_(world)
            with self.timer.timed(flat.numel() * flat.element_size()):
                dist.all_reduce(flat, group=group)
            for p, part in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(part.view_as(p))

    def comm_timer(self, model: torch.nn.Module) -> CommTimer:
        """ep = 1: DDP's hook. ep > 1: the two gradient all-reduces (the all-to-alls run inside forward and
        backward, in the compute phases)."""
        return super().comm_timer(model) if self.ep == 1 else self.timer

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """The norm of the whole gradient: the replicated part once, the experts' summed over the ep group;
        then the scaling ``torch.nn.utils.clip_grad_norm_`` applies (max_norm / (norm + 1e-6), at most 1)."""
        if self.ep == 1:
            return super().clip_grad_norm_(model, max_norm)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        squares = torch.zeros(2, dtype=torch.float64)
        for n, g in grads.items():
            squares[int(is_expert(n))] += float(torch.linalg.vector_norm(g.float())) ** 2
        experts = squares[1:].clone()
        dist.all_reduce(experts, group=self.ep_group)
        norm = torch.tensor(float((squares[0] + experts[0]).sqrt()))
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads.values():
            g.mul_(scale.to(g.dtype))
        return norm

    # ------------------------------------------------------------------ state

    def _first(self) -> int:
        return dist.get_rank(self.ep_group) * (self.num_experts // self.ep)

    def state_dicts(self, model, optimizer, rank0_only: bool = True) -> tuple[dict, dict]:
        """Whole model and optimizer state: every expert gathered over the ep group (collective)."""
        if self.ep == 1:
            return DDPStrategy.state_dicts(self, model, optimizer, rank0_only)
        model_state, optimizer_state = DDPStrategy.state_dicts(self, model, optimizer, rank0_only=False)
        local = {n: p.shape for n, p in model.named_parameters() if is_expert(n)}
        for name in sorted(local):
            model_state[name] = self._gather(model_state[name])
            for key, value in sorted(optimizer_state["state"].get(name, {}).items()):
                if torch.is_tensor(value) and value.shape == local[name]:  # exp_avg, exp_avg_sq (not step)
                    optimizer_state["state"][name][key] = self._gather(value)
        if rank0_only and not self.ctx.is_main:
            return {}, {}
        return model_state, optimizer_state

    def _described(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """An expert tensor as rows of its whole (E, ...) tensor; any other tensor as it is."""
        if not is_expert(name):
            return tensor
        whole = (self.num_experts, *tensor.shape[1:])
        return Chunked(whole, [((self._first(),) + (0,) * (tensor.dim() - 1), tensor)], tensor.dtype, tensor.device)

    def model_names(self, model) -> list[str]:
        return list(model.state_dict())

    def held_state(self, model, optimizer) -> tuple[dict, dict]:
        """What this rank holds, keyed by the model's names, each expert tensor as its rows of the whole."""
        model_state = {n: self._described(n, t) for n, t in model.state_dict().items()}
        if optimizer is None:
            return model_state, {}
        names = _param_names(model)
        entries = adam_state(optimizer, [p for p in model.parameters() if p.requires_grad])
        state = {name: {k: (self._described(name, v) if k in MOMENTS else v) for k, v in entry.items()}
                 for name, entry in zip(names, entries)}  # each moment has its parameter's rows
        return model_state, {"state": state, "param_groups": param_groups(optimizer, names)}

    def sharded_state_dicts(self, model, optimizer) -> tuple[dict, dict]:
        if self.ep == 1:
            return DDPStrategy.sharded_state_dicts(self, model, optimizer)
        return self.held_state(model, optimizer)

    def load_sharded_state_dicts(self, model, optimizer, model_state, optimizer_state) -> None:
        if self.ep == 1:
            return DDPStrategy.load_sharded_state_dicts(self, model, optimizer, model_state, optimizer_state)
        return HeldState.load_sharded_state_dicts(self, model, optimizer, model_state, optimizer_state)

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.ep)]
        dist.all_gather(parts, tensor.contiguous(), group=self.ep_group)
        return torch.cat(parts)

    def load_state_dicts(self, model, optimizer, model_state: dict, optimizer_state: dict | None) -> None:
        """Whole state (saved under any ep) in: this rank's slice of every expert tensor."""
        if self.ep > 1:
            first, local = self._first(), self.num_experts // self.ep
            cut = {n: p.shape[0] for n, p in model.named_parameters() if is_expert(n)}

            def mine(name, value):
                if name in cut and torch.is_tensor(value) and value.dim() and value.shape[0] == self.num_experts:
                    return value[first:first + local]
                return value
            model_state = {n: mine(n, v) for n, v in model_state.items()}
            if optimizer_state is not None:
                optimizer_state = {**optimizer_state, "state": {n: {k: mine(n, v) for k, v in entry.items()}
                                                                for n, entry in optimizer_state["state"].items()}}
        DDPStrategy.load_state_dicts(self, model, optimizer, model_state, optimizer_state)

    # ------------------------------------------------------------------ what the summary shows

    def expert_stats(self) -> list[dict]:
        """Per MoE layer, over the world and this run's steps: tokens per expert, assignments, drops (collective)."""
        totals = self.totals or []
        flat = torch.tensor([v for t in totals for v in (*t["kept"], t["routed"], t["dropped"])], dtype=torch.int64)
        if self.ctx is not None and self.ctx.is_distributed and flat.numel():
            dist.all_reduce(flat, group=self.ctx.world_group)
        rows, width = [], self.num_experts + 2
        for i in range(len(totals)):
            part = flat[i * width:(i + 1) * width].tolist()
            rows.append({"tokens_per_expert": part[:-2], "assignments": part[-2], "dropped": part[-1]})
        return rows
