"""The planner's cost model, calibrated on this machine and checked against the trainer's real step times.

A model that ranks layouts is only as good as its ranking of layouts that can be measured. On one
machine with CPU ranks the kit's trainer runs DDP, ZeRO-1 and FSDP2 over 4 ranks, tensor parallelism
(``--tp 2``), a pipeline (``--pp 2``) and both (``--tp 2 --pp 2``). This module:

1. measures the machine with the kit's own functions: the link (``comm.benchmark``, each collective's
   per-hop alpha and bandwidth fitted with ``comm.fit_alpha_beta``), the compute (a GPT forward and
   backward timed at two micro-batch sizes and fitted, with the same function, as the alpha-beta of
   computing: a fixed cost per layer plus FLOPs at a rate), and the optimizer step (AdamW);
2. runs every layout's real ``Trainer`` in one launch, round-robin (a step of each, again and again,
   so that a burst of load from other processes lands on all of them), keeps the median, and times the
   compute probe and the collectives between rounds, under the same load;
3. builds a :class:`~ddpkit.parallel.step_time.Cluster` of one node from the measurements, whose ranks
   share the machine's cores;
4. compares the predicted order with the measured one by Spearman's rank correlation.

What a CPU cannot show: one link class only (every "node" is this machine, so crossing nodes cannot be
measured), bandwidth terms small next to slow CPU compute (latency dominates), and overlap limited by
the cores that both compute and move bytes.
"""

from __future__ import annotations

import random
import statistics
import time

import torch
import torch.distributed as dist

from ddpkit.parallel import comm
from ddpkit.parallel.step_time import Cluster, Layout, ModelSpec, optimizer_traffic

FIT_OPS = ("all_reduce", "all_gather", "reduce_scatter")


def fit_links(ctx, sizes: list[int], iters: int = 5) -> dict:
    """Per-hop alpha (seconds) and bandwidth (bytes/s) of each collective on this world, fitted to the
    median of ``iters`` calls per size (a function for ``ddpkit.launch``). The median, not the fastest
    call: the trainer's collectives meet the machine's typical delays, and the model predicts typical
    steps. A ring collective of M bytes over N ranks takes hops x alpha + share x M / bandwidth, so
    t / hops = alpha + (share x M / hops) / bandwidth. :func:`time_layouts` does the same between the
    layouts' steps, round by round, so that the links are measured under the load the steps meet."""
    return links_from(comm.benchmark(ctx, sizes, FIT_OPS, iters), ctx.world_size)


def links_from(rows: list[dict], world: int) -> dict:
    """The per-hop alpha-beta fit of :func:`fit_links`, from ``comm.benchmark``'s rows (op, bytes, seconds)."""
    links = {}
    for op in FIT_OPS:
        hops = 2 * (world - 1) if op == "all_reduce" else world - 1
        mine = [r for r in rows if r["op"] == op]
        fit = comm.fit_alpha_beta([comm.BUS_FACTOR[op](world) * r["bytes"] / hops for r in mine],
                                  [r["seconds"] / hops for r in mine])
        links[op] = {"alpha_s": fit.alpha_s, "bandwidth": fit.bandwidth}
    return links


def _seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)  # the least disturbed run


def fit_compute(samples: list[dict], spec: ModelSpec, ranks: int, cores: int) -> dict:
    """FLOP/s and fixed seconds per layer per forward-equivalent pass of one rank *alone on a core*, from
    forward + backward passes (three forward-equivalents) timed while all ``ranks`` computed at once on
    ``cores`` (:func:`time_layouts` measures them between the layouts' steps, under the same load): with
    every rank busy each gets cores / ranks of a core, so the alone figures are the shared ones scaled."""
    fit = comm.fit_alpha_beta([r["flops"] for r in samples], [statistics.median(r["seconds"]) for r in samples])
    share = min(1.0, cores / ranks)
    return {"flops": fit.bandwidth / share, "layer_overhead_s": fit.alpha_s * share / (3 * spec.layers)}


def _probe(cfg, micro_batches) -> list:
    """Forward + backward of the config's GPT at each micro-batch size, ready to time (built once)."""
    from ddpkit.models import build_model, loss_fn

    model, spec, runs = build_model(cfg), ModelSpec.from_config(cfg), []
    for b in micro_batches:
        tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len))

        def step(tokens=tokens):
            model.zero_grad(set_to_none=True)
            loss_fn(model(tokens), tokens).backward()

        step()  # warm-up
        runs.append((b * cfg.seq_len * spec.flops_per_token(), step))
    return runs


def fit_optimizer(numel: int = 2**18, repeats: int = 5) -> float:
    """Bytes/s that ``torch.optim.AdamW`` streams its fp32 state at on one thread (the rate the planner's
    optimizer term uses)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        param = torch.nn.Parameter(torch.randn(numel))
        param.grad = torch.randn(numel)
        opt = torch.optim.AdamW([param], lr=1e-3)
        opt.step()
        seconds = _seconds(opt.step, repeats)
    finally:
        torch.set_num_threads(threads)
    return numel * optimizer_traffic("fp32") / seconds


def cpu_cluster(links: dict, compute: dict, optimizer_bandwidth: float, ranks: int, cores: int) -> Cluster:
    """One node of ``ranks`` CPU ranks sharing ``cores``, with the measured links, compute and optimizer rate."""
    by_op = {op: comm.AlphaBeta(**v) for op, v in links.items()}
    return Cluster(nodes=1, gpus_per_node=ranks, memory=float(2**40), flops=compute["flops"],
                   intra=by_op["all_reduce"], inter=by_op["all_reduce"], memory_bandwidth=optimizer_bandwidth,
                   layer_overhead_s=compute["layer_overhead_s"], cores_per_node=cores, intra_by_op=by_op,
                   name=f"this machine: {ranks} ranks on {cores} cores")


ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero1-torch": 1, "fsdp2": 3, "hsdp": 3}  # the trainer's strategy -> ZeRO stage


def trainer_layout(cfg) -> Layout:
    """The planner's :class:`Layout` for what a ``TrainConfig`` runs: its dp, tp, pp, cp and ep degrees
    (``--experts E --ep N``: the experts split over N of the dp ranks; :meth:`ModelSpec.from_config`
    gives the planner the experts themselves), the ZeRO stage of its strategy, recomputation and
    micro-batching. ``fsdp2 --tp N`` is ZeRO-3 over the dp ranks with tp inside each replica, as the
    trainer runs it. ``hsdp`` is ZeRO-3 within shard groups of ``shard`` ranks (``Layout.shard``), its
    gradient shards all-reduced across the replica groups."""
    if cfg.strategy not in ZERO_STAGE:
        raise ValueError(f"the planner has no ZeRO stage for strategy {cfg.strategy!r}: use one of {', '.join(ZERO_STAGE)}")
    shard = cfg.hsdp_mesh[1] if cfg.strategy == "hsdp" else 0
    return Layout(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, zero=ZERO_STAGE[cfg.strategy], shard=shard,
                  checkpointing=cfg.activation_checkpointing, micro_batch=cfg.micro_batch_size,
                  micro_batches=cfg.grad_accum, order=("tp", "dp", "pp", "cp"))


def time_layouts(ctx, configs: dict, rounds: int = 3, steps: int = 1, probe=(2, 8), link_sizes=()) -> dict:
    """Step times of the real trainer under each config (a function for ``ddpkit.launch``): every config
    gets its own ``Trainer`` (one warm-up step), then ``rounds`` times each runs ``steps`` steps in turn,
    and every rank times a forward + backward of the first config's GPT at each ``probe`` micro-batch size
    (the compute calibration) and one call of each collective at each of ``link_sizes`` (the links),
    under the same load. A time is the slowest rank's. Returns ``{"steps": {name: [seconds...]},
    "probe": [{"flops", "seconds": [per round]}], "links": fitted as by fit_links, to the median over the
    rounds (None without link_sizes)}`` on every rank."""
    from ddpkit.progress import Reporter
    from ddpkit.train import Trainer

    trainers = {name: Trainer(ctx, cfg) for name, cfg in configs.items()}
    for trainer in trainers.values():  # a few steps of many trainers in turn are no training run to plot:
        trainer.progress.close()  # the launcher shows its "running" heartbeat instead
        trainer.progress = Reporter(None)
    runs = _probe(next(iter(configs.values())), probe)
    try:
        for trainer in trainers.values():
            trainer.prepare()
            trainer.run_step()
        times: dict[str, list[float]] = {name: [] for name in trainers}
        probed: list[list[float]] = [[] for _ in runs]
        link_rounds: list[list[dict]] = []
        for _ in range(rounds):
            for i, (_, step) in enumerate(runs):
                dist.barrier(group=ctx.world_group)
                probed[i].append(_seconds(step, 1))
            if link_sizes:  # every rank gets the same rows (each call the slowest rank's)
                link_rounds.append(comm.benchmark(ctx, list(link_sizes), FIT_OPS, iters=1))
            for name, trainer in trainers.items():
                dist.barrier(group=ctx.world_group)
                times[name] += [trainer.run_step().step_time_s for _ in range(steps)]
    finally:
        for trainer in trainers.values():
            trainer.close()
    table = torch.tensor([times[name] for name in trainers] + probed, dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=ctx.world_group)
    rows = table.tolist()
    links = None
    if link_rounds:
        typical = [{**row, "seconds": statistics.median(r[i]["seconds"] for r in link_rounds)}
                   for i, row in enumerate(link_rounds[0])]
        links = links_from(typical, ctx.world_size)
    return {"steps": {name: rows[i] for i, name in enumerate(trainers)},
            "probe": [{"flops": flops, "seconds": rows[len(trainers) + i]} for i, (flops, _) in enumerate(runs)],
            "links": links}


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ts) for name, ts in times.items()}


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (1: same order, -1: reversed)."""
    if len(x) != len(y) or len(x) < 3:
        raise ValueError("rank correlation needs two lists of the same length, at least 3")
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def paired_medians(times: dict[str, list[float]], reference: str) -> dict[str, float]:
    """Each config's median step time, measured against ``reference`` round by round: the median of its
    ratio to the reference's time in the same round, times the reference's median. Load from other
    processes that slows a whole round cancels out of the ratio."""
    ref = times[reference]
    base = statistics.median(ref)
    return {name: base * statistics.median(t / r for t, r in zip(ts, ref)) for name, ts in times.items()}


def shuffled_spearman(predicted: list[float], measured: list[float], count: int = 200, seed: int = 0) -> list[float]:
    """The negative control: the rank correlation of ``count`` random reorderings of the prediction."""
    rng, out = random.Random(seed), []
    for _ in range(count):
        shuffled = predicted[:]
        rng.shuffle(shuffled)
        out.append(spearman(shuffled, measured))
    return out
