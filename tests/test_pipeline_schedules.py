"""Schedules beyond 1F1B: generated orders equal torch's own, the simulator checks every dependency of the
split backward and of virtual stages, and the bubbles are the papers' (with the mechanisms removed, not)."""

import pytest

from ddpkit.parallel import pipeline_schedules as S
from ddpkit.parallel.pipeline import Action, one_f_one_b

SHAPES = [(2, 2, 2), (2, 4, 2), (2, 8, 1), (3, 6, 2), (4, 8, 2), (4, 16, 3), (4, 6, 2)]


def _check_dependencies(timeline, n_stages):
    """Independently of the simulator: every action started after what it needs had ended."""
    done = {(e["kind"], e["stage"], e["micro"]): e["end"] for e in timeline}
    for e in timeline:
        for kind, stage, micro in S.needs(Action(e["kind"], e["stage"], e["micro"]), n_stages):
            ends = [done[k] for k in ((kind, stage, micro),) if k in done] if kind != "dx" else \
                [done[(k, stage, micro)] for k in "BI" if (k, stage, micro) in done]
            assert ends and e["start"] >= max(ends) - 1e-12


@pytest.mark.parametrize("name", ["interleaved", "zero-bubble", "zbv"])
@pytest.mark.parametrize("p, m, v", SHAPES)
def test_generated_orders_are_torchs_own(name, p, m, v):
    try:
        theirs = S.torch_order(name, p, m, v)
    except RuntimeError as e:
        pytest.skip(str(e))
    assert S.generate(name, p, m, v) == theirs


@pytest.mark.parametrize("p, m, v", SHAPES)
def test_interleaved_bubble_is_megatrons_fraction_of_ideal_time(p, m, v):
    timeline = S.simulate(S.interleaved(p, m, v))
    _check_dependencies(timeline, p * v)
    assert S.bubble_over_ideal(timeline) == pytest.approx((p - 1) / (v * m))
    # the price: the first rank holds more than 1F1B's p micro-batches' activations in warm-up
    if v > 1 and m > p:
        assert S.held(timeline, 0, v) > p


@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 8)])
def test_with_one_chunk_per_rank_interleaved_has_1f1bs_bubble_not_its_memory(p, m):
    one, looped = S.simulate(one_f_one_b(p, m)), S.simulate(S.interleaved(p, m, 1))
    assert S.bubble_over_ideal(looped) == pytest.approx(S.bubble_over_ideal(one)) == pytest.approx((p - 1) / m)
    # the warm-up keeps two forwards per hop from the last rank (torch's too), one more than 1F1B needs
    assert [S.held(looped, r, 1) for r in range(p)] == [min(m, 2 * (p - 1 - r) + 1) for r in range(p)]
    assert [S.held(one, r, 1) for r in range(p)] == [min(m, p - r) for r in range(p)]


@pytest.mark.parametrize("p, m, v", SHAPES)
def test_zero_bubble_is_a_third_of_1f1bs_at_the_same_peak_memory(p, m, v):
    timeline = S.simulate(S.zero_bubble(p, m, v))
    _check_dependencies(timeline, p * v)
    split = S.bubble_over_ideal(timeline)
    assert split == pytest.approx(S.zb_h1_bubble(p, m) / v) and split < S.megatron_bubble(p, m, v)
    if m % p == 0:  # ZB-H1's promise: no rank above 1F1B's peak of p micro-batches
        assert max(S.held(timeline, r, v) for r in range(p)) == pytest.approx(p)


def test_without_the_split_zero_bubble_falls_back_to_the_1f1b_bubble():
    for p, m, v in [(2, 4, 1), (4, 8, 1), (4, 8, 2)]:
        merged = [[Action("B", a.stage, a.micro) if a.kind == "I" else a for a in order if a.kind != "W"]
                  for order in S.zero_bubble(p, m, v)]
        assert S.bubble_over_ideal(S.simulate(merged)) == pytest.approx(S.megatron_bubble(p, m, v))


def test_without_the_bounded_delay_every_w_waits_and_memory_grows_to_m():
    p, m = 4, 8
    late = [[a for a in order if a.kind != "W"] + [a for a in order if a.kind == "W"] for order in S.zero_bubble(p, m)]
    timeline = S.simulate(late)
    assert max(S.held(timeline, r, 1) for r in range(p)) == m > p
    assert S.bubble_over_ideal(timeline) > S.zb_h1_bubble(p, m)


@pytest.mark.parametrize("p, m", [(2, 3), (2, 4), (4, 8), (4, 16)])
def test_zbv_has_no_bubble_inside_each_ranks_span(p, m):
    timeline = S.simulate(S.zbv(p, m))
    _check_dependencies(timeline, 2 * p)
    assert S.bubble_within_ranks(timeline) == pytest.approx(0, abs=1e-12)
    assert S.bubble_over_ideal(timeline) < S.zb_h1_bubble(p, m) < S.megatron_bubble(p, m)
    assert max(S.held(timeline, r, 2) for r in range(p)) == pytest.approx(p)
    assert {a.stage for a in S.zbv(p, m)[0]} == {0, 2 * p - 1} and S.stage_ranks(p, 2, "v")[2 * p - 1] == 0


def test_1f1b_keeps_a_bubble_inside_the_ranks_spans():  # the control for the test above
    assert S.bubble_within_ranks(S.simulate(one_f_one_b(4, 8))) > 0.1


def test_the_simulator_refuses_broken_orders():
    order = S.zero_bubble(2, 4)
    w_first = [list(o) for o in order]
    i = next(k for k, a in enumerate(w_first[1]) if a.kind == "I")
    w_first[1].insert(i, w_first[1].pop(next(k for k, a in enumerate(w_first[1]) if a == Action("W", 1, 0))))
    with pytest.raises(ValueError, match="deadlocks"):  # a W before its own I
        S.simulate(w_first)
    with pytest.raises(ValueError, match="one I and one W"):  # a W lost
        S.simulate([order[0], [a for a in order[1] if a != Action("W", 1, 3)]])
    with pytest.raises(ValueError, match="lives on one rank"):  # a chunk on two ranks
        S.simulate([order[0] + [Action("F", 1, 9)], order[1]])
    swapped = [list(o) for o in S.interleaved(2, 4, 2)]
    swapped[0][0], swapped[0][2] = swapped[0][2], swapped[0][0]  # chunk 2's forward before chunk 1's exists
    with pytest.raises(ValueError, match="deadlocks"):
        S.simulate(swapped)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        S.interleaved(4, 9, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        S.generate("looped", 2, 4)
