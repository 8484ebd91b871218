"""Mixture of experts and expert parallelism from scratch: routing, capacity, drops and the balancing loss
in one process; experts split over real ranks with all-to-all against the single-process layer; each
mechanism with its negative control."""

import pytest
import torch

from ddpkit.config import TrainConfig
from ddpkit.launch import LaunchError, launch
from ddpkit.models import build_model, loss_fn
from ddpkit.parallel import expert_parallel, experts


def test_capacity_drops_what_does_not_fit_and_none_drops_nothing():
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    router = torch.randn(4, 8)
    tight = experts.route(x, router, k=2, capacity_factor=0.5)
    order, kept = tight.order()
    assert tight.capacity == 16 and kept.max() <= 16 and (~tight.kept).sum() == (tight.routed - kept).sum() > 0
    # the assignments kept are each expert's first ones in priority order (all first choices first)
    for e in range(4):
        mine = (tight.expert == e).nonzero().squeeze(1)
        assert tight.kept[mine].tolist() == [True] * min(16, mine.numel()) + [False] * max(0, mine.numel() - 16)
    loose = experts.route(x, router, k=2, capacity_factor=None)
    assert loose.kept.all() and torch.equal(loose.order()[1], loose.routed)


def test_balancing_loss_is_one_when_uniform_and_grows_with_collapse():
    x = torch.randn(64, 8)
    assert abs(float(experts.route(x, torch.zeros(4, 8), 1, None).aux_loss) - 1.0) < 1e-6
    collapsed = torch.zeros(4, 8)
    collapsed[0] = 100.0
    assert float(experts.route(x.abs(), collapsed, 1, None).aux_loss) > 3.9  # E = 4 when one expert takes all


def test_the_auxiliary_loss_reaches_the_router_through_the_output():
    torch.manual_seed(0)
    moe = experts.MoE(8, 4, k=2, aux_coef=0.5)
    x = torch.randn(2, 16, 8)
    moe(x).sum().backward()
    injected = moe.router.weight.grad.clone()
    moe.zero_grad()
    moe.aux_coef = 0.0  # negative control: no injection, then the loss added by hand
    y = moe(x)
    routing = experts.route(x.reshape(-1, 8), moe.router.weight, 2, moe.capacity_factor)
    assert not torch.allclose(injected, torch.autograd.grad(y.sum(), moe.router.weight, retain_graph=True)[0])
    (y.sum() + 0.5 * routing.aux_loss).backward()
    assert torch.allclose(injected, moe.router.weight.grad, atol=1e-7)


def test_a_moe_gpt_trains():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: more threads only spin on a busy machine
    try:
        _train_a_moe_gpt()
    finally:
        torch.set_num_threads(threads)


def _train_a_moe_gpt():
    cfg = TrainConfig(model="gpt", n_layers=2)
    model = experts.moe_gpt(build_model(cfg), num_experts=4, k=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=g)
    losses = []
    for _ in range(15):
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    assert sum(model.blocks[0].mlp.stats["routed"]) == 2 * 8 * cfg.seq_len


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_equals_the_single_process_moe(ep):
    ranks = launch(expert_parallel.check_against_single, world_size=ep, output="none")
    for rank in ranks:
        assert rank["output_diff"] == 0.0 and rank["input_grad_diff"] <= 1e-6, rank
        assert rank["expert_grad_diff"] <= 1e-5 and rank["router_grad_diff"] <= 1e-6, rank
        stats = rank["stats"]
        assert stats["dropped"] > 0 and max(stats["kept"]) <= stats["capacity"]
        assert len(set(stats["send_splits"])) > 1 or len(set(stats["recv_splits"])) > 1  # uneven splits
    assert sum(r["stats"]["dropped"] for r in ranks) == ranks[0]["reference"]["dropped"]  # the same drops


def test_without_capacity_the_split_run_keeps_what_the_reference_drops():  # negative control
    for rank in launch(expert_parallel.check_against_single, world_size=2, kwargs={"ep_capacity": False}, output="none"):
        assert rank["output_diff"] > 1e-3 and rank["stats"]["dropped"] == 0, rank


def test_skipping_the_split_size_exchange_breaks_the_all_to_all():  # negative control
    with pytest.raises(LaunchError):
        launch(expert_parallel.check_against_single, world_size=2, kwargs={"exchange_splits": False},
               output="none", timeout=20)


def test_our_all_to_all_matches_torchs_autograd_all_to_all():
    assert launch(expert_parallel.check_all_to_all_against_torch, world_size=3, output="none") == \
        [{"output_equal": True, "grad_equal": True}] * 3


def test_the_alpha_beta_model_fits_measured_all_to_alls_and_a_latency_alone_does_not():
    """Notebook 18's check of its cost model, and its negative control: the same rounds, modelled by a
    latency alone (no time per byte), fail it."""
    import math
    import statistics

    from ddpkit.parallel.comm import AlphaBeta

    rounds = launch(expert_parallel.measure_all_to_all, [2**10, 2**14, 2**17, 2**20], world_size=2, output="none")[0]
    assert len(rounds) == 20 and all(r[-1]["seconds"] > 0 for r in rounds)
    fitted = expert_parallel.fit_rounds(rounds)
    link, points = fitted["link"], fitted["points"]
    assert link.alpha_s >= 0 and link.bandwidth > 0
    assert points[-1]["seconds"] > points[0]["seconds"]  # a megabyte costs more than a kilobyte
    assert abs(link.seconds(points[-1]["bytes_to_others"]) / points[-1]["seconds"] - 1) < 0.4
    assert fitted["verdict"] != "above", fitted["errors"]
    latency_only = expert_parallel.fit_rounds(rounds, fit=lambda nbytes, seconds: AlphaBeta(statistics.median(seconds), math.inf))
    assert latency_only["verdict"] == "above", latency_only["errors"]
    worst = latency_only["link"].seconds(points[-1]["bytes_to_others"]) / points[-1]["seconds"]
    assert abs(worst - 1) >= 0.4, worst
