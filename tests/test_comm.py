"""The hand-written ring against gloo's all_reduce (bitwise), and the cost model's arithmetic."""

import pytest

from ddpkit.launch import launch
from ddpkit.parallel import comm

SIZES = (1, 5, 12, 13, 100, 4096, 10_007, 262_147)  # some divide by 2, 3 and 4, some do not


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_all_reduce_is_bitwise_gloo(world):
    results = launch(comm.check_ring, SIZES, world_size=world, output="none")
    for rank, rows in enumerate(results):
        for row in rows:
            assert row["bitwise"], f"rank {rank}, {row['n']} elements: differs from gloo by {row['max_diff']}"
            if all(b > a for a, b in comm.chunk_bounds(row["n"], world)):  # no empty chunk: 2(N-1) messages
                assert row["messages"] == 2 * (world - 1)
    # the bytes each rank sends add up to the formula 2(N-1)/N x M, summed over ranks
    for i, n in enumerate(SIZES):
        total = sum(rows[i]["bytes_sent"] for rows in results)
        assert total == pytest.approx(world * comm.ring_bytes_per_rank(4 * n, world), rel=0.5 if n < 100 else 0.01)


def test_chunk_bounds_cover_the_buffer_once():
    for n in (0, 1, 7, 100, 10_007):
        for world in (1, 2, 3, 4, 7):
            bounds = comm.chunk_bounds(n, world)
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def _timed(ctx):
    return comm.benchmark(ctx, [2**10, 2**16], ops=comm.COLLECTIVES, iters=2)


def test_benchmark_reports_busbw_with_the_nccl_tests_factors():
    rows = launch(_timed, world_size=2, output="none")
    assert rows[0] == rows[1]  # every rank reports the slowest rank's time
    for row in rows[0]:
        factor = {"all_reduce": 1.0, "broadcast": 1.0}.get(row["op"], 0.5)  # 2(N-1)/N and (N-1)/N at N = 2
        assert row["busbw"] == pytest.approx(row["algbw"] * factor)
        assert row["algbw"] == pytest.approx(row["bytes"] / row["seconds"])


def test_alpha_beta_fit_recovers_a_known_link():
    link = comm.AlphaBeta(alpha_s=50e-6, bandwidth=2e9)
    sizes = [2**k for k in range(8, 27, 2)]
    fitted = comm.fit_alpha_beta(sizes, [link.seconds(m) for m in sizes])
    assert fitted.alpha_s == pytest.approx(link.alpha_s, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(link.bandwidth, rel=1e-6)


def test_ring_cost_model_latency_grows_bandwidth_saturates():
    link = comm.AlphaBeta(alpha_s=10e-6, bandwidth=1e10)
    small = [comm.ring_all_reduce_seconds(link, 1024, n) for n in (2, 8, 64)]
    assert small[2] / small[1] == pytest.approx(63 / 7, rel=0.01)  # latency-bound: grows with N
    big = [comm.ring_all_reduce_seconds(comm.AlphaBeta(0.0, 1e10), 1e9, n) for n in (8, 1024)]
    assert big[1] / big[0] == pytest.approx((2 * 1023 / 1024) / (2 * 7 / 8))  # bandwidth-bound: flat
    effs = [comm.scaling_efficiency(link, 1e8, 0.5, n) for n in (1, 8, 64, 1024)]
    assert effs[0] == 1.0 and effs == sorted(effs, reverse=True)


def test_show_collectives_moves_what_each_collective_promises():
    out = launch(comm.show_collectives, 6, world_size=2, output="none")
    before = [o["before"] for o in out]
    total = [a + b for a, b in zip(*before)]
    assert out[0]["all_reduce"] == out[1]["all_reduce"] == total
    assert out[1]["broadcast"] == before[0]
    assert out[0]["reduce_scatter"] + out[1]["reduce_scatter"] == total
    assert out[0]["all_gather"] == out[1]["all_gather"] == before[0][:3] + before[1][:3]
