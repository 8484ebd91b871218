"""The layout planner: every way to run a model on a cluster, what does not fit and why, the rest ranked.

Given a model (:class:`~ddpkit.parallel.step_time.ModelSpec`), a precision and a cluster, :func:`plan`
enumerates data, tensor, pipeline, context and expert parallel degrees (world = dp x tp x pp x cp,
experts split over ep ranks inside dp), the ZeRO stage, activation recomputation, the micro-batch size
(so m = global batch / (dp x b) micro-batches), interleaved virtual stages and the placement of the
mesh axes on the nodes. It rejects what cannot run, with the reason: a degree that does not divide the
model, or a device whose memory the layout overfills, named component by component (parameters,
gradients and optimizer state from ``memory.py``'s accounting; activations from Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198, Section 4).
It ranks the rest by the step-time model of ``step_time.py``.

Rules of thumb the ranking should rediscover rather than assume (Narayanan et al. 2021, arXiv
2104.04473, Section 3): tensor parallelism up to the GPUs of one node, pipeline parallelism across
nodes when the model still does not fit, data parallelism for the rest. ``rules=("tp-in-node",)``
enforces the first as a hard rule instead, the way seed 003 states it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from ddpkit.parallel import memory
from ddpkit.parallel.comm import AlphaBeta
from ddpkit.parallel.step_time import (AXES, Cluster, Layout, ModelSpec, Overlap, group_spans_nodes,
                                       stage_params, step_time)

GB = memory.GB
ZERO_STRATEGIES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}  # ZeRO stage -> memory.py's name for it
RULES = ("tp-in-node",)


def activation_bytes_per_layer(model: ModelSpec, layout: Layout, act: int = 2) -> float:
    """Bytes one layer keeps for backward for one micro-batch on one device (no recompute).

    Korthikanti et al.'s count, per token, in elements of ``act`` bytes: the inputs of the two norms,
    of the attention block and of the MLP (4 x width, not split by tensor parallelism); Q, K, V and the
    attention output (split), the MLP's hidden activations (2 x ffn, 4 x ffn gated: split); one byte per
    element for each dropout mask; and, without FlashAttention, the softmax over heads x seq scores.
    With width h and ffn 4h at 2 bytes this is the paper's sbh(10 + 24/t) plus 5as^2b/t for the scores.
    """
    tokens = layout.micro_batch * model.seq_len / layout.cp
    d, f = model.d_model, model.ffn_width * (model.top_k if model.experts > 1 else 1)
    split = 2 * d + 2 * model.kv_dim + (4 if model.gated_mlp else 2) * f
    per_token = act * (4 * d + split / layout.tp) + (2 * d if model.dropout else 0)
    scores = 0.0
    if not model.flash_attention:  # softmax output (+ dropout mask and output) per score
        scores = model.heads / layout.tp * tokens * model.seq_len * (act + (1 + act if model.dropout else 0))
    return tokens * per_token + scores


def activation_memory(model: ModelSpec, layout: Layout, act: int = 2) -> float:
    """Activation bytes on the fullest pipeline stage. 1F1B keeps min(m, p) micro-batches in flight on
    the first stage, (1 + (p-1)/(p v)) times that when interleaved (Korthikanti et al., Section 4);
    recompute keeps each layer's input (2sbh) and one layer's full set while it is recomputed; the last
    stage also holds the fp32 logits."""
    L, p = math.ceil(model.layers / layout.pp), layout.pp
    in_flight = 1 if p == 1 else min(layout.micro_batches, p) * (1 + (p - 1) / (p * layout.virtual_stages) if layout.virtual_stages > 1 else 1)
    full = activation_bytes_per_layer(model, layout, act)
    tokens = layout.micro_batch * model.seq_len / layout.cp
    per_layer = tokens * model.d_model * act if layout.checkpointing else full
    first = in_flight * L * per_layer + (full if layout.checkpointing else 0)
    logits = tokens * model.vocab / layout.tp * 4
    last = L * per_layer + (full if layout.checkpointing else 0) + logits
    return max(first, last)


def memory_per_gpu(model: ModelSpec, layout: Layout, precision: str = "bf16-mixed") -> dict[str, float]:
    """Bytes one device holds, by component: ``params``, ``grads``, ``optimizer`` (``memory.bytes_per_rank``
    for the ZeRO stage over the dp x cp ranks that hold the same weights, or HSDP's shard group), ``activations``, ``buffers``
    (ZeRO-3 keeps two layers gathered: the one running and the one prefetched) and ``total``."""
    dense, experts = stage_params(model, layout)
    strategy, n = ZERO_STRATEGIES[layout.zero], layout.dp * layout.cp
    if layout.zero == 3 and layout.shard:  # HSDP: sharded within its shard groups only
        n = layout.shard
    out = dict.fromkeys(("params", "grads", "optimizer"), 0.0)
    for count, ranks in ((dense, n), (experts, max(1, n // layout.ep))):
        if count:
            shares = memory.bytes_per_rank(int(count), strategy, ranks, precision)
            for k in out:
                out[k] += shares[k]
    act = memory.PRECISIONS[precision].weights
    out["activations"] = activation_memory(model, layout, act)
    out["buffers"] = 2 * model.layer_params() / layout.tp * act if layout.zero == 3 else 0.0
    out["total"] = sum(out.values())
    return out


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: dict
    time: dict

    @property
    def step_s(self) -> float:
        return self.time["total"]


@dataclass(frozen=True)
class Rejected:
    layout: Layout
    reason: str


@dataclass
class Plan:
    """Layouts that fit, fastest first, and those rejected with their reasons."""

    fits: list[Candidate] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        if not self.fits:
            raise ValueError("no layout fits: " + "; ".join(sorted({r.reason.split(':')[0] for r in self.rejected})))
        return self.fits[0]

    def find(self, **want) -> list[Candidate]:
        """Fitting candidates whose layout has every given field value, fastest first."""
        return [c for c in self.fits if all(getattr(c.layout, k) == v for k, v in want.items())]

    def rank_of(self, **want) -> int | None:
        """1-based rank of the fastest candidate matching ``want`` (None: none fits)."""
        for i, c in enumerate(self.fits, 1):
            if all(getattr(c.layout, k) == v for k, v in want.items()):
                return i
        return None

    def why_not(self, **want) -> list[str]:
        """The distinct reasons why layouts with the given field values were rejected."""
        return list(dict.fromkeys(r.reason for r in self.rejected if all(getattr(r.layout, k) == v for k, v in want.items())))


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(max(1, limit))) + 1)]


def shape_problem(model: ModelSpec, layout: Layout, global_batch: int) -> str | None:
    """Why ``layout`` cannot run ``model`` at all (None: it can)."""
    if model.heads % layout.tp or (model.kv_heads or model.heads) % layout.tp or model.ffn_width % layout.tp:
        return f"tp {layout.tp} does not divide the heads ({model.heads}, {model.kv_heads or model.heads} for K/V) and the MLP"
    if model.layers % (layout.pp * layout.virtual_stages):
        return f"{model.layers} layers do not split into pp {layout.pp} x v {layout.virtual_stages} equal stages"
    if model.seq_len % (2 * layout.cp) and layout.cp > 1:
        return f"cp {layout.cp} needs the sequence ({model.seq_len}) in 2 x cp chunks (zig-zag load balancing)"
    if layout.ep > 1 and (model.experts % layout.ep or layout.dp % layout.ep):
        return f"ep {layout.ep} must divide the experts ({model.experts}) and dp ({layout.dp})"
    if global_batch % (layout.dp * layout.micro_batch):
        return f"global batch {global_batch} is not dp {layout.dp} x micro-batch {layout.micro_batch} x a whole m"
    if layout.virtual_stages > 1 and (layout.pp == 1 or layout.micro_batches % layout.pp):
        return "interleaving needs pp > 1 and m a multiple of pp"
    return None


def layouts(model: ModelSpec, world: int, global_batch: int, *, tp=None, pp=None, cp=None, ep=None,
            zero=(0, 1, 2, 3), checkpointing=(False, True), micro_batch=None, virtual=(1, 2),
            placements: bool = True):
    """Every layout of ``world`` devices: tp, pp, ep and the micro-batch size powers of two unless given as
    lists; cp only 1 unless asked (``cp=[1, 2, 4, 8]``: context parallelism pays for long sequences, and
    each extra degree multiplies the enumeration); ``placements`` tries every order of the mesh axes."""
    tps, pps = tp or _powers_of_two(min(world, model.heads)), pp or _powers_of_two(min(world, model.layers))
    cps, eps = cp or [1], ep or ([1] if model.experts == 1 else _powers_of_two(min(world, model.experts)))
    for t, p, c in itertools.product(tps, pps, cps):
        if world % (t * p * c):
            continue
        dp = world // (t * p * c)
        for e, z, ac, b, v in itertools.product(eps, zero, checkpointing, micro_batch or _powers_of_two(min(16, global_batch // dp)), virtual):
            if (z and dp * c == 1) or (v > 1 and p == 1) or b * dp > global_batch:
                continue  # ZeRO has nothing to shard; nothing to interleave; not even one micro-batch
            m = max(1, global_batch // (dp * b))
            base = Layout(dp=dp, tp=t, pp=p, cp=c, ep=e, zero=z, checkpointing=ac, micro_batch=b, micro_batches=m, virtual_stages=v)
            active = [a for a in AXES if base.sizes()[a] > 1]
            orders = itertools.permutations(active) if placements else [tuple(active)]
            for order in orders:
                yield Layout(**{**base.__dict__, "order": tuple(order) + tuple(a for a in AXES if a not in order)})


def plan(model: ModelSpec, cluster: Cluster, global_batch: int, precision: str = "bf16-mixed",
         overlap: Overlap = Overlap(), rules: tuple[str, ...] = (), world: int | None = None, **space) -> Plan:
    """Enumerate, reject with reasons, rank the rest by step time. ``space`` narrows the enumeration
    (see :func:`layouts`); ``rules`` adds hard rules from ``RULES``."""
    unknown = set(rules) - set(RULES)
    if unknown:
        raise ValueError(f"unknown rule(s) {sorted(unknown)}: use {', '.join(RULES)}")
    result, usable = Plan(), cluster.usable_memory * cluster.memory
    memo: dict = {}
    best: dict = {}
    seen: set = set()
    for layout in layouts(model, world or cluster.world, global_batch, **space):
        problem = shape_problem(model, layout, global_batch)
        if problem is None and "tp-in-node" in rules and group_spans_nodes(layout, "tp", cluster.gpus_per_node):
            problem = f"rule tp-in-node: the tp group of {layout.tp} spans nodes"
        key = Layout(**{**layout.__dict__, "order": AXES})  # memory does not depend on placement
        if problem:
            if "tp-in-node" in problem or key not in seen:  # one rejection per layout, whatever its placement
                seen.add(key)
                result.rejected.append(Rejected(layout, problem))
            continue
        if key not in memo:
            memo[key] = memory_per_gpu(model, layout, precision)
        mem = memo[key]
        if mem["total"] > usable:
            if key in seen:
                continue
            seen.add(key)
            parts = ", ".join(f"{k} {mem[k] / GB:.1f}" for k in ("params", "grads", "optimizer", "activations", "buffers") if mem[k])
            result.rejected.append(Rejected(layout, f"memory: needs {mem['total'] / GB:.1f} GB of {usable / GB:.1f} GB usable ({parts} GB)"))
            continue
        found = Candidate(layout, mem, step_time(model, cluster, layout, precision, overlap))
        if key not in best or found.step_s < best[key].step_s:
            best[key] = found  # of one layout's placements, the planner keeps the fastest
    result.fits = sorted(best.values(), key=lambda c: c.step_s)
    return result


def placements(model: ModelSpec, cluster: Cluster, layout: Layout, precision: str = "bf16-mixed",
               overlap: Overlap = Overlap()) -> list[dict]:
    """Step time of ``layout`` under every order of its mesh axes, fastest first, with which groups span nodes."""
    rows = []
    for order in itertools.permutations(AXES):
        placed = Layout(**{**layout.__dict__, "order": order})
        spans = [a for a in AXES if group_spans_nodes(placed, a, cluster.gpus_per_node)]
        rows.append({"order": order, "spans_nodes": spans, "step_s": step_time(model, cluster, placed, precision, overlap)["total"]})
    unique = {(tuple(r["spans_nodes"]), round(r["step_s"], 12)): r for r in rows}
    return sorted(unique.values(), key=lambda r: r["step_s"])


# --------------------------------------------------------------------------- seed 003's 70B question

def llama2_70b(seq_len: int = 4096) -> ModelSpec:
    """Llama 2 70B's shape (its released config: 80 layers, width 8192, 64 heads, 8 K/V heads, SwiGLU
    MLP of 28672, vocabulary 32000, context 4096): 69.0B parameters."""
    return ModelSpec(layers=80, d_model=8192, heads=64, kv_heads=8, ffn=28672, gated_mlp=True, seq_len=seq_len, vocab=32000)


def seed003_cluster(nodes: int = 16, inter_bandwidth: float = 50e9, inter_alpha_s: float = 10e-6) -> Cluster:
    """Seed 003's cluster: nodes of 8 A100-80GB on NVLink joined by InfiniBand (its 400 Gb/s = 50 GB/s
    per direction).

    NVLink runs at 300 GB/s here, not the seed's 600 GB/s. The A100's twelve third-generation NVLinks
    carry 25 GB/s each way: 600 GB/s is both directions added (NVIDIA A100 Tensor Core GPU Architecture
    whitepaper, 2020, "Third-Generation NVLink"). A ring all-reduce sends and receives at once, so its
    per-rank time 2(N-1)/N x M / B needs B per direction, which is what nccl-tests' bus bandwidth
    measures and compares to the hardware's peak (nccl-tests, doc/PERFORMANCE.md: "The measurement is of a
    unidirectional bandwidth"). The figure changes one answer of seed 003's 70B example: with ZeRO
    allowed at the seed's batch, TP 4 x DP 32 with ZeRO-3 now ranks just ahead of TP 8 x DP 16 with
    ZeRO-2 (within 2%; the other way round at 600 GB/s), because TP 8's activation all-reduces over
    NVLink take nearly twice as long (0.28 s a step instead of 0.15 s). Without ZeRO the seed's
    TP 8 x PP 4 x DP 4 stays first.

    Peak bf16 312 TFLOP/s of which half is sustained (the Megatron-LM paper's end-to-end 52% on 3072
    GPUs); HBM 2.0 TB/s. The latencies (3 us a hop inside a node, 10 us across) are
    assumptions: they hardly matter for messages of tens of megabytes."""
    from ddpkit.capstone import peak_tflops

    return Cluster(nodes=nodes, gpus_per_node=8, memory=80e9, flops=0.5 * peak_tflops("NVIDIA A100-SXM4-80GB") * 1e12,
                   intra=AlphaBeta(3e-6, 300e9), inter=AlphaBeta(inter_alpha_s, inter_bandwidth),
                   memory_bandwidth=2.0e12, name="seed 003: 16 x 8 A100-80GB")


SEED003_LAYOUT = Layout(dp=4, tp=8, pp=4, micro_batch=1, micro_batches=8)
"""Seed 003's answer: TP 8 in a node, PP 4 across nodes, DP 4, 1F1B with 8 micro-batches (of one sequence)."""
