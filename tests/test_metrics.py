import torch

from ddpkit import metrics


def test_comm_seconds_is_the_union_of_in_flight_intervals():
    timer = metrics.CommTimer()
    timer._intervals = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]  # two overlapping buckets, one later
    assert timer.seconds == 4.0


def test_state_sha256_sees_a_single_bit():
    a = {"w": torch.randn(8), "b": torch.zeros(2)}
    b = {k: v.clone() for k, v in a.items()}
    assert metrics.state_sha256(a) == metrics.state_sha256(b)
    b["w"].view(torch.int32)[3] ^= 1
    assert metrics.state_sha256(a) != metrics.state_sha256(b)


def test_data_hash_depends_on_the_samples_not_their_rank_order():
    start = metrics.DATA_SHA256_START
    assert metrics.extend_data_sha256(start, [3, 1, 2]) == metrics.extend_data_sha256(start, [1, 2, 3])
    assert metrics.extend_data_sha256(start, [1, 2, 3]) != metrics.extend_data_sha256(start, [1, 2, 4])
    one = metrics.extend_data_sha256(metrics.extend_data_sha256(start, [1]), [2])
    assert one != metrics.extend_data_sha256(metrics.extend_data_sha256(start, [2]), [1])  # step order matters


def test_optimizer_sha256_sees_moments_step_counts_and_lr():
    def adam(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        return opt

    a, b = adam(0), adam(0)
    assert metrics.optimizer_sha256(a) == metrics.optimizer_sha256(b)
    b.state[b.param_groups[0]["params"][0]]["exp_avg_sq"].view(torch.int32)[0, 0] ^= 1
    assert metrics.optimizer_sha256(a) != metrics.optimizer_sha256(b)
    c = adam(0)
    c.state[c.param_groups[0]["params"][1]]["step"] += 1
    assert metrics.optimizer_sha256(a) != metrics.optimizer_sha256(c)
    d = adam(0)
    d.param_groups[0]["lr"] = 2e-3
    assert metrics.optimizer_sha256(a) != metrics.optimizer_sha256(d)
