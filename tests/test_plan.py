"""The layout planner: its memory accounting, its step-time terms, seed 003's 70B answer, the rule that
tensor parallelism stays inside a node, and the rank agreement that a shuffled prediction fails."""

import random

import pytest

from ddpkit.capstone import flops_per_token
from ddpkit.config import TrainConfig
from ddpkit.parallel import calibrate, memory
from ddpkit.parallel.comm import AlphaBeta
from ddpkit.parallel.plan import (SEED003_LAYOUT, activation_bytes_per_layer, llama2_70b, memory_per_gpu, placements,
                                  plan, seed003_cluster)
from ddpkit.parallel.step_time import Cluster, Layout, ModelSpec, group_spans_nodes, step_time

GB = 1e9


def test_llama2_70b_has_69b_parameters_and_the_tiny_gpt_its_flops():
    assert 68.9e9 < llama2_70b().params < 69.1e9
    cfg = TrainConfig(model="gpt", d_model=64, n_layers=3, seq_len=32)
    ours, theirs = ModelSpec.from_config(cfg).flops_per_token(), flops_per_token(cfg)
    assert abs(ours / theirs - 1) < 0.02  # the capstone's count leaves the biases out


def test_activations_are_korthikantis_formula():
    """GPT shape (ffn 4h, dropout, no GQA) at 2 bytes: sbh(10 + 24/t), plus 5as^2b/t without FlashAttention."""
    s, b, h, a = 2048, 2, 1024, 16
    gpt = ModelSpec(layers=4, d_model=h, heads=a, seq_len=s, vocab=1000, dropout=True)
    for t in (1, 2, 8):
        got = activation_bytes_per_layer(gpt, Layout(tp=t, micro_batch=b))
        assert got == pytest.approx(s * b * h * (10 + 24 / t))
        scores = activation_bytes_per_layer(ModelSpec(**{**gpt.__dict__, "flash_attention": False}), Layout(tp=t, micro_batch=b))
        assert scores - got == pytest.approx(5 * a * s * s * b / t)


def test_memory_uses_the_zero_accounting_and_rejects_what_does_not_fit():
    model, cluster = llama2_70b(), seed003_cluster()
    ddp = memory_per_gpu(model, Layout(dp=128, micro_batch=1, checkpointing=True))
    assert ddp["params"] + ddp["grads"] + ddp["optimizer"] == pytest.approx(16 * model.params)
    zero3 = memory_per_gpu(model, Layout(dp=128, zero=3, micro_batch=1, checkpointing=True))
    assert zero3["optimizer"] == memory.bytes_per_rank(model.params, "zero3", 128, "bf16-mixed")["optimizer"]
    result = plan(model, cluster, 1024, tp=[1], pp=[1], zero=(0, 3), virtual=(1,))
    assert result.rank_of(zero=3, checkpointing=True) is not None and result.rank_of(zero=0) is None
    reasons = result.why_not(zero=0, checkpointing=True, micro_batch=1)
    assert reasons and "memory: needs" in reasons[0] and "optimizer 827.7" in reasons[0]  # 12 bytes x 69B, whole


def test_bubble_terms_follow_the_formulas():
    model, cluster = llama2_70b(), seed003_cluster()
    for v, m in ((1, 8), (2, 8), (1, 32)):
        t = step_time(model, cluster, Layout(dp=4, tp=8, pp=4, micro_batch=1, micro_batches=m, virtual_stages=v))
        micro = (t["total"] - t["bubble"] - t["dp_sync"] - t["optimizer"]) / m
        assert t["bubble"] / (m * micro) == pytest.approx((4 - 1) / (v * m))


def test_seed_003_70b_answer_is_reproduced_under_its_assumptions():
    """No ZeRO, plain 1F1B, a batch of 8 micro-batches x DP 4: TP 8 x PP 4 x DP 4 is the fastest that fits."""
    model, cluster = llama2_70b(), seed003_cluster()
    best = plan(model, cluster, global_batch=32, zero=(0,), virtual=(1,)).best.layout
    assert (best.tp, best.pp, best.dp, best.micro_batches, best.zero) == (8, 4, 4, 8, 0)
    assert not group_spans_nodes(best, "tp", 8) and group_spans_nodes(best, "pp", 8)
    big = plan(model, cluster, global_batch=1024, zero=(0,), virtual=(1,)).best.layout  # a 4M-token batch
    assert (big.tp, big.pp, big.dp) == (8, 4, 4)


def test_with_zero_allowed_the_planner_chooses_otherwise_and_faster():
    model, cluster = llama2_70b(), seed003_cluster()
    free = plan(model, cluster, global_batch=32)
    seed = step_time(model, cluster, SEED003_LAYOUT)["total"]
    assert free.best.layout.zero > 0 and free.best.layout.pp == 1 and free.best.step_s < 0.8 * seed


def test_nvlink_per_direction_bandwidth_decides_the_zero_tie():
    """At NVLink's 300 GB/s per direction TP 4 x DP 32 (ZeRO-3) edges out TP 8 x DP 16 (ZeRO-2); at the
    seed's 600 GB/s (both directions added) the order flips: the figure is what decides it."""
    model, cluster = llama2_70b(), seed003_cluster()
    assert cluster.intra.bandwidth == 300e9
    shape = lambda c: (c.layout.tp, c.layout.pp, c.layout.dp, c.layout.zero)  # noqa: E731
    per_direction = plan(model, cluster, global_batch=32, virtual=(1,)).fits[:2]
    assert [shape(c) for c in per_direction] == [(4, 1, 32, 3), (8, 1, 16, 2)]
    assert per_direction[1].step_s < 1.05 * per_direction[0].step_s
    both_ways = Cluster(**{**cluster.__dict__, "intra": AlphaBeta(cluster.intra.alpha_s, 600e9)})
    assert shape(plan(model, both_ways, global_batch=32, virtual=(1,)).best) == (8, 1, 16, 2)


def test_tensor_parallelism_stays_inside_a_node_when_the_inter_node_link_is_slow():
    model, slow = llama2_70b(), seed003_cluster()
    top = plan(model, slow, global_batch=1024, zero=(0, 1)).fits[:30]
    assert all(not group_spans_nodes(c.layout, "tp", 8) for c in top)
    crossing = [r for r in placements(model, slow, SEED003_LAYOUT) if "tp" in r["spans_nodes"]]
    inside = [r for r in placements(model, slow, SEED003_LAYOUT) if "tp" not in r["spans_nodes"]]
    assert min(r["step_s"] for r in crossing) > 1.3 * inside[0]["step_s"]
    # negative control: with one link class, where tp sits costs nothing
    flat = seed003_cluster(inter_bandwidth=slow.intra.bandwidth, inter_alpha_s=slow.intra.alpha_s)
    times = {round(r["step_s"], 9) for r in placements(model, flat, SEED003_LAYOUT)}
    assert len(times) == 1


def test_the_tp_in_node_rule_rejects_with_its_reason():
    result = plan(llama2_70b(), seed003_cluster(), 1024, tp=[16], pp=[2, 4], zero=(0,), virtual=(1,), rules=("tp-in-node",))
    assert not result.fits and all("rule tp-in-node" in r.reason or "tp 16 does not divide" in r.reason for r in result.rejected)
    with pytest.raises(ValueError, match="unknown rule"):
        plan(llama2_70b(), seed003_cluster(), 32, rules=("tp-anywhere",))


def test_shared_cores_hide_the_bubble_and_gpus_do_not():
    model = ModelSpec(layers=4, d_model=64, heads=4, seq_len=64, vocab=64)
    link = AlphaBeta(1e-4, 1e9)
    host = dict(nodes=1, gpus_per_node=4, memory=1e12, flops=1e10, intra=link, inter=link, memory_bandwidth=1e9)
    from ddpkit.parallel.step_time import Cluster

    ddp, pp = Layout(dp=4, micro_batch=8), Layout(dp=2, pp=2, micro_batch=8, micro_batches=2)
    gpus = Cluster(**host)
    cpu = Cluster(**host, cores_per_node=2)
    assert step_time(model, gpus, pp)["total"] > 1.3 * step_time(model, gpus, ddp)["total"]  # the bubble costs
    assert step_time(model, cpu, pp)["total"] < 1.1 * step_time(model, cpu, ddp)["total"]  # idle ranks lend their core


def test_rank_agreement_passes_for_the_model_and_fails_when_shuffled():
    """The check the notebook makes on measured step times, with its negative control."""
    rng = random.Random(0)
    measured = [0.10, 0.13, 0.17, 0.22, 0.29, 0.38, 0.50, 0.66]
    predicted = [t * rng.uniform(0.85, 1.15) for t in measured]  # a model that is off by up to 15%
    assert calibrate.spearman(predicted, measured) >= 0.6
    shuffled = predicted[:]
    random.Random(3).shuffle(shuffled)
    assert calibrate.spearman(shuffled, measured) < 0.6
    assert calibrate.spearman(predicted[::-1], measured) < 0
    assert calibrate.ranks([3.0, 1.0, 3.0]) == [2.5, 1.0, 2.5]


def test_trainer_configs_map_to_planner_layouts_and_paired_medians_cancel_common_load():
    cfg = TrainConfig(model="gpt", world_size=4, tp=2, pp=2, micro_batch_size=4, grad_accum=4)
    layout = calibrate.trainer_layout(cfg)
    assert (layout.dp, layout.tp, layout.pp, layout.micro_batches, layout.global_batch) == (1, 2, 2, 4, cfg.global_batch_size)
    assert calibrate.trainer_layout(cfg.replace(tp=1, pp=1, strategy="fsdp2", checkpoint_dir=None)).zero == 3
    times = {"ref": [1.0, 3.0, 1.0], "slow": [2.0, 6.0, 2.0]}  # the second round ran under 3x the load
    assert calibrate.paired_medians(times, "ref") == {"ref": 1.0, "slow": 2.0}
    assert calibrate.medians(times)["slow"] == 2.0


def test_recomputation_costs_a_third_more_compute_and_deeper_pipelines_idle_more():
    model, cluster = llama2_70b(), seed003_cluster()
    base = Layout(dp=4, tp=4, pp=8, micro_batch=1, micro_batches=8)
    compute = {k: step_time(model, cluster, Layout(**{**base.__dict__, "checkpointing": k}))["compute"] for k in (False, True)}
    assert compute[True] / compute[False] == pytest.approx(4 / 3)  # one more forward on top of forward + backward
    shares = []
    for pp in (2, 4, 8):  # the same 8 micro-batches through deeper pipelines
        t = step_time(model, cluster, Layout(dp=4, tp=8, pp=pp, micro_batch=1, micro_batches=8))
        shares.append(t["bubble"] / t["total"])
    assert shares == sorted(shares) and shares[0] < shares[-1]


def test_links_are_fitted_per_hop_from_benchmark_rows():
    from ddpkit.parallel.comm import BUS_FACTOR

    world, alpha, bandwidth = 4, 1e-3, 2e8
    rows = [{"op": op, "bytes": b, "seconds": (2 if op == "all_reduce" else 1) * (world - 1) * alpha + BUS_FACTOR[op](world) * b / bandwidth}
            for op in calibrate.FIT_OPS for b in (2**12, 2**16, 2**20)]
    for op, fit in calibrate.links_from(rows, world).items():
        assert fit["alpha_s"] == pytest.approx(alpha) and fit["bandwidth"] == pytest.approx(bandwidth), op
    hops_ignored = calibrate.links_from(rows, 2)  # the wrong world counts the wrong hops: alpha is off
    assert hops_ignored["all_reduce"]["alpha_s"] != pytest.approx(alpha)


def _one_node(**kw):
    link = AlphaBeta(2e-5, 1e10)
    return Cluster(**{**dict(nodes=1, gpus_per_node=8, memory=80e9, flops=1e14, intra=link, inter=link,
                             memory_bandwidth=1e12), **kw})


def test_context_parallel_term_is_the_ring_of_kv_blocks_and_vanishes_without_cp():
    """cp ranks pass K/V blocks around a ring: L x (cp - 1) x passes sends of a K/V block each micro-batch."""
    from ddpkit.parallel.step_time import NOTHING_HIDDEN

    model, cluster = ModelSpec(layers=4, d_model=1024, heads=16, kv_heads=4, seq_len=32768, vocab=1000), _one_node()
    link = cluster.intra
    for cp, m in ((2, 1), (4, 2)):
        t = step_time(model, cluster, Layout(dp=8 // cp, cp=cp, micro_batch=1, micro_batches=m), overlap=NOTHING_HIDDEN)
        tokens = model.seq_len / cp
        block = 2 * tokens * model.kv_dim * 2  # K and V of this rank's tokens, bf16
        assert t["cp"] == pytest.approx(m * 4 * (cp - 1) * 3 * (link.alpha_s + block / link.bandwidth))
    # control: without context parallelism there is no ring to pay for
    assert step_time(model, cluster, Layout(dp=8, micro_batch=1), overlap=NOTHING_HIDDEN)["cp"] == 0
    # and the ring hides behind the attention it feeds when it can overlap
    hidden = step_time(model, cluster, Layout(dp=4, cp=2, micro_batch=1))
    assert 0 <= hidden["cp"] < step_time(model, cluster, Layout(dp=4, cp=2, micro_batch=1), overlap=NOTHING_HIDDEN)["cp"]


def test_a_long_sequence_fits_only_with_context_parallelism():
    model = ModelSpec(layers=8, d_model=4096, heads=32, seq_len=131072, vocab=32000)
    cluster = _one_node()
    with_cp = plan(model, cluster, 8, tp=[1, 2], pp=[1], cp=[1, 2, 4, 8], zero=(3,), checkpointing=(False,), virtual=(1,))
    assert with_cp.best.layout.cp > 1 and with_cp.best.time["cp"] > 0
    assert with_cp.rank_of(cp=1) is None and any("activations" in r for r in with_cp.why_not(cp=1))
    # control: the same space without cp has nothing that fits, for the activations' sake
    without = plan(model, cluster, 8, tp=[1, 2], pp=[1], cp=[1], zero=(3,), checkpointing=(False,), virtual=(1,))
    assert not without.fits and all(r.reason.startswith("memory") for r in without.rejected)


def test_expert_parallel_term_is_four_all_to_alls_per_layer_and_vanishes_at_ep_1():
    from ddpkit.parallel.step_time import NOTHING_HIDDEN

    moe = ModelSpec(layers=4, d_model=512, heads=8, seq_len=1024, vocab=1000, experts=8, top_k=2, capacity_factor=1.25)
    cluster, link = _one_node(), _one_node().intra
    for ep in (2, 4, 8):
        t = step_time(moe, cluster, Layout(dp=8, ep=ep, micro_batch=2), overlap=NOTHING_HIDDEN)
        routed = 2 * 1024 * 2 * 1.25 * 512 * 2  # tokens x top-k x capacity x width x bf16
        assert t["ep"] == pytest.approx(4 * 4 * ((ep - 1) * link.alpha_s + (ep - 1) / ep * routed / link.bandwidth))
    # control: ep 1 keeps every expert on every rank, so no token leaves its rank
    assert step_time(moe, cluster, Layout(dp=8, ep=1, micro_batch=2), overlap=NOTHING_HIDDEN)["ep"] == 0
    # a dense model has no all-to-all whatever ep says
    dense = ModelSpec(**{**moe.__dict__, "experts": 1})
    assert step_time(dense, cluster, Layout(dp=8, ep=2, micro_batch=2), overlap=NOTHING_HIDDEN)["ep"] == 0


def test_expert_parallelism_divides_the_experts_memory_and_their_gradient_all_reduce():
    moe = ModelSpec(layers=4, d_model=2048, heads=16, seq_len=1024, vocab=1000, experts=64, top_k=2)
    from ddpkit.parallel.step_time import stage_params

    (dense1, experts1), (dense8, experts8) = (stage_params(moe, Layout(dp=8, ep=e)) for e in (1, 8))
    assert dense8 == dense1 and experts8 == experts1 / 8 and experts1 == 4 * 64 * moe.expert_params()
    one, eight = (memory_per_gpu(moe, Layout(dp=8, ep=e, micro_batch=1)) for e in (1, 8))
    assert one["params"] - eight["params"] == pytest.approx(2 * (experts1 - experts8))  # bf16 weights
    from ddpkit.parallel.step_time import NOTHING_HIDDEN

    sync = {e: step_time(moe, _one_node(), Layout(dp=8, ep=e, micro_batch=1), overlap=NOTHING_HIDDEN)["dp_sync"] for e in (1, 8)}
    assert sync[8] < 0.5 * sync[1]  # each expert's gradient is all-reduced over its dp / ep replicas only: none at ep 8
    cluster = _one_node(memory=40e9)
    result = plan(moe, cluster, 8, tp=[1], pp=[1], zero=(0,), checkpointing=(False,), virtual=(1,), micro_batch=[1])
    assert result.best.layout.ep > 1 and result.best.time["ep"] > 0
    # control: with every expert on every rank the state does not fit
    assert result.rank_of(ep=1) is None and result.why_not(ep=1)[0].startswith("memory")


def test_trainer_layouts_map_cp_ep_hsdp_and_fsdp2_with_tp():
    base = TrainConfig(model="gpt", world_size=4, micro_batch_size=8)
    cp = calibrate.trainer_layout(base.replace(cp=2, micro_batch_size=16))
    assert (cp.dp, cp.cp, cp.global_batch) == (2, 2, 32)
    moe_cfg = base.replace(experts=4, ep=2)
    moe = calibrate.trainer_layout(moe_cfg)
    assert (moe.dp, moe.ep, moe.zero) == (4, 2, 0)
    spec = ModelSpec.from_config(moe_cfg)
    assert (spec.experts, spec.top_k, spec.capacity_factor) == (4, 2, 1.0)  # uneven splits: no padding travels
    assert ModelSpec.from_config(base) == ModelSpec.from_config(base.replace(top_k=1))  # dense: routing fields ignored
    tp_fsdp = calibrate.trainer_layout(base.replace(strategy="fsdp2", tp=2, micro_batch_size=16))
    assert (tp_fsdp.dp, tp_fsdp.tp, tp_fsdp.zero, tp_fsdp.shard) == (2, 2, 3, 0)
    hsdp = calibrate.trainer_layout(base.replace(strategy="hsdp", replicate=2, shard=2))
    fsdp = calibrate.trainer_layout(base.replace(strategy="fsdp2"))
    assert (hsdp.dp, hsdp.zero, hsdp.shard) == (4, 3, 2) and "HSDP shard 2" in hsdp.describe()
    model = ModelSpec(layers=4, d_model=1024, heads=16, seq_len=1024, vocab=1000)
    # HSDP holds twice FSDP's shard over 4, and pays an all-reduce of the gradient shards on top of smaller gathers
    assert memory_per_gpu(model, hsdp)["params"] == pytest.approx(2 * memory_per_gpu(model, fsdp)["params"])
    cluster = _one_node()
    from ddpkit.parallel.step_time import NOTHING_HIDDEN

    t_hsdp, t_fsdp = (step_time(model, cluster, lay, overlap=NOTHING_HIDDEN) for lay in (hsdp, fsdp))
    assert t_hsdp["zero_sharded"] != t_fsdp["zero_sharded"] and t_hsdp["optimizer"] == pytest.approx(2 * t_fsdp["optimizer"])
    # control: an HSDP whose one shard group is the whole world is FSDP
    whole = calibrate.trainer_layout(base.replace(strategy="hsdp"))
    assert whole.shard == 4 and step_time(model, cluster, whole)["total"] == step_time(model, cluster, fsdp)["total"]
