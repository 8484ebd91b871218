"""The drill: every question listed in notebook 16's first cell, one evidence section each, and a timer
mode that asks a seeded random selection, each with its answer."""

import json
from pathlib import Path

import nbformat
import pytest

from ddpkit import drill
from ddpkit.config import TrainConfig
from ddpkit.launch import launch

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "16_interview_drill.ipynb"


def test_the_notebook_lists_and_asks_every_question():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for q in drill.QUESTIONS:
        assert q.question in nb.cells[0].source, q.key
        assert sum(f'drill.ask("{q.key}")' in c.source for c in nb.cells if c.cell_type == "code") == 1, q.key
    assert len({q.key for q in drill.QUESTIONS}) == len(drill.QUESTIONS)


def test_rehearse_asks_a_seeded_random_selection_each_with_its_answer(capsys):
    first = drill.rehearse(3, seconds=0, seed=4)
    out = capsys.readouterr().out
    assert first == drill.rehearse(3, seconds=0, seed=4) and len(set(first)) == 3
    for key in first:
        q = drill.question(key)
        assert q.question in out and q.answer in out
    assert drill.rehearse(100, seconds=0, seed=1) != [q.key for q in drill.QUESTIONS]  # shuffled, and capped at all
    assert sorted(drill.rehearse(100, seconds=0, seed=1)) == sorted(q.key for q in drill.QUESTIONS)


def test_an_unknown_question_names_the_known_ones():
    with pytest.raises(KeyError, match="why-ddp"):
        drill.question("nope")


def test_the_silent_failure_evidence_trains_on_one_nth_of_the_data():
    cfg = TrainConfig(steps=10, dataset_size=512, log_every=100)
    broken = launch(drill.train_with_sampler, cfg, kwargs={"partitioned": False}, world_size=2, output="none")
    right = launch(drill.train_with_sampler, cfg, world_size=2, output="none")
    assert broken[0]["ids"] == broken[1]["ids"] and broken[0]["losses"][-1] < broken[0]["losses"][0]
    assert not set(right[0]["ids"][0]) & set(right[1]["ids"][0])
    json.dumps(right)  # plain data, for a notebook's record


# --------------------------------------------------------------------------- the advanced lessons' numbers

def test_context_parallel_answer_counts_the_blocks_the_kit_computes():
    from ddpkit.parallel import context

    zigzag, contiguous = context.block_counts(4, "zigzag"), context.block_counts(4, "contiguous")
    answer = drill.question("context-parallel").answer
    assert zigzag == [9] * 4 and f"costs {zigzag[0]} each" in answer
    assert f"{', '.join(map(str, contiguous[:-1]))} and {contiguous[-1]} query-key blocks" in answer  # the control
    assert sum(zigzag) == sum(contiguous) and max(contiguous) > max(zigzag)  # the same work, balanced only by zig-zag


def test_experts_answer_has_the_kits_capacity():
    from ddpkit.parallel.experts import expert_capacity

    answer = drill.question("experts").answer
    assert f"{expert_capacity(4096, 8, 2, 1.25):,} slots" in answer and "1,280 slots" in answer
    assert f"({expert_capacity(4096, 8, 2, 1.0):,} when perfectly balanced)" in answer
    assert expert_capacity(4096, 8, 2, None) == 8192  # the control: no capacity, nothing dropped, no fixed batch


def test_pipeline_bubbles_answer_is_what_the_simulator_measures():
    from ddpkit.parallel import pipeline_schedules as ps

    over_ideal = {name: ps.bubble_over_ideal(ps.simulate(orders)) for name, orders in
                  (("1f1b", ps.interleaved(4, 8, 1)), ("interleaved", ps.interleaved(4, 8, 2)),
                   ("zb-h1", ps.zero_bubble(4, 8, 1)))}
    within_zbv = ps.bubble_within_ranks(ps.simulate(ps.zbv(4, 8)))
    assert over_ideal == {"1f1b": ps.megatron_bubble(4, 8, 1), "interleaved": ps.megatron_bubble(4, 8, 2),
                          "zb-h1": ps.zb_h1_bubble(4, 8)}
    answer = drill.question("pipeline-bubbles").answer
    said = "1F1B {:.1%}, interleaved v = 2 {:.2%}, ZB-H1 {:.1%}, ZB-V {:.0%} inside each rank".format(
        over_ideal["1f1b"], over_ideal["interleaved"], over_ideal["zb-h1"], within_zbv)
    assert said in answer, said
    # the control: the same simulator counts the stagger ZB-V still pays in one step, and 1F1B's own idle time
    assert ps.bubble_over_ideal(ps.simulate(ps.zbv(4, 8))) > 0 and ps.bubble_within_ranks(ps.simulate(ps.interleaved(4, 8, 1))) > 0


def test_fsdp_knobs_answer_has_the_calculators_bytes():
    from ddpkit.parallel import fsdp_depth, memory

    sizes = [p.numel() for p in fsdp_depth.make_model(64, 4).parameters()]
    held = fsdp_depth.calculator_bytes(sizes, 4)
    answer = drill.question("fsdp-knobs").answer
    assert f"{held['zero3']:,} bytes of fp32 parameters between forward and backward with True, " \
           f"{held['zero3'] + held['zero2']:,} with False (its shard plus the {held['zero2']:,} gathered)" in answer
    fsdp16 = memory.bytes_per_rank(int(7e9), "fsdp2", 16, "bf16-mixed")["total"]
    hsdp8 = memory.bytes_per_rank(int(7e9), "fsdp2", 8, "bf16-mixed")["total"]  # state divided by the shard group only
    assert f"{fsdp16 / 1e9:.1f} GB per GPU under FSDP on 16 GPUs, {hsdp8 / 1e9:.1f} GB under HSDP" in answer
    assert hsdp8 == 2 * fsdp16  # the control: replicating over 2 groups doubles what each GPU holds


def test_tp_in_node_answer_has_the_planners_step_times_and_one_link_class_is_the_control():
    from ddpkit.parallel import plan as planner

    model, cluster = planner.llama2_70b(), planner.seed003_cluster()
    places = planner.placements(model, cluster, planner.SEED003_LAYOUT)
    inside = min(r["step_s"] for r in places if "tp" not in r["spans_nodes"])
    across = min(r["step_s"] for r in places if "tp" in r["spans_nodes"])
    answer = drill.question("tp-in-node").answer
    assert f"takes {inside:.2f} s per step with each tensor-parallel group inside a node and {across:.2f} s with it " \
           f"across nodes ({across / inside:.2f}x)" in answer
    flat = planner.seed003_cluster(inter_bandwidth=cluster.intra.bandwidth, inter_alpha_s=cluster.intra.alpha_s)
    assert len({round(r["step_s"], 9) for r in planner.placements(model, flat, planner.SEED003_LAYOUT)}) == 1
