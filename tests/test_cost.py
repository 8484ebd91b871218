"""The alpha-beta model per message, and the scaling model against seed 003's table, with the negative
controls that show each check failing when its mechanism is removed."""

import random

import pytest

from ddpkit.parallel import cost

SEED_TABLE = {8: 0.90, 32: 0.84, 64: 0.80, 256: 0.70, 1024: 0.60}
NVLINK, INFINIBAND = cost.AlphaBeta(0.0, 600e9), cost.AlphaBeta(0.0, 50e9)
SIZES = [2**k for k in range(10, 25, 2)]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fit_ring_recovers_the_per_message_link(world):
    link = cost.AlphaBeta(alpha_s=40e-6, bandwidth=2e9)
    times = [cost.ring_all_reduce_seconds(link, m, world) for m in SIZES]
    fitted = cost.fit_ring(SIZES, times, world)
    assert fitted.alpha_s == pytest.approx(link.alpha_s, rel=1e-6) and fitted.bandwidth == pytest.approx(link.bandwidth, rel=1e-6)


def test_a_whole_calls_alpha_charged_per_message_double_counts_the_latency():
    """Negative control for notebook 09's check: the per-call fit reused per message mispredicts 2-rank
    all-reduces (small ones at about twice their time); the per-message fit does not."""
    link = cost.AlphaBeta(alpha_s=40e-6, bandwidth=2e9)
    times = [cost.ring_all_reduce_seconds(link, m, 2) for m in SIZES]
    per_call = cost.fit_alpha_beta(SIZES, times)
    assert per_call.alpha_s == pytest.approx(2 * link.alpha_s, rel=1e-6)  # a 2-rank all-reduce is two messages
    wrong = cost.ring_all_reduce_seconds(per_call, SIZES[0], 2) / times[0] - 1
    right = cost.ring_all_reduce_seconds(cost.fit_ring(SIZES, times, 2), SIZES[0], 2) / times[0] - 1
    assert wrong > 0.5 and abs(right) < 1e-6


def test_stragglers_and_overlap_reproduce_seed_003s_table_and_nothing_else_does():
    fit = cost.fit_table(SEED_TABLE, NVLINK, 14e9, 0.5, INFINIBAND)
    assert fit["max_error"] <= 0.05
    # negative control: without stragglers the curve is flat past the node boundary
    assert cost.fit_table(SEED_TABLE, NVLINK, 14e9, 0.5, INFINIBAND, jitters=(0.0,))["max_error"] >= 0.08
    # negative control: random parameter sets almost never pass the notebook's 5-point check
    rng, passed = random.Random(0), 0
    for _ in range(20_000):
        hidden, jitter = rng.random(), 0.5 * rng.random()
        curve = {n: cost.scaling_efficiency(NVLINK, 14e9, 0.5, n, hidden, INFINIBAND, 8, jitter) for n in SEED_TABLE}
        passed += max(abs(curve[n] - SEED_TABLE[n]) for n in SEED_TABLE) <= 0.05
    assert passed < 20  # 0.1% at most


def test_weak_strong_and_two_tier_behave_as_taught():
    link = cost.AlphaBeta(10e-6, 600e9)
    weak = [cost.scaling_efficiency(link, 14e9, 0.5, n, inter=INFINIBAND) for n in (8, 16, 1024)]
    assert weak[1] < 0.6 * weak[0] and weak[2] == pytest.approx(weak[1], rel=0.1)  # a step at the node boundary, then flat
    strong = [cost.scaling_efficiency(link, 14e9, 0.5 * 8, n, inter=INFINIBAND, scaling="strong") for n in (8, 1024)]
    assert strong[1] < 0.05 * weak[2]  # fixed global batch: compute per rank shrinks, the all-reduce does not
    flat = cost.ring_all_reduce_seconds(NVLINK, 14e9, 64, INFINIBAND)
    assert cost.hierarchical_all_reduce_seconds(NVLINK, INFINIBAND, 14e9, 64) < flat / 4


def test_expected_max_is_exact_on_an_empirical_distribution():
    assert cost.expected_max([1.0, 2.0], 1) == pytest.approx(1.5)
    assert cost.expected_max([1.0, 2.0], 2) == pytest.approx(1.75)  # max of two draws is 2 unless both are 1
    assert cost.exp_tail_max(1, 0.3) == pytest.approx(1.0) and cost.exp_tail_max(1024, 0.1) > cost.exp_tail_max(8, 0.1)
