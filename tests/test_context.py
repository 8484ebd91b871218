"""Sequence parallelism and ring attention from scratch, on real ranks, against the unsplit model, full
attention, PyTorch's SDPA and DTensor's sequence-parallel styles; each mechanism with its negative control."""

import pytest
import torch

from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.parallel import context, context_checks, sequence, sequence_checks

GPT = TrainConfig(model="gpt", n_layers=2)


# --------------------------------------------------------------------------- Megatron sequence parallelism

@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_gpt_equals_the_unsplit_model(tp):
    for rank in launch(sequence_checks.check_against_unsplit, GPT, world_size=tp, output="none"):
        assert rank["output_diff"] <= 1e-6 and rank["grad_diff"] <= 1e-6, rank
        # per block: 2 all-gathers and 2 reduce-scatters forward, +1 all-gather entering the final norm
        assert rank["calls"]["forward all_gather"] == 2 * GPT.n_layers + 1
        assert rank["calls"]["forward reduce_scatter"] == 2 * GPT.n_layers


def test_without_the_gradient_sum_the_layer_norms_are_wrong():  # negative control
    rank = launch(sequence_checks.check_against_unsplit, GPT, 4, False, world_size=2, output="none")[0]
    assert rank["grad_diff"] > 1e-3 and ("ln" in rank["worst_param"] or "bias" in rank["worst_param"]), rank


@pytest.mark.parametrize("tp", [2, 4])
def test_activation_bytes_per_rank_match_the_formula(tp):
    for rank in launch(sequence_checks.measure_block, 2, 64, 32, 4, world_size=tp, output="none"):
        for mode, row in rank.items():
            assert row["measured"] == row["formula"], (mode, row)
        assert rank["sp"]["measured"] * tp == rank["none"]["measured"]  # every stored activation split t ways
        assert rank["sp"]["measured"] < rank["tp"]["measured"] < rank["none"]["measured"]


def test_the_formula_falls_apart_without_sequence_parallelism():  # the replicated part does not shrink
    assert sequence.activation_formula(64, 2, 32, 4, 4, "tp") * 4 > sequence.activation_formula(64, 2, 32, 4, 1)


def test_ours_matches_dtensor_sequence_parallel():
    for rank in launch(sequence_checks.check_against_dtensor, world_size=2, output="none"):
        assert rank["output_diff"] <= 1e-6 and rank["input_grad_diff"] <= 1e-6 and rank["grad_diff"] <= 1e-6, rank
        assert rank["ln_grad_placement"] == "Partial"  # PyTorch, too, owes the LayerNorm's gradient a sum


# --------------------------------------------------------------------------- ring attention

def test_zigzag_layout_round_trips_and_names_positions():
    x = torch.arange(16).view(1, 16)
    shards = [context.shard_sequence(x, r, 4, 1) for r in range(4)]
    assert shards[0].tolist() == [[0, 1, 14, 15]] and shards[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(context.unshard_sequence(shards, 1), x)
    assert context.positions(4, 1, 4).tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="divisible by 8"):
        context.shard_sequence(torch.zeros(1, 12), 0, 4, 1)


def test_zigzag_is_pytorchs_head_tail_layout():
    balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    if not hasattr(balancer, "_HeadTailLoadBalancer"):
        pytest.skip("this torch has no head-tail load balancer")
    order = balancer._HeadTailLoadBalancer(16, 4, "cpu")._generate_indices()[0].tolist()
    ours = torch.cat([context.shard_sequence(torch.arange(16).view(1, 16), r, 4, 1) for r in range(4)], 1)
    assert ours[0].tolist() == order


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_attention_equals_full_attention_and_sdpa(world, layout):
    for rank in launch(context_checks.check_against_full, world_size=world, kwargs={"layout": layout}, output="none"):
        assert rank["max_diff"] <= 1e-5, rank  # output, dQ, dK, dV against both references
        assert rank["blocks"] == rank["expected_blocks"]


def test_without_the_log_sum_exp_rescale_the_ring_is_wrong():  # negative control
    rank = launch(context_checks.check_against_full, world_size=2, kwargs={"rescale": False}, output="none")[0]
    assert rank["diffs"]["sdpa"]["out"] > 0.1 and rank["diffs"]["full"]["out"] > 0.1


def test_zigzag_balances_the_causal_work_and_contiguous_does_not():
    assert context.block_counts(4, "zigzag") == [9, 9, 9, 9]
    assert context.block_counts(4, "contiguous") == [3, 7, 11, 15]  # the negative control: 5x imbalance
    ranks = launch(context_checks.measure_balance, world_size=2, output="none")
    per_block = ranks[0]["zigzag"]["block_flops"]
    assert per_block == 2 * (2 * 2 * 4 * 256 * 256 * 128)  # q k^T and p v, B=2 H=4 c=1024/4 D=128
    # the work, counted by FlopCounterMode as the ring ran it: exact on any machine
    assert [r["zigzag"]["flops"] for r in ranks] == [5 * per_block, 5 * per_block]
    assert [r["contiguous"]["flops"] for r in ranks] == [3 * per_block, 7 * per_block]  # the control: unequal
    # each rank's CPU time, contiguous over zig-zag, follows its FLOPs in direction: 3/5 on rank 0, 7/5 on rank 1
    # (2.0-2.4 apart on a quiet machine, 1.75-2.1 beside two busy processes; shared caches and time the host
    # takes blur it, and with head_dim 32, where the softmax's elementwise work weighs more, it fell to 1.3
    # once under a test run's load); equal work gives 1
    ratio = [r["contiguous"]["compute_cpu_s"] / r["zigzag"]["compute_cpu_s"] for r in ranks]
    assert ratio[1] > ratio[0], ratio


def test_posting_the_next_hop_first_hides_the_communication():
    ranks = launch(context_checks.measure_overlap, world_size=2,
                   kwargs=dict(batch=4, heads=8, seq_len=256, head_dim=64, repeats=11), output="none")
    hidden, exposed = sum(r["overlap"]["on_bytes_s"] for r in ranks), sum(r["serial"]["on_bytes_s"] for r in ranks)
    assert hidden < exposed, (hidden, exposed)  # the same bytes; posted after the block, all of them are waited for
    assert ranks[0]["overlap"]["bytes_sent"] == ranks[0]["serial"]["bytes_sent"] > 0
    for rank in ranks:
        assert len(rank["pairs"]) == 11  # each repeat's two modes, back to back: the notebook's sign test
        for row in (rank["overlap"], rank["serial"]):  # every second blocked is either a late peer or the bytes
            assert row["late_peer_s"] + row["on_bytes_s"] == pytest.approx(row["wait_s"], abs=1e-3), row
    for mode in ("overlap", "serial"):  # every rank reported the same (median) run
        assert ranks[0][mode]["all_ranks_on_bytes_s"] == pytest.approx(sum(r[mode]["on_bytes_s"] for r in ranks))


def test_waiting_for_a_late_peer_is_told_from_waiting_for_the_bytes():
    # this rank posts at 0-1 s and waits 2-10 s; the bytes can only move once both peers have posted
    mine = [[0.0, 1.0, 2.0, 10.0]]
    split = context_checks._blocked_on_bytes(mine, [[7.0, 7.5, 8.0, 9.0]], [[0.5, 0.6, 3.0, 9.0]])
    assert split == pytest.approx({"post_s": 1.0, "late_peer_s": 5.0, "on_bytes_s": 3.0})  # sender posted at 7 s
    punctual = context_checks._blocked_on_bytes(mine, [[0.5, 0.6, 3.0, 9.0]], [[0.5, 0.6, 3.0, 9.0]])
    assert punctual == pytest.approx({"post_s": 1.0, "late_peer_s": 0.0, "on_bytes_s": 8.0})  # both posted before the wait
    late = context_checks._blocked_on_bytes(mine, [[12.0, 12.5, 13.0, 14.0]], [[0.5, 0.6, 3.0, 9.0]])
    assert late == pytest.approx({"post_s": 1.0, "late_peer_s": 8.0, "on_bytes_s": 0.0})  # (clocks slightly off: capped)


def test_activation_bytes_per_rank_fall_as_one_over_n():
    for world in (2, 4):
        for row in launch(context_checks.measure_memory, [128, 256], world_size=world, output="none")[0]:
            assert row["ring"] * world == row["sdpa_one_rank"], row


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_gpt_equals_the_unsplit_model(world):
    for rank in launch(context_checks.check_gpt_against_unsplit, GPT, world_size=world, output="none"):
        assert rank["output_diff"] <= 1e-6 and rank["grad_diff"] <= 1e-6, rank
        assert rank["bytes_split"] * world == rank["bytes_whole"]


def test_torchs_context_parallel_does_not_run_on_cpu():
    rank = launch(context_checks.try_torch_context_parallel, world_size=2, output="none")[0]
    if rank["ran"]:  # a torch that can: then it must agree with ours
        assert rank["diff"] <= 1e-5, rank
    else:  # no CPU rule for the attention op (or, on an older torch, no context_parallel at all)
        assert "does not have a sharding strategy" in rank["error"] or "ImportError" in rank["error"], rank


# --------------------------------------------------------------------------- NCCL's rule, imposed on gloo

def _ring_under_rendezvous(ctx, paired: bool) -> float:
    """Ring attention forward and backward where a send may start only once its matching receive has
    been posted (NCCL's rendezvous; gloo buffers sends and would forgive a bad order). ``paired=False``
    posts each hop's send in a batch of its own, before the receive: the order that deadlocks on NCCL."""
    import collections
    import datetime

    import torch.distributed as dist

    store, real, seen = dist.distributed_c10d._get_default_store(), dist.batch_isend_irecv, collections.Counter()

    def rendezvous(ops):
        for op in ops:  # posting a batch posts all its receives: announce them first
            if op.op is dist.irecv:
                seen["recv", op.peer] += 1
                store.set(f"posted/{op.peer}->{ctx.rank}/{seen['recv', op.peer]}", "1")
        for op in ops:  # a send waits for its receive
            if op.op is dist.isend:
                seen["send", op.peer] += 1
                store.wait([f"posted/{ctx.rank}->{op.peer}/{seen['send', op.peer]}"], datetime.timedelta(seconds=5))
        return real(ops)

    class Unpaired(context._Exchange):
        def __init__(self, tensor, group, stats):
            n, r = dist.get_world_size(group), dist.get_rank(group)
            self.received = torch.empty_like(tensor)
            self.requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, (r + 1) % n, group)])
            self.requests += dist.batch_isend_irecv([dist.P2POp(dist.irecv, self.received, (r - 1) % n, group)])

    dist.batch_isend_irecv = rendezvous
    if not paired:
        context._Exchange = Unpaired
    torch.manual_seed(0)
    q, k, v, dout = (context.shard_sequence(torch.randn(1, 2, 36, 8), ctx.rank, ctx.world_size, dim=2) for _ in range(4))
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    context.ring_attention(*leaves, dist.group.WORLD).backward(dout)
    return float(leaves[0].grad.abs().sum())


def test_the_ring_cannot_deadlock_when_every_send_waits_for_its_receive():
    assert all(g > 0 for g in launch(_ring_under_rendezvous, True, world_size=3, output="none"))


def test_sends_posted_before_their_receives_deadlock_under_that_rule():  # negative control
    from ddpkit.launch import LaunchError

    with pytest.raises(LaunchError, match="wait timeout"):  # every rank's send waits for a receive never posted
        launch(_ring_under_rendezvous, False, world_size=3, output="none", timeout=20)
