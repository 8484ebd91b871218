"""How long one training step takes under a parallel layout: compute, communication and the bubble.

The layout planner (``plan.py``) ranks layouts by this model. Every term is a formula from the
literature with its parameters explicit, so a reader can check each against its source:

* **compute**: training costs 6 FLOPs per weight per token (2 forward, 4 backward) plus attention's
  two products, 12 x layers x sequence x width per token (the PaLM paper's accounting, Chowdhery et
  al. 2022); recomputing activations adds one more forward (8 instead of 6). A device
  sustains ``Cluster.flops`` on it, plus a fixed cost per layer per pass (``layer_overhead_s``:
  kernel launches on a GPU, the framework's dispatch on a CPU).
* **communication**: the alpha-beta model (``comm.py``) per collective, with the ring's shares: an
  all-reduce of M bytes over N ranks takes 2(N-1) hops and moves 2(N-1)/N x M per rank; all-gather,
  reduce-scatter and all-to-all (N-1) hops and (N-1)/N x M; a pipeline send one hop and M. A group
  whose ranks sit on one node runs at the intra-node link (NVLink); a group that spans nodes at the
  inter-node link (InfiniBand), the slowest hop of its ring.
* **tensor parallelism** all-reduces the activation twice per layer forward and twice backward
  (Megatron-LM, Shoeybi et al. 2019), on the critical path unless ``Overlap.tp`` says otherwise.
* **the pipeline** runs m micro-batches through p stages in (m + (p-1)/v) micro-batch times: the
  bubble is (p-1)/m of the ideal time, (p-1)/(v m) with v interleaved virtual stages per rank
  (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", arXiv 2104.04473, Sections 2.2.1-2.2.2), i.e. (p-1)/(m+p-1) of the whole step for v=1.
* **data parallelism** reduces the gradients once per step, hidden behind the last micro-batch's
  backward up to ``Overlap.grad_reduce``; ZeRO-1/2 then all-gather the updated parameters (hidden
  behind the next forward up to ``Overlap.param_gather``); ZeRO-2 reduce-scatters and ZeRO-3 also
  all-gathers the weights twice *per micro-batch* (gradient accumulation repeats them), hidden behind
  that micro-batch's compute up to ``Overlap.sharded`` (Rajbhandari et al. 2020, ZeRO); ZeRO-3 as FSDP
  runs it gathers one layer at a time, so it pays the latency of L + 1 collectives of each kind. HSDP
  (``Layout.shard``) runs ZeRO-3 inside shard groups and all-reduces each unit's gradient shard across
  the groups (``fully_shard`` on a 2-D mesh).
* **context parallelism** passes K/V blocks around a ring each layer (ring attention, Liu et al.
  2023); **expert parallelism** routes tokens with an all-to-all before and after each expert MLP.
* **the optimizer** reads and writes its state once per step: memory-bound.

A node whose ranks share fewer processors than there are ranks (4 CPU ranks on 2 cores: the machine
the notebooks run on) cannot finish a step faster than its ranks' total compute spread over its
cores: the step is the larger of the critical path and that bound. On a GPU node each rank has its own
device and the bound never binds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ddpkit.parallel.comm import BUS_FACTOR, AlphaBeta
from ddpkit.parallel.memory import PRECISIONS

AXES = ("tp", "cp", "dp", "pp")  # default placement, innermost first (as Megatron-LM and torchtitan order their mesh)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. ``kv_heads`` < ``heads`` is grouped-query attention; a gated
    MLP (SwiGLU) has three matrices; ``experts`` > 1 makes every MLP a mixture of experts."""

    layers: int
    d_model: int
    heads: int
    seq_len: int
    vocab: int
    kv_heads: int | None = None
    """Key/value heads (None: as many as ``heads``)."""
    ffn: int | None = None
    """MLP hidden width (None: 4 x d_model)."""
    gated_mlp: bool = False
    experts: int = 1
    top_k: int = 1
    capacity_factor: float = 1.0
    """Expert capacity over an even share of the tokens: the all-to-all carries this much padding."""
    bias: bool = False
    learned_positions: bool = False
    tied_embeddings: bool = False
    flash_attention: bool = True
    """Attention scores are recomputed in backward, not stored (FlashAttention, Dao et al. 2022)."""
    dropout: bool = False
    """Dropout after attention and after the MLP: one byte per element for each mask."""

    @property
    def kv_dim(self) -> int:
        return self.d_model * (self.kv_heads or self.heads) // self.heads

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.d_model

    def attention_params(self) -> int:
        d, kv = self.d_model, self.kv_dim
        return 2 * d * d + 2 * d * kv + (2 * d + 2 * kv if self.bias else 0) + 4 * d  # q, o, k, v; two norms

    def expert_params(self) -> int:
        """One MLP's parameters (one expert's, in a mixture of experts)."""
        d, f = self.d_model, self.ffn_width
        return (3 if self.gated_mlp else 2) * d * f + ((2 if self.gated_mlp else 1) * f + d if self.bias else 0)

    def layer_params(self) -> int:
        return self.attention_params() + self.experts * (self.expert_params() + (self.d_model if self.experts > 1 else 0))

    def embedding_params(self) -> int:
        return self.vocab * self.d_model + (self.seq_len * self.d_model if self.learned_positions else 0)

    def head_params(self) -> int:
        return (0 if self.tied_embeddings else self.vocab * self.d_model) + 2 * self.d_model  # + the final norm

    @property
    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()

    def layer_flops_per_token(self, tp: int = 1) -> float:
        """Forward FLOPs of one layer for one token, on one of ``tp`` ranks: 2 per active weight of the
        matmuls, plus attention's scores and values (2 x 2 x seq x width, PaLM's full-sequence count)."""
        active = self.attention_params() - 4 * self.d_model + self.top_k * self.expert_params()
        return (2 * active + 4 * self.seq_len * self.d_model) / tp

    def flops_per_token(self, recompute: bool = False) -> float:
        """Training FLOPs per token: forward, backward (2 x forward) and, with recompute, one more forward."""
        forward = self.layers * self.layer_flops_per_token() + 2 * self.d_model * self.vocab
        return forward * (4 if recompute else 3)

    @classmethod
    def from_config(cls, cfg) -> "ModelSpec":
        """The kit's TinyGPT as a ``TrainConfig`` describes it (biased linears, learned positions); with
        ``experts`` its MLPs are a mixture of that many experts, ``top_k`` of them per token. The kit's
        all-to-all sends uneven splits, so no padding travels (``capacity_factor`` 1 here); a factor below 1
        drops tokens, and at most that share of them travels."""
        moe = dict(experts=cfg.experts, top_k=cfg.top_k, capacity_factor=min(1.0, cfg.capacity_factor)) if cfg.experts else {}
        return cls(layers=cfg.n_layers, d_model=cfg.d_model, heads=cfg.n_heads, seq_len=cfg.seq_len,
                   vocab=cfg.vocab_size, bias=True, learned_positions=True, **moe)


@dataclass(frozen=True)
class Cluster:
    """The machines: ``nodes`` x ``gpus_per_node`` devices, their memory, compute and links."""

    nodes: int
    gpus_per_node: int
    memory: float
    """Bytes per device."""
    flops: float
    """FLOP/s one device sustains on the model's matmuls (its peak x the share it reaches)."""
    intra: AlphaBeta
    """Per-hop latency and bandwidth between two devices of one node."""
    inter: AlphaBeta
    """Per-hop latency and bandwidth between devices of different nodes (one device's share of the NICs)."""
    memory_bandwidth: float
    """Bytes/s the optimizer step streams its state at."""
    layer_overhead_s: float = 0.0
    """Fixed seconds per layer per forward-equivalent pass (backward counts as two)."""
    cores_per_node: int | None = None
    """Processors the ranks of a node share (None: one per rank, as GPUs)."""
    usable_memory: float = 0.9
    """Share of ``memory`` a layout may plan to fill (the allocator, workspaces and fragmentation take the rest)."""
    intra_by_op: dict = field(default_factory=dict, hash=False, compare=False)
    """Per-collective intra-node links where one link does not describe them all (gloo's differ)."""
    name: str = ""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Layout:
    """One way to run: the parallel degrees, ZeRO stage, recompute, micro-batching and placement.
    world = dp x tp x pp x cp; experts are split over ``ep`` ranks inside dp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    checkpointing: bool = False
    micro_batch: int = 1
    """Sequences per micro-batch on one data-parallel rank."""
    micro_batches: int = 1
    """m: micro-batches per step (the pipeline's, or gradient accumulation's)."""
    virtual_stages: int = 1
    """v: model chunks per pipeline rank (interleaved 1F1B)."""
    order: tuple[str, ...] = AXES
    """Mesh axes innermost first: consecutive ranks differ along the first, which so stays inside a node."""
    shard: int = 0
    """ZeRO-3's shard group: 0 shards over every rank that holds the same weights (dp x cp); fewer is
    HSDP, sharded within groups of ``shard`` ranks and replicated across the others."""

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.micro_batches

    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def describe(self) -> str:
        parts = [f"{a} {n}" for a, n in (("tp", self.tp), ("cp", self.cp), ("ep", self.ep), ("pp", self.pp)) if n > 1]
        parts.append(f"dp {self.dp}")
        extra = [f"ZeRO-{self.zero}" if self.zero else "no ZeRO", f"HSDP shard {self.shard}" if self.shard else "", "recompute" if self.checkpointing else "",
                 f"b {self.micro_batch} x m {self.micro_batches}", f"v {self.virtual_stages}" if self.virtual_stages > 1 else ""]
        return " x ".join(parts) + ", " + ", ".join(e for e in extra if e)


@dataclass(frozen=True)
class Overlap:
    """Share of each communication the software hides behind compute (at most what that compute lasts)."""

    grad_reduce: float = 0.9
    """The per-step gradient reduction behind the last backward (DDP's buckets; Megatron --overlap-grad-reduce)."""
    param_gather: float = 0.9
    """ZeRO-1/2's gather of the updated weights behind the next forward (Megatron --overlap-param-gather)."""
    sharded: float = 0.9
    """ZeRO-2/3's per-micro-batch collectives behind that micro-batch (FSDP's prefetch)."""
    tp: float = 0.0
    """Tensor-parallel all-reduces: each waits for the matmul before it and the next waits for it."""
    cp: float = 0.9
    """Ring attention's K/V passing behind the block computation."""
    ep: float = 0.0
    """The experts' all-to-alls: the experts cannot start before their tokens arrive."""


NOTHING_HIDDEN = Overlap(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def collective_seconds(op: str, nbytes: float, n: int, link: AlphaBeta) -> float:
    """One collective over ``n`` ranks on ``link``: hops x alpha + share x M / bandwidth."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if op == "p2p":
        return link.alpha_s + nbytes / link.bandwidth
    hops = 2 * (n - 1) if op == "all_reduce" else n - 1
    share = BUS_FACTOR[op](n) if op in BUS_FACTOR else (n - 1) / n  # all_to_all: (N-1)/N leaves each rank
    return hops * link.alpha_s + share * nbytes / link.bandwidth


@functools.lru_cache(maxsize=4096)
def _spans(stride: int, size: int, world: int, per_node: int) -> bool:
    for base in range(world):
        if (base // stride) % size:
            continue  # not the first member of its group
        if len({(base + k * stride) // per_node for k in range(size)}) > 1:
            return True
    return False


def group_spans_nodes(layout: Layout, axis: str, per_node: int) -> bool:
    """Whether the ranks of one ``axis`` group (``ep``: a run of the dp axis) sit on more than one node."""
    sizes = layout.sizes()
    name = "dp" if axis == "ep" else axis
    size = layout.ep if axis == "ep" else sizes[axis]
    if size == 1:
        return False
    stride = math.prod(sizes[a] for a in layout.order[: layout.order.index(name)])
    return _spans(stride, size, layout.world, per_node)


def link(cluster: Cluster, layout: Layout, axis: str, op: str = "all_reduce") -> AlphaBeta:
    if group_spans_nodes(layout, axis, cluster.gpus_per_node):
        return cluster.inter
    return cluster.intra_by_op.get(op, cluster.intra)


def _exposed(comm: float, window: float, share: float) -> float:
    """What of ``comm`` stays on the critical path when up to ``share`` of it hides behind ``window``."""
    return comm - min(share * comm, window)


def optimizer_traffic(precision: str) -> int:
    """Bytes AdamW streams per parameter: reads the gradient, reads and writes the weights it updates and
    both moments, and writes the low-precision copy when it keeps a separate master."""
    p = PRECISIONS[precision]
    updated = p.master or p.weights
    return p.grads + 2 * updated + 2 * p.moments + (p.weights if p.master else 0)


def stage_params(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """Parameters one device holds before ZeRO shards them: (dense, experts), for the fullest stage."""
    per_stage = math.ceil(model.layers / layout.pp)
    ends = model.embedding_params() + model.head_params() if layout.pp == 1 else max(model.embedding_params(), model.head_params())
    expert = model.expert_params() * model.experts if model.experts > 1 else 0
    dense = per_stage * (model.layer_params() - expert) + ends
    return dense / layout.tp, per_stage * expert / (layout.tp * layout.ep)


TP_ALL_REDUCES_PER_LAYER = 4  # Megatron's f and g around attention and the MLP: 2 in forward, 2 in backward
# (the count ddpkit.parallel.tensor's layers make on real ranks: tests/test_tensor.py, notebook 16)


def step_time(model: ModelSpec, cluster: Cluster, layout: Layout, precision: str = "bf16-mixed",
              overlap: Overlap = Overlap()) -> dict[str, float]:
    """Seconds of one optimizer step by term, for the slowest pipeline stage (the most layers, and the
    head); the terms add up to ``total``. ``efficiency`` is the time a perfectly parallel run would take
    at the sustained rate over ``total``."""
    p, act = PRECISIONS[precision], PRECISIONS[precision].weights  # activations travel in the weights' dtype
    L = math.ceil(model.layers / layout.pp)
    tp, cp, v, m = layout.tp, layout.cp, layout.virtual_stages, layout.micro_batches
    tokens = layout.micro_batch * model.seq_len / cp  # per device per micro-batch
    passes = 4 if layout.checkpointing else 3  # forward, backward (two forwards' work), recompute
    forward = tokens * (L * model.layer_flops_per_token(tp) + 2 * model.d_model * model.vocab / tp)
    compute = forward * passes / cluster.flops + L * passes * cluster.layer_overhead_s
    attention = tokens * L * 4 * model.seq_len * model.d_model / tp * passes / cluster.flops
    activation = tokens * model.d_model * act
    calls = L * (TP_ALL_REDUCES_PER_LAYER + (2 if layout.checkpointing else 0))  # and 2 more to recompute
    tp_comm = calls * collective_seconds("all_reduce", activation, tp, link(cluster, layout, "tp"))
    cp_comm = L * (cp - 1) * passes * collective_seconds("p2p", 2 * tokens * model.kv_dim / tp * act, 2, link(cluster, layout, "cp", "p2p"))
    ep_comm = 0.0
    if model.experts > 1:
        routed = tokens * model.top_k * model.capacity_factor * model.d_model * act
        ep_comm = calls * collective_seconds("all_to_all", routed, layout.ep, link(cluster, layout, "ep", "all_to_all"))
    pp_comm = 2 * v * collective_seconds("p2p", activation, 2, link(cluster, layout, "pp", "p2p")) if layout.pp > 1 else 0.0
    dense, experts = stage_params(model, layout)
    n = layout.dp * cp  # ranks that hold the same dense weights; each expert is on n / ep of them
    groups = ((dense, n), (experts, max(1, n // layout.ep)))
    s = (layout.shard or n) if layout.zero == 3 else n  # ranks one shard group spans (HSDP: fewer than n)
    shard_groups = ((dense, s), (experts, max(1, s // layout.ep)))

    def dp_collective(op: str, bytes_per_param: float, over=groups) -> float:
        return sum(collective_seconds(op, count * bytes_per_param, ranks, link(cluster, layout, "dp", op)) for count, ranks in over)

    ag, rs = dp_collective("all_gather", p.weights), dp_collective("reduce_scatter", p.grads)
    sharded = {2: rs}.get(layout.zero, 0.0)
    if layout.zero == 3:  # FSDP gathers one layer at a time: L + 1 collectives of each kind, each paying its latency
        units = L + 1
        sharded = units * (2 * dp_collective("all_gather", p.weights / units, shard_groups)
                           + dp_collective("reduce_scatter", p.grads / units, shard_groups))
        if s < n:  # HSDP: each unit's gradient shard is all-reduced across the n / s replicas of its group
            sharded += units * sum(collective_seconds("all_reduce", count / ranks / units * p.grads, n // s,
                                                      link(cluster, layout, "dp")) for count, ranks in shard_groups)
    per_micro = {
        "tp": _exposed(tp_comm, compute, overlap.tp), "cp": _exposed(cp_comm, attention, overlap.cp),
        "ep": _exposed(ep_comm, compute, overlap.ep), "pp_p2p": pp_comm,
        "zero_sharded": _exposed(sharded, compute, overlap.sharded),
    }
    micro = compute + sum(per_micro.values())
    reduce = {0: dp_collective("all_reduce", p.grads), 1: rs}.get(layout.zero, 0.0)
    gather = ag if layout.zero in (1, 2) else 0.0
    backward_window, forward_window = compute * (passes - 1) / passes, compute / passes
    optimizer_params = sum(count / (ranks if layout.zero else 1) for count, ranks in shard_groups)
    terms = {"compute": m * compute, **{k: m * t for k, t in per_micro.items()},
             "bubble": (layout.pp - 1) / v * micro,
             "dp_sync": _exposed(reduce, backward_window, overlap.grad_reduce) + _exposed(gather, forward_window, overlap.param_gather),
             "optimizer": optimizer_params * optimizer_traffic(precision) / cluster.memory_bandwidth}
    critical = sum(terms.values())
    ranks_per_node = min(cluster.gpus_per_node, layout.world)
    cores = cluster.cores_per_node or ranks_per_node
    busy = terms["compute"] + terms["optimizer"]
    terms["shared_cores"] = max(0.0, busy * ranks_per_node / cores + (critical - busy - terms["bubble"]) - critical)
    terms["total"] = critical + terms["shared_cores"]
    ideal = layout.global_batch * model.seq_len * model.flops_per_token() / (layout.world * cluster.flops)
    terms["efficiency"] = ideal / terms["total"]
    return terms
