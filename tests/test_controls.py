"""Every assert in notebooks 01-16 that tests a mechanism has a negative control, and this file proves it.

The rule: a check that also passes with its mechanism removed proves nothing. "Every rank holds the same
hash" passes for a DDP that never all-reduces if the ranks happen to start equal and train on nothing;
"the resume is exact" passes for a restore that never happened if the run was never stopped. So each
mechanism a lesson asserts is shown to fail the same check once the mechanism is taken out.

``REGISTRY`` below has one entry per ``assert`` statement in the code cells of notebooks 01-16
(``notebooks/01_*.ipynb`` ... ``notebooks/16_*.ipynb``, 10b included), keyed by the notebook's stem and the
assert's message, or, for an assert whose message is not a plain string, by a short substring of its
expression that no other assert of the notebook contains. Each entry says where the control is:

* ``control("tests/test_x.py::test_name")``: a test that runs the real thing with the mechanism removed
  (most monkeypatch the library inside the rank function) and shows the notebook's check failing;
* ``inline("...")``: the notebook asserts the control itself, right there: the text is a substring of
  that assert (often the other half of the same ``assert``, or the comparand of an A-against-B check:
  the run without the mechanism, measured beside the run with it);
* ``sanity("why")``: the assert is no mechanism claim (an input check, a bookkeeping invariant, a
  precondition that makes the next check mean something, "the cell ran what it says", a fact of a
  number format, a timing verdict the cell prints as "not visible" when it cannot see it, ...), with
  the reason. A claim the lesson teaches ("no_sync saves communication", "the checkpoint round-trips",
  "ZeRO-1 holds 12P/N bytes") is never sanity.

The tests here read the notebooks (nbformat + ast) and the test files (ast): no notebook runs and no
test is imported. They fail when an assert has no entry or two, when an entry matches no assert (stale),
when a ``control`` names a test that does not exist, or when an ``inline`` text is in no assert of its
notebook.

To add an assert to a notebook: add its entry here, under the notebook's stem. If it tests a mechanism
and nothing removes that mechanism yet, write the control first: a test in
``tests/test_negative_controls.py`` (lessons 01-08) or ``tests/test_negative_controls_advanced.py``
(09-16), or in the library module's own test file, that runs real ranks with the mechanism taken out and
asserts the notebook's check fails (fast, tiny configs, no timing threshold that load can flip).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for p in (REPO / "notebooks").glob("*.ipynb") if re.match(r"(0[1-9]|1[0-6])[_b]", p.name))


@dataclass(frozen=True)
class Entry:
    kind: str  # control | inline | sanity
    text: str  # the test's path::name, the control's substring, or the reason


def control(test: str) -> Entry:
    """A test that removes the mechanism and shows the same check failing."""
    return Entry("control", test)


def inline(substring: str) -> Entry:
    """The notebook asserts the control itself: ``substring`` is part of that assert."""
    return Entry("inline", substring)


def sanity(why: str) -> Entry:
    """Not a mechanism claim, and why."""
    return Entry("sanity", why)


NC = "tests/test_negative_controls.py::"
NCA = "tests/test_negative_controls_advanced.py::"

REGISTRY: dict[str, dict[str, Entry]] = {
    "01_config": {
        "every module says what it does": sanity("documentation: every module the map names has a docstring"),
        "cfg.global_batch_size == cfg.micro_batch_size * cfg.grad_accum * cfg.world_size": sanity(
            "the formula the cell prints, read back from the property the trainer uses (a definition); that the "
            "trainer consumes that many samples a step is the topology check's data_sha256, controlled below"),
        '"larger than the dataset" in message': sanity("an input check: the config refuses an impossible batch"),
        "hash() differs in every process": inline("len(set(digests)) == 1"),
        "len(set(digests)) == 1": inline("hash() differs in every process"),
        "done.returncode == 0": sanity("the cell ran what it says: the fresh interpreter finished"),
        "{c.digest() for c in same} == {cfg.digest()}": inline("all(c.digest() != cfg.digest() for c in different)"),
        "all(c.digest() != cfg.digest() for c in different)": inline("{c.digest() for c in same} == {cfg.digest()}"),
        "c.global_batch_size == global_batch": sanity("an input check: the three topologies are built with one global batch"),
        "same global samples in every topology": control(NC + "test_topology_keeps_the_sample_stream_only_with_the_global_batch_kept"),
        "worst < 1e-4": control(NCA + "test_ddp_equals_one_process_only_because_it_averages_gradients"),
        "the same lr with a k-times bigger batch learns far less from the same samples": inline("rescaling the lr helps"),
        "rescaling the lr helps": inline('scaling["lr x 1"]["final"] > 2 * ref_final'),
        "a rescaled lr comes close to the reference": inline('scaling["lr x 1"]["final"] > 2 * ref_final'),
    },
    "02_sampler": {
        "not report.ok and len(report.duplicates) == dataset_size": inline("all(rep.ok for rep in reports)"),
        "every epoch is a partition": inline("not report.ok and len(report.duplicates) == dataset_size"),
        "deterministic: the same partition on every run": control(
            NC + "test_a_sampler_whose_shuffle_is_not_seeded_deals_another_partition_each_run"),
        "a new order every epoch": control(NC + "test_without_the_epoch_in_its_seed_the_sampler_repeats_its_order_and_leaves_torchs"),
        "bitwise PyTorch's own sampler": control(
            NC + "test_without_the_epoch_in_its_seed_the_sampler_repeats_its_order_and_leaves_torchs"),
        "defaults: the group's world size and rank": control(NC + "test_outside_a_process_group_the_sampler_has_no_defaults"),
        "statistics.mean(ranks[0][0][-3:]) < statistics.mean(ranks[0][0][:3])": sanity(
            "both runs train: the lesson's point is that the loss cannot tell the broken sampler from the right one "
            "(the partition checks below can)"),
        'wrong_sampler["correct sampler"]["duplicates"] == wrong_sampler["correct sampler"]["omitted"] == 0': inline(
            'wrong_sampler["same samples on every rank"]["duplicates"] > 0'),
        'wrong_sampler["same samples on every rank"]["duplicates"] > 0': inline(
            'wrong_sampler["correct sampler"]["duplicates"] == wrong_sampler["correct sampler"]["omitted"] == 0'),
        "without[0] == without[1] and with_epochs[0] != with_epochs[1]": inline("with_epochs[0] != with_epochs[1]"),
        "iterating the DataLoader never advanced the epoch": inline("called[0] != called[1]"),
        "called[0] != called[1]": inline("iterating the DataLoader never advanced the epoch"),
        "per_epoch[0] == dataset_size // world_size": inline("all(rep.ok for rep in reports)"),
        "h.consumed > trained": control(NC + "test_the_handbook_sampler_overcounts_only_because_workers_prefetch"),
        "[a + b for a, b in zip(before, after)] == full": control(
            NC + "test_a_mid_epoch_resume_continues_the_partition_only_because_the_sampler_skips_what_was_consumed"),
        "one_rank.global_batch_size == with_workers.global_batch_size": sanity(
            "an input check: the one-rank resume keeps the global batch (with accumulation)"),
        'resumed["resumed_from_step"] == steps // 2': sanity("the cell ran what it says: the resume started at the checkpoint"),
        "the same samples in the same steps": control(
            NCA + "test_a_per_rank_data_position_does_not_continue_the_stream_on_another_world_size"),
        "the same training, up to float summation order": control(
            NCA + "test_a_per_rank_data_position_does_not_continue_the_stream_on_another_world_size"),
        "padded with repeats, nothing missing": control("tests/test_facts.py::test_drop_last_false_pads_with_repeated_samples"),
        "the padded copy is counted": inline('abs(evaluation[0]["sum / count, padding removed"] - true_mean) < 1e-6'),
        'abs(evaluation[0]["sum / count, padding removed"] - true_mean) < 1e-6': inline("padded != true_mean"),
        "within a rank, PyTorch gives each worker its own torch seed": inline('same[0]["own"][0] == same[0]["own"][1]'),
        "same seed on every rank: worker 0 draws the same noise on rank 0 and rank 1": inline(
            'fixed_noise[0]["torch"][0] != fixed_noise[1]["torch"][0]'),
        "an RNG built in __init__ is copied into every worker unchanged": inline(
            'fixed_noise[0]["own"][0] != fixed_noise[0]["own"][1]'),
        'fixed_noise[0]["torch"][0] != fixed_noise[1]["torch"][0]': inline('same[0]["torch"][0] == same[1]["torch"][0]'),
    },
    "03_model_optimizer": {
        "one state entry per parameter": sanity("bookkeeping: AdamW makes its state on the first step, one entry per tensor"),
        "AdamW: exp_avg + exp_avg_sq, each the size of the parameter": control(
            NC + "test_the_optimizer_holds_twice_the_weights_only_because_adamw_keeps_two_moments"),
        "12P of optimizer state in mixed precision": control(
            NC + "test_mixed_precision_holds_12_bytes_a_parameter_only_with_an_fp32_master_copy"),
        "the matmuls ran in bf16": control(NC + "test_autocast_computes_in_bf16_and_holds_fp32_state_and_a_cast_model_does_not"),
        "autocast keeps weights, gradients and Adam state in fp32": control(
            NC + "test_autocast_computes_in_bf16_and_holds_fp32_state_and_a_cast_model_does_not"),
        "16 bytes per parameter, no master copy": control(
            NC + "test_autocast_computes_in_bf16_and_holds_fp32_state_and_a_cast_model_does_not"),
        "each rank really started from its own initialisation": sanity(
            "the experiment's precondition: the ranks start apart, so the next check can see the broadcast"),
        "wrapping in DDP broadcast rank 0's weights to every rank": control(
            NC + "test_replicas_start_equal_only_because_ddp_broadcasts_at_wrap"),
        "...and they are rank 0's": sanity(
            "names the broadcast's source: rank 0 keeps its own weights with or without the broadcast, so this "
            "is no check of the broadcast (the assert before it is, with its control)"),
        "DDP: bitwise equal parameters after every step": inline("same start, no DDP: apart from step 1"),
        "parameters and Adam state in lock-step": inline('distinct(no_ddp, "params") == world_size'),
        "same start, no DDP: apart from step 1": inline("DDP: bitwise equal parameters after every step"),
        'distinct(no_ddp, "params") == world_size': inline("parameters and Adam state in lock-step"),
        'distinct(lr_bug, "params") == world_size': inline("parameters and Adam state in lock-step"),
        "one rank-local hyper-parameter breaks lock-step from the first step": inline(
            "DDP: bitwise equal parameters after every step"),
        'len({s["param_sha256"] for s in summaries}) == 1': control(
            NC + "test_the_trainers_replicas_hold_one_hash_only_because_ddp_all_reduces"),
        "the trainer computes exactly the hand-written loop above": control(
            NC + "test_the_trainers_replicas_hold_one_hash_only_because_ddp_all_reduces"),
        "rank 0's buffers, everywhere, at the first forward": inline("buffers[False] == [float(r) for r in range(world_size)]"),
        "each rank's own": inline("buffers[True] == [0.0] * world_size"),
        "list(synced.values()) ==": inline("buffers[False] == [float(r) for r in range(world_size)]"),
        'unused[True] == "trained 4 steps"': inline('"Expected to have finished reduction" in unused[False]'),
        '"Expected to have finished reduction" in static["neither"]["outcome"]': inline(
            'static["static_graph"]["outcome"] == static["find_unused_parameters"]["outcome"]'),
        'static["static_graph"]["outcome"] == static["find_unused_parameters"]["outcome"]': inline(
            '"Expected to have finished reduction" in static["neither"]["outcome"]'),
        "the same averaged gradients": sanity(
            "two DDP options compared with each other (each trains: the assert before), not a mechanism with its "
            "absence; DDP's averaging has its own controls (03's lock-step, 16's DDP against one process)"),
    },
    "04_distributed_init": {
        "every rank exactly once": sanity("bookkeeping: launch returns one result per rank, in rank order"),
        "the context agrees with torch.distributed": sanity("bookkeeping: the RankContext and the process group agree"),
        "one process per rank, none of them this kernel": control(
            NC + "test_ranks_are_processes_of_their_own_only_because_the_launcher_starts_them"),
        'all(r["all_reduce"] == world_size * (world_size - 1) / 2 for r in table)': sanity(
            "the cell ran what it says: the ranks formed one group (an all-reduce of the rank ids sums them)"),
        'sum(r["is_main"] for r in table) == 1': sanity("bookkeeping: exactly one rank is the main one"),
        "local_rank picks the GPU": sanity(
            "on the CPU every rank's device is 'cpu' (gloo); the GPU mapping runs only on a GPU (tests/test_gpu.py)"),
        "nothing leaked into the kernel": sanity(
            "a property of the design, not a mechanism to remove: each rank sets RANK and MASTER_PORT in its own "
            "process, never in the kernel's; what the launcher does set here (OMP_NUM_THREADS) it restores, "
            "tests/test_launch.py::test_fifty_launches_leak_nothing"),
        "one intra-op thread per forked rank (see below)": control(
            NC + "test_forked_ranks_run_one_thread_only_because_the_launcher_sets_it"),
        'refusal is not None and ("--backend gloo" in refusal': sanity("an input check: NCCL without a GPU per rank is refused"),
        "divide, then SUM: right on every backend": control(NC + "test_an_all_reduce_averages_only_when_divided_by_the_world_size"),
        "where gloo has AVG, it divides by the world size": control(
            NC + "test_an_all_reduce_averages_only_when_divided_by_the_world_size"),
        "every rank learned the same address book": control(
            NC + "test_ranks_share_an_address_book_only_through_one_store_and_check_in_once_only_by_an_atomic_add"),
        'sorted(p["checked_in"] for p in peers)': control(
            NC + "test_ranks_share_an_address_book_only_through_one_store_and_check_in_once_only_by_an_atomic_add"),
        'proc.returncode == 0 and len(seen) == world_size and all("argv=[]"': sanity(
            "the cell ran what it says: torchrun started every worker with the probe"),
        "torchrun's agent hosts the store": control(NC + "test_torchruns_environment_comes_from_its_agent_and_its_thread_rule"),
        "torchrun set one thread per worker (nproc-per-node > 1)": control(
            NC + "test_torchruns_environment_comes_from_its_agent_and_its_thread_rule"),
        'report.rank == world_size - 1 and report.root_cause.kind == "stalled"': control(
            NC + "test_the_stalled_rank_is_named_only_because_its_timed_out_peers_are_set_aside"),
        "elapsed < timeout_s + 5": control(NC + "test_a_stalled_rank_is_given_up_on_only_within_the_timeout"),
    },
    "05_train_step": {
        "cfg.global_batch_size == 16": sanity("an input check: every split keeps a global batch of 16"),
        "worst < 1e-6 and len(hashes) == 1": control(
            NC + "test_accumulation_equals_the_big_batch_only_with_the_loss_divided_by_grad_accum"),
        "one_round >= 1": sanity("the baseline the next checks multiply is not empty"),
        'no_sync["no no_sync"]["calls"] == 4 * one_round': control(
            NC + "test_the_trainer_communicates_once_per_step_only_because_of_no_sync"),
        "forward outside no_sync: nothing saved": control(
            "tests/test_train.py::test_no_sync_skips_communication_only_with_forward_inside"),
        'no_sync["backward-only no_sync"]["bytes"] == 4 * no_sync["ddpkit train_step"]["bytes"]': inline(
            'no_sync["ddpkit train_step"]["bytes"]'),
        'memory["as_view=False"]["distinct_bytes"] == 2 * memory["as_view=False"]["param_bytes"]': inline(
            "grads live inside the buckets"),
        "grads live inside the buckets": inline('memory["as_view=False"]["distinct_bytes"] == 2'),
        'not pitfalls[False]["kept_gradient_changed"]': inline('pitfalls[True]["kept_gradient_changed"]'),
        'pitfalls[False]["detach_"] == "allowed"': inline('pitfalls[True]["detach_"] != "allowed"'),
        "set_to_none=True: every gradient copied into its bucket, every step": inline(
            "set_to_none=False: after the first step autograd writes into the bucket"),
        "set_to_none=False: after the first step autograd writes into the bucket": inline(
            "set_to_none=True: every gradient copied into its bucket, every step"),
        "ran_in == {name: dtype or torch.float32": sanity("the cell ran what it says: each row ran the precision it names"),
        '(seen == "above") == expect_faster': sanity(
            "timing: bf16 against fp32 by a sign test on paired rounds; the cell asserts only a settled verdict and "
            "prints 'not visible' when the rounds disagree"),
        "bf16 autocast keeps smaller activations for backward": inline('act["fp32"]["activations"]'),
        "autocast keeps bf16 weight copies": inline('10 * act["fp32"]["weights and casts"]'),
        'default_precision == "highest" and switch == {"high": True, "highest": False}': inline('"highest": False'),
        "logits.dtype == torch.bfloat16 and all(p.dtype == torch.float32": control(
            NC + "test_autocast_computes_in_bf16_and_holds_fp32_state_and_a_cast_model_does_not"),
        "round to nearest: half the smallest subnormal goes to 0": sanity(
            "a fact of the fp16 format on this torch (also tests/test_facts.py): the line the histogram draws"),
        "below fp16's smallest normal (2^-14) precision falls off: subnormals": sanity(
            "a fact of the fp16 format on this torch: the relative error of a conversion above and below 2^-14"),
        "float((fp32 == 0).float().mean()) == 0.0": sanity(
            "the precondition: no fp32 gradient is zero, so every zero below is an underflow"),
        "fp16 without scaling loses the small gradients": inline('underflow["fp16 + scale 2^16"]["zero_fraction"] < 0.01'),
        'underflow["fp16 + scale 2^16"]["zero_fraction"] < 0.01': inline("fp16 without scaling loses the small gradients"),
        "bf16 needs no scaler": inline("fp16 without scaling loses the small gradients"),
        "the gradient is large enough that clipping matters": sanity("the precondition: the norm is above max_norm"),
        'clipping["unscale, then clip"]["rel_diff"] < 1e-5': inline("clipping before unscale shrinks the update ~65536x"),
        "clipping before unscale shrinks the update ~65536x": inline('clipping["unscale, then clip"]["rel_diff"] < 1e-5'),
        "SGD: the update shrinks by the loss scale": inline('clipping["unscale, then clip"]["rel_diff"] < 1e-5'),
        "AdamW: much less, but still wrong": inline('clipping["unscale, then clip"]["rel_diff"] < 1e-5'),
        "autocast is on although AMP is off": inline("meant_dtype == torch.float32"),
        "handbook.steps == 4 and ours.steps == 1": inline("ours.steps == 1"),
        "one 25 MiB bucket: one all-reduce of every gradient byte": inline("smaller buckets: more calls, the same bytes"),
        "smaller buckets: more calls, the same bytes": inline("one 25 MiB bucket: one all-reduce of every gradient byte"),
        "fp16 compression: half the bytes": inline('all(s == {"calls": 1, "bytes": grad_bytes} for s in plain)'),
        "PowerSGD: plain at first, then a small fraction": inline('psgd[0]["bytes"] == grad_bytes'),
    },
    "06_checkpoint": {
        "stop_at must fall inside the run": sanity("an input check on the parameters"),
        'set(state) == {"model", "optimizer"': sanity(
            "bookkeeping: names what a checkpoint holds; that it is enough is the exact resume, whose control is the "
            "weights-only resume"),
        "every rank's RNG state, not just rank 0's": control(NC + "test_a_checkpoint_holds_every_ranks_rng_only_because_they_are_gathered"),
        'state["train"]["step"] == stop_at': sanity("bookkeeping: the checkpoint is the one the run wrote at stop_at"),
        "weights + 2 Adam moments, plus small state": control(
            NC + "test_a_checkpoint_is_three_times_the_weights_only_because_adamw_keeps_two_moments"),
        "one writer vs every rank": inline('full["writers"] == 1'),
        "the same state, the same bytes": sanity("a cross-check of the two formats: both wrote the same state"),
        "sharded: the busiest writer writes about 1/N": inline('0.75 * full["largest_writer_bytes"]'),
        'resumed["resumed_from_step"] == stop_at': sanity("the cell ran what it says: the resume started at the checkpoint"),
        "bitwise equal parameters": inline("then it departs"),
        "bitwise equal optimizer state": control(
            NCA + "test_the_capstone_resume_is_exact_only_with_the_optimizer_shards_restored"),
        "the same samples in the same steps": control(
            NCA + "test_a_per_rank_data_position_does_not_continue_the_stream_on_another_world_size"),
        "the same loss at every step": inline("then it departs"),
        "same data": sanity("the experiment's precondition: the weights-only resume reads the same samples"),
        "same weights on the same batch: the same first loss": sanity(
            "the experiment's precondition: the weights were restored, so what departs afterwards is the optimizer state"),
        "then it departs": inline("bitwise equal parameters"),
        "chosen.name == names[1]": control(NC + "test_a_torn_newest_checkpoint_is_chosen_once_verification_is_removed"),
        'after_tear["resumed_from_step"] == checkpoint.step_of(chosen)': inline("then it departs"),
        "the next save cleans up the dead temporary folder": control(
            NC + "test_dead_temporary_folders_stay_once_the_sweep_is_removed"),
        "mtime would resume from the oldest checkpoint": inline("checkpoint.step_of(by_step)"),
        "refusals[case] and expected in refusals[case]": control(
            NC + "test_crafted_bad_resumes_are_accepted_once_the_resume_checks_are_removed"),
        'cadence[cadences[0]]["saves"] == max(cadences)': sanity("bookkeeping: each cadence saved as often as it says"),
        "saving often costs": inline('2 * cadence[cadences[-1]]["checkpoint_share"]'),
        "every gap within every_s + one step": control(NC + "test_saves_stay_within_every_s_only_because_the_clock_is_checked"),
        "the time trigger bounds the lost work when steps slow down; the step trigger does not": inline("by_steps"),
    },
    "07_metrics": {
        "one JSONL file per rank": sanity("the log's layout, as the contract states it"),
        "a step event per rank per step": sanity("the log's layout: one step event per rank per step"),
        "console on rank 0 only": control(NC + "test_only_rank_0_prints_the_loss_table_because_the_logger_asks_is_main"),
        "the global loss is the same on every rank": inline('per_rank(base, 0, "local_loss") != per_rank(base, 1, "local_loss")'),
        "each rank's own batch loss differs": inline('all(per_rank(base, r, "loss") == loss for r in range(world_size))'),
        "it learns": sanity("the run trains (the default task is learnable: tests/test_train.py)"),
        "a slow dataset makes the step input-bound": inline('share["baseline"]'),
        "workers hide the loading": inline('breakdown["slow data"]["data_s"] / 2'),
        "kept workers start the next epoch sooner": inline("later[False]"),
        "median(comm) > 0 and": sanity(
            "the measurement is live: the hook timed some communication and counted every gradient byte, the "
            "precondition of the two comparisons below"),
        "the remainder reads ~0: it misses the communication": control(
            "tests/test_debugging.py::test_ddp_hides_communication_behind_backward_and_a_loop_after_backward_does_not"),
        "the all-reduce happens inside backward": control(
            "tests/test_debugging.py::test_ddp_hides_communication_behind_backward_and_a_loop_after_backward_does_not"),
        "saved == list(range(10, steps + 1, 10))": sanity("bookkeeping: the run saved every 10 steps"),
        "saves are spikes": inline("1.5 * plain"),
        "at least half the saves stand out one by one (a busy machine blurs the rest)": inline("1.5 * plain"),
        "the straggler's own time went into loading": inline('straggler[0]["data_s"] < 0.3 * slow_ms'),
        "the healthy rank is slowed by about as much": control(NC + "test_a_straggler_slows_a_healthy_rank_only_through_a_collective"),
        "...waiting inside backward, for the all-reduce": control(
            NC + "test_a_straggler_holds_the_healthy_rank_inside_backward_only_through_ddps_all_reduce"),
    },
    "08_launch": {
        "the kill must come after the first checkpoint and before the end": sanity("an input check on the parameters"),
        "the root cause is rank 1": control(NC + "test_the_killed_rank_is_named_only_because_knock_on_failures_are_set_aside"),
        'report.root_cause.kind == "killed"': control(
            NC + "test_a_killed_rank_is_reported_killed_by_sigkill_only_because_its_exit_signal_is_read"),
        "said once": sanity("the report's wording: the signal is named once"),
        "the other ranks are listed as knock-on or stopped, not as causes": control(
            NC + "test_the_killed_rank_is_named_only_because_knock_on_failures_are_set_aside"),
        "the survivor failed at once, not at the timeout": control(
            NCA + "test_a_rank_that_hangs_instead_of_dying_keeps_its_peers_waiting"),
        'restarted["resumed_from_step"] == fail_at_step // checkpoint_every': sanity(
            "bookkeeping: the restart resumed from the newest checkpoint before the kill"),
        'restarted["param_sha256"] == clean["param_sha256"]': control(
            "tests/test_train.py::test_weights_only_resume_sees_the_same_data_but_departs"),
        'restarted["losses"] == clean["losses"]': control("tests/test_train.py::test_weights_only_resume_sees_the_same_data_but_departs"),
        "len(redone) == lost": sanity("bookkeeping: the plot's redone steps are the lost ones"),
        '[e["step"] for e in saves] == list(range(': sanity("bookkeeping: the saves the plot marks are the cadence's"),
        'proc.returncode == 0 and "rank 1 killed: SIGKILL" in proc.stdout': control(
            "tests/test_cli.py::test_without_restarts_the_failure_names_the_rank"),
        'cli["restarts"] == 1 and cli["param_sha256"] == clean["param_sha256"]': control(
            "tests/test_cli.py::test_without_restarts_the_failure_names_the_rank"),
        'proc.returncode == 0 and tr["restarts"] == 1': control(NC + "test_torchrun_without_restarts_ends_the_killed_run_in_failure"),
    },
    "09_collectives": {
        "all-reduce: everyone has the sum": control(NCA + "test_without_their_exchange_the_collectives_leave_every_rank_its_own_tensor"),
        "broadcast: everyone has rank 0's": control(NCA + "test_without_their_exchange_the_collectives_leave_every_rank_its_own_tensor"),
        "reduce-scatter: the sum, sliced": control(NCA + "test_without_their_exchange_the_collectives_leave_every_rank_its_own_tensor"),
        "all-gather: every slice": control(NCA + "test_without_their_exchange_the_collectives_leave_every_rank_its_own_tensor"),
        "the hand-written ring must equal gloo's all_reduce bit for bit": control(
            NCA + "test_a_ring_that_adds_in_another_order_is_not_bitwise_gloo"),
        "2(N-1)/N x M per rank": control(NCA + "test_a_ring_that_passes_the_whole_buffer_sends_n_times_the_ring_formula"),
        "small messages are latency-bound: far lower bandwidth": inline('10 * small["algbw"]'),
        "no collective between processes beats a memory copy": sanity(
            "a bound, not a mechanism: bytes moved between processes go through memory, so a plain copy is the "
            "ceiling; nothing can be taken out that would lift a collective above it"),
        "np.median(errors) < 0.5": control("tests/test_cost.py::test_a_whole_calls_alpha_charged_per_message_double_counts_the_latency"),
        'check["ok"]': control(NCA + "test_the_scaling_model_misses_a_ddp_step_whose_all_reduce_is_removed"),
        "hidden communication + stragglers reproduce the table's shape within 5 points": inline(
            "without stragglers no hidden share reproduces it: the curve is flat past one node"),
        "without stragglers no hidden share reproduces it: the curve is flat past one node": inline(
            "hidden communication + stragglers reproduce the table's shape within 5 points"),
        "the text's 86% and 47%": sanity(
            "the cost model's arithmetic against the numbers seed 003's text derives by hand (one link class "
            "inside a node, InfiniBand past it); the model against real ranks is cell 15's check"),
    },
    "10_sharding": {
        "at 2 ranks, without clipping, ZeRO-1's parameters are DDP's bit for bit": inline("not bitwise[1.0]"),
        "with clipping on, the two norms are summed in another order and the weights differ in their last bits": inline(
            "at 2 ranks, without clipping, ZeRO-1's parameters are DDP's bit for bit"),
        'same[s]["ok"]': control(NCA + "test_zero1_without_averaging_no_longer_trains_ddps_model"),
        'ranks[0]["losses"][-1]["loss"] < 0.6 * ranks[0]["losses"][0]["loss"]': sanity("every strategy's run trains"),
        "the calculator must match the measurement within 5%": control(NCA + "test_the_fsdp2_check_fails_for_a_flat_calculator"),
        "ours: 12 bytes x ceil(P/N)": control(NCA + "test_zero1_holds_12_bytes_x_ceil_p_over_n_only_because_it_shards_its_state"),
        'opt["zero1"] < opt["ddp"]': inline('opt["ddp"]'),
        "FSDP2: about 1/N of DDP's optimizer state": inline('opt["ddp"] * (1 / world_size + 0.05)'),
        "seed 003's 98 / 49 / 36.75 / 12.25 GB": sanity(
            "the calculator's arithmetic under seed 003's accounting, against its table; the calculator against "
            "real ranks is cell 9's check, with its control"),
        "7B: ZeRO-1 fits from 2 GPUs (14 + 14 + 84/2 = 70 GB), FSDP from 2 (56 GB)": sanity(
            "the calculator's arithmetic, spelled out in the message; the calculator against real ranks is cell 9's check"),
        "70B: only FSDP fits, from 1120/80 = 14 GPUs": sanity(
            "the calculator's arithmetic, spelled out in the message; the calculator against real ranks is cell 9's check"),
        "where FSDP2 can run on the CPU, its bytes are measured": sanity("the cell ran what it says: FSDP2's bytes were measured"),
        "FSDP2 pays for its memory with communication: about 1.5x DDP's bytes": control(
            NCA + "test_without_the_second_all_gather_fsdp2_moves_no_more_than_ddp"),
        "recomputation gives the same gradients, bit for bit": sanity(
            "an equivalence: checkpointing must not change the arithmetic (the same model with and without it); "
            "what it changes, the memory kept, is the next check"),
        "checkpointing keeps only each block's input": inline("kept[False] / 4"),
        "recomputation costs compute: the pairs say it costs less than 10%": control(
            "tests/test_timing.py::test_without_recomputation_the_activation_checkpointing_check_fails"),
    },
    "10b_fsdp2_in_depth": {
        'z3["per_step"]["forward_all_gather"] == z3["per_step"]["backward_all_gather"] == units': inline(
            'z2["per_step"]["backward_all_gather"] == 0'),
        'z2["per_step"]["forward_all_gather"] == units': inline(
            'z3["per_step"]["forward_all_gather"] == z3["per_step"]["backward_all_gather"] == units'),
        'z3["held_between"] == expected["zero3"]': inline('z2["held_between"] == expected["zero3"] + expected["zero2"]'),
        'all(h["after_step"] == {"sharded": expected["zero3"], "unsharded": 0} for h in z2["held"])': inline(
            'z2["held_between"] == expected["zero3"] + expected["zero2"]'),
        "same arithmetic, another memory schedule": sanity(
            "an equivalence: two memory schedules of one computation give the same losses"),
        "fsdp_vs_ddp < 1e-5": inline("hsdp_gap < 1e-5 < alone_gap"),
        'runs[0]["order"][:2] == ["all_gather", "unit_start0"]': inline('runs[0]["order"][:2] == ["all_gather", "unit_start0"]'),
        "two units gathered ahead of the first unit's backward": control(
            "tests/test_fsdp_depth.py::test_forward_prefetch_gathers_ahead_and_holds_more_units"),
        'r["order"].count("all_gather") == r["backward_all_gather"] == units': control(
            "tests/test_fsdp_depth.py::test_forward_prefetch_gathers_ahead_and_holds_more_units"),
        "backward: FSDP2 prefetches one unit unless told more": control(
            "tests/test_fsdp_depth.py::test_forward_prefetch_gathers_ahead_and_holds_more_units"),
        "control: a thread blocked in the collective computes nothing": inline('overlap["verdict"] != "below"'),
        "prefetch never hides less than blocking gathers": control(
            "tests/test_fsdp_depth.py::test_overlap_negative_control_blocking_against_itself_is_never_above"),
        'bf16["dtypes"]["all_gather"] == ["bfloat16"]': control(
            "tests/test_fsdp_depth.py::test_mixed_precision_gathers_bf16_and_reduces_fp32"),
        '2 * bf16["bytes_per_step"]["all_gather"] == z3["bytes_per_step"]["all_gather"]': inline(
            'z3["bytes_per_step"]["all_gather"]'),
        "close to fp32 (bf16 keeps about 2-3 decimal digits), not equal": inline("0 < gap"),
        "measured: 7 stored bits put bf16 numbers 2^-7 apart in [1, 2), 2^-5 in [4, 8)": sanity(
            "a fact of the bf16 format, measured on this torch: the spacing the next two checks rely on"),
        'lost["bf16"] == 1.0 and abs(lost["fp32"]': inline('abs(lost["fp32"] - (1 + 100 * 2.0 ** -9)) < 1e-6'),
        'kept["bf16"] == kept["fp32"] == 1 + 4 * 2.0 ** -6': inline('lost["bf16"] == 1.0'),
        'off["losses"] == z3["losses"] and off["param_device"] == "cpu"': sanity(
            "on the CPU nothing leaves a device: the offloaded run is checked equal to the plain one, the offload "
            "itself can only be seen on a GPU"),
        'moved["state_off_device"] == 4 * shard': sanity(
            "the bytes an offload would move, from the run's measured shard and collectives and the memory "
            "calculator (nothing moves on the CPU); the calculator against real ranks is notebook 10's check"),
        'hsdp["placements"] == ["R", "S(0)"]': sanity(
            "bookkeeping: the mesh's placements name the layout; what it does is the next two checks"),
        'hsdp["per_step"]["backward_all_reduce"] == hsdp["units"]': inline('alone["per_step"]["backward_all_reduce"] == 0'),
        "hsdp_gap < 1e-5 < alone_gap": inline("1e-5 < alone_gap"),
        'count("allgather", "all_gather") ==': sanity("two counters of one run agree: CommDebugMode's and FSDP2's own log"),
        'count("reduce_scatter") ==': sanity("two counters of one run agree: CommDebugMode's and FSDP2's own log"),
        "2 row-parallel outputs in forward + 1 column-parallel input gradient": sanity(
            "counts the all-reduces torch's own tensor parallelism issues (CommDebugMode) against Megatron's 2 + 1; "
            "tensor parallelism without them is no tensor parallelism, and that the backward one is what makes the "
            "split model right is shown with it removed in tests/test_negative_controls_advanced.py "
            "(test_without_fs_all_reduce_the_split_gpt_no_longer_matches_the_whole_one)"),
        "tp_gap < 1e-5": control("tests/test_fsdp_depth.py::test_tensor_parallel_inside_fsdp2_matches_ddp_over_dp"),
    },
    "11_sharded_checkpoint": {
        'resumed["resumed_from_step"] == steps // 2 and resumed["world_size"] == resume_world': sanity(
            "the cell ran what it says: the resume started at the checkpoint, on the other layout"),
        "the identical global sample stream": control(
            NCA + "test_a_per_rank_data_position_does_not_continue_the_stream_on_another_world_size"),
        "the same training, up to the order of floating-point sums": control(
            NCA + "test_a_per_rank_data_position_does_not_continue_the_stream_on_another_world_size"),
        "replicated: one chunk; sharded: one per rank": inline('len(chunks["ddp x4"]) == 1'),
        "two collectives in opposite orders on one gloo group are paired wrongly": inline("separate == [True, True]"),
        "on separate groups both streams complete correctly": inline('shared_group != "no failure"'),
        "dcp spreads the I/O: every rank writes a part": inline('0.5 * costs["full"]["bytes"]'),
        "a full save pushes the whole state through one writer: its write takes longer than the busiest DCP rank's": control(
            NCA + "test_without_sharding_the_busiest_writer_writes_no_faster"),
        "the same state either way, plus dcp's metadata": sanity("a cross-check of the two formats: both wrote the same state"),
        "the async checkpoint is complete and verifies": inline(
            "two collectives in opposite orders on one gloo group are paired wrongly"),
        "async: training waits only for the snapshot": inline('0.5 * costs["dcp"]["seconds"]'),
    },
    "12_tensor_parallel": {
        'all(d[s]["output_diff"] <= 1e-6 and d[s]["input_grad_diff"] <= 1e-6': control(
            NCA + "test_without_fs_all_reduce_the_split_gpt_no_longer_matches_the_whole_one"),
        "the split GPT computes the whole one": control(NCA + "test_without_fs_all_reduce_the_split_gpt_no_longer_matches_the_whole_one"),
        "2 per block each way": control(NCA + "test_without_fs_all_reduce_the_split_gpt_no_longer_matches_the_whole_one"),
        'all(d["output_diff"] <= 1e-6 and d["grad_diff"] <= 1e-6 and d["same_local_shapes"]': control(
            NCA + "test_without_fs_all_reduce_the_split_gpt_no_longer_matches_the_whole_one"),
        'same["ok"]': control(NCA + "test_tp_peers_fed_by_a_sampler_over_the_world_do_not_train_ddps_model"),
        "the blocks are split over tp ranks, the embeddings and the head are not: less per rank, but more than 1/tp": inline(
            "1 / tp < ratio < 1"),
    },
    "13_pipeline_parallel": {
        'abs(v["bubble"] - pipeline.predicted_bubble(p, m)) < 1e-9': sanity(
            "the simulator against the closed form (p-1)/(m+p-1): two computations of one quantity (the form holds "
            "for any m, so no mechanism is removed by either); what more micro-batches buy on real ranks is cell 9's"),
        'simulated["gpipe"]["in_flight"] == [m] * p': inline('simulated["gpipe"]["in_flight"] == [m] * p'),
        "an impossible order is refused, not run": inline('abs(v["bubble"] - pipeline.predicted_bubble(p, m)) < 1e-9'),
        "a pipelined step computes the unsplit model's gradients": control(
            NCA + "test_pipelined_gradients_equal_the_unsplit_models_only_with_the_loss_divided_by_m"),
        "GPipe holds every micro-batch; 1F1B at most p": control(
            "tests/test_pipeline_strategy.py::test_gpipe_in_the_trainer_runs_every_forward_first_and_holds_every_micro_batch"),
        "more micro-batches, a smaller bubble: the pairs say the opposite": sanity(
            "timing: a sign test on paired steps; the cell asserts only that the pairs do not say the opposite, and "
            "prints 'not visible' when they disagree"),
        'abs(beyond[name]["bubble / ideal"] - formula[name]) < 1e-9': control(
            "tests/test_pipeline_schedules.py::test_without_the_split_zero_bubble_falls_back_to_the_1f1b_bubble"),
        "splitting the backward shrinks the bubble": inline('beyond["1f1b"]["bubble / ideal"]'),
        "ZB-V: no idle slot inside a rank's span": inline("1e-9 < beyond[\"1f1b\"][\"idle inside ranks' spans\"]"),
        "ZB-H1 and ZB-V keep 1F1B's peak; interleaving holds more": inline('p < peak["interleaved"]'),
        "ZB-H1: every rank holds what 1F1B's first rank holds": control(
            "tests/test_pipeline_schedules.py::test_without_the_bounded_delay_every_w_waits_and_memory_grows_to_m"),
        "our orders are torch's": sanity(
            "a reference comparison: our generators against torch's own orders (more shapes in "
            "tests/test_pipeline_schedules.py); no mechanism of ours is isolated"),
        "a W before its own I is refused": inline("splitting the backward shrinks the bubble"),
        'r["grad_diff"] <= 1e-6': control(NCA + "test_pipelined_gradients_equal_the_unsplit_models_only_with_the_loss_divided_by_m"),
        'r["same_order"]': sanity("a reference comparison: the order torch ran, event by event, against our generator's"),
        'r["held"] == r["held_simulated"]': sanity("a measurement against the simulator: two readings of one schedule"),
        'r["bubble"] > r["floor"] - 0.05': sanity(
            "a bound: the simulator fed this run's own action times, messages free, is a floor no real run can beat"),
        "the pipeline trains on the same samples, to the same losses": control(
            NCA + "test_the_pipeline_trainer_is_bitwise_ddp_only_with_its_stages_averaged_over_dp"),
        "the same weights as DDP, bit for bit": control(
            NCA + "test_the_pipeline_trainer_is_bitwise_ddp_only_with_its_stages_averaged_over_dp"),
        "each rank holds about 1/pp of the state": inline("1.2 / stages"),
    },
    "14_fault_tolerance": {
        "a preempted run exits 75": control(
            "tests/test_preemption.py::test_without_a_checkpoint_dir_sigterm_stops_the_command_promptly_with_143"),
        'saved == [f"step-{notice_step + 1:08d}"]': control(
            "tests/test_preemption.py::test_a_decision_taken_per_rank_hangs_until_the_timeout_and_the_agreed_one_saves"),
        "the resume is bitwise the uninterrupted run": control(
            "tests/test_train.py::test_weights_only_resume_sees_the_same_data_but_departs"),
        "the per-rank decision fails, bounded by the timeout (or the stall limit after it)": inline(
            '{r["emergency_checkpoint_step"] for r in agreed} == {2}'),
        "agreed: one step, one checkpoint": inline('alone != "finished"'),
        "a comparable budget of saves": sanity("the comparison's precondition: both rules saved about as often"),
        "time-based saving bounds the loss in seconds": control(NCA + "test_time_based_saving_wins_only_when_step_times_are_uneven"),
        "one NaN poisons the unguarded run": inline('math.isfinite(final["nan, guard"])'),
        'abs(final["nan, guard"] - clean["losses"][-1]["loss"])': inline('math.isnan(final["nan, no guard"])'),
        'runs["spike, guard"]["rollbacks"] == 1': inline('final["spike, no guard"]'),
        "the newest 3 kept, the oldest pruned": control(NCA + "test_without_pruning_every_checkpoint_stays"),
        "the torn newest checkpoint is skipped, with a warning, for the one before": control(
            NCA + "test_a_torn_checkpoint_is_chosen_once_the_hash_check_is_off"),
        "and the resume starts there": control(NCA + "test_a_torn_checkpoint_is_chosen_once_the_hash_check_is_off"),
        'all(t[p] > 0 for p in parts[1:])': sanity("bookkeeping: the recovery's events came in order"),
        't["detection_s"] > -0.001': sanity("bookkeeping: the death was noticed after it happened (the clocks agree)"),
        't["detection_s"] < recovery.COLLECTIVE_TIMEOUT_S / 2': control(
            NCA + "test_a_rank_that_hangs_instead_of_dying_keeps_its_peers_waiting"),
        "the ddpkit launcher records when it noticed the death": sanity("bookkeeping: the launcher's own timestamp is there"),
    },
    "15_capstone": {
        "the loss falls below half of ln(vocab)": sanity("the run trains: the task is learnable and the model learns it"),
        "each 20-step window's mean loss is below the one before (single steps are noisy)": sanity("the run trains, window by window"),
        "ZeRO-1 trains like DDP": control(NCA + "test_zero1_without_averaging_no_longer_trains_ddps_model"),
        "the model learned the chain's rule": sanity("the run trains: its predictions follow the chain after training"),
        "every rank holds the same parameter norm at every step": control(
            NCA + "test_the_capstones_replicas_agree_only_because_ddp_all_reduces"),
        "every rank holds bitwise the same parameters at every step": control(
            NCA + "test_the_capstones_replica_check_catches_a_flipped_sign_only_by_hash"),
        "12P/N bytes per rank": control(NCA + "test_zero1_holds_12_bytes_x_ceil_p_over_n_only_because_it_shards_its_state"),
        "no NaN anywhere": sanity("bookkeeping: every step's loss was finite"),
        "the launcher names the killed rank": control(NC + "test_the_killed_rank_is_named_only_because_knock_on_failures_are_set_aside"),
        "byte-equal round trip": control(NCA + "test_the_capstone_resume_is_exact_only_with_the_optimizer_shards_restored"),
        "RESUME VERIFIED: weights, optimizer state and samples bitwise on 4 ranks": control(
            NCA + "test_the_capstone_resume_is_exact_only_with_the_optimizer_shards_restored"),
        "the same global sample stream on 2 ranks": control(
            NCA + "test_a_per_rank_data_position_does_not_continue_the_stream_on_another_world_size"),
        "one JSONL event per step on rank 0, none lost": sanity("bookkeeping: the log holds every step"),
        'split["output_diff"] <= 1e-6 and split["grad_diff"] <= 1e-6': control(
            NCA + "test_without_fs_all_reduce_the_split_gpt_no_longer_matches_the_whole_one"),
        'big["data_sha256"] == accumulated["data_sha256"] and accum_gap <= 1e-5': control(
            NC + "test_accumulation_equals_the_big_batch_only_with_the_loss_divided_by_grad_accum"),
        'guarded["rollbacks"] == 1': control("tests/test_guard.py::test_damaged_weights_are_rolled_back_to_the_newest_checkpoint"),
    },
    "16_interview_drill": {
        "sharding shrinks what each rank holds": inline('rows[0]["optimizer KiB"]'),
        "the broken run still looks healthy: its loss falls": sanity(
            "the lesson's point: the broken run's loss falls too, so the loss cannot tell (the next check can)"),
        "... on 1/N of the data": control("tests/test_drill.py::test_the_silent_failure_evidence_trains_on_one_nth_of_the_data"),
        'full["param_sha256"] == whole["param_sha256"] and weights["param_sha256"] != whole["param_sha256"]': inline(
            'weights["param_sha256"] != whole["param_sha256"]'),
        "the spikes line up with the saves": inline("sum(without) / len(without)"),
        "all(s == sent[0] and len(s) == 3 for s in sent)": control(
            NC + "test_every_rank_sees_one_global_loss_only_because_it_is_all_reduced"),
        "the same global batch on another topology: the same samples, the same losses": control(
            NCA + "test_a_changed_global_batch_is_not_the_same_training"),
        "DDP trains what one process trains on the same global batch": control(
            NCA + "test_ddp_equals_one_process_only_because_it_averages_gradients"),
        'counts["output_diff"] <= 1e-6 and counts["forward_all_reduces"]': control(
            NCA + "test_without_fs_all_reduce_the_split_gpt_no_longer_matches_the_whole_one"),
        "the calculator predicts what real ranks hold": control(NCA + "test_the_fsdp2_check_fails_for_a_flat_calculator"),
        "small messages are latency-bound, large ones bandwidth-bound": inline('rows[0]["algbw"]'),
        'zero["state_bytes_per_rank"]["optimizer"] == 12 * math.ceil(P / world)': control(
            NCA + "test_zero1_holds_12_bytes_x_ceil_p_over_n_only_because_it_shards_its_state"),
        "math.isinf(float(big.half()))": sanity("facts of the fp16 and bf16 formats, measured on this torch"),
        "bf16's 8 significant bits lose a small update: master weights stay fp32": sanity(
            "a fact of the bf16 format, measured on this torch (the update lost is 10b's lesson, with its fp32 contrast)"),
        "bf16 trains like fp32, not bit for bit": inline('fp32_run["param_sha256"] != bf16_run["param_sha256"]'),
        "on gloo the peers fail at once (connection reset), not at the 60 s timeout": control(
            NCA + "test_a_rank_that_hangs_instead_of_dying_keeps_its_peers_waiting"),
        "detected, restarted, restored and stepped, in that order": sanity("bookkeeping: the recovery's events came in order"),
        "the launcher saw the exit; it did not wait for a timeout": control(
            NCA + "test_a_rank_that_hangs_instead_of_dying_keeps_its_peers_waiting"),
        'check["ok"]': control(NCA + "test_the_scaling_model_misses_a_ddp_step_whose_all_reduce_is_removed"),
        "the node boundary costs: past one node the slower link takes its share": inline('0.9 * rows[3]["weak"]'),
        "the seed's curve needs stragglers: the links alone give a step at the node boundary, then a plateau": inline(
            '0.08 <= flat["max_error"]'),
        "16 B/param: seed 003's 12 plus the 4-byte fp32 master copy": sanity(
            "the calculator's accounting for bf16 mixed precision against the hand count in the message; the "
            "calculator against real ranks is cell 21's check, with its control"),
        "1F1B holds at most p micro-batches (counted on real ranks), GPipe's schedule would hold m": control(
            "tests/test_pipeline_strategy.py::test_gpipe_in_the_trainer_runs_every_forward_first_and_holds_every_micro_batch"),
        "with 8 micro-batches the bubble alone keeps efficiency below seed 003's 75-80%: 9 and 12 are needed": sanity(
            "the bubble formula's arithmetic for seed 003's numbers"),
        "zig-zag: the same work on every rank": control(
            "tests/test_context.py::test_zigzag_balances_the_causal_work_and_contiguous_does_not"),
        "the ring's output and gradients are full attention's": control(
            "tests/test_context.py::test_without_the_log_sum_exp_rescale_the_ring_is_wrong"),
        "contiguous chunks are unbalanced; zig-zag is not": inline('set(on4["zigzag"]) == {9}'),
        "each expert takes at most its capacity per group": sanity("bookkeeping: the capacity the run used is the formula's"),
        'all(max(s["kept"]) <= s["capacity"]': control(
            "tests/test_experts.py::test_capacity_drops_what_does_not_fit_and_none_drops_nothing"),
        "the all-to-all MoE is the single-process MoE": control(
            "tests/test_experts.py::test_without_capacity_the_split_run_keeps_what_the_reference_drops"),
        "the papers' bubbles, on the clock": control(
            "tests/test_pipeline_schedules.py::test_without_the_split_zero_bubble_falls_back_to_the_1f1b_bubble"),
        "ZB-V: no rank idles between its first and last action (m >= 2p - 1)": control(
            "tests/test_pipeline_schedules.py::test_1f1b_keeps_a_bubble_inside_the_ranks_spans"),
        "the orders simulated above are the ones torch's schedules run": sanity(
            "a reference comparison: the orders torch ran on real ranks against our generator's"),
        "and they compute the unsplit model's gradients": control(
            NCA + "test_pipelined_gradients_equal_the_unsplit_models_only_with_the_loss_divided_by_m"),
        "shard, or shard plus the whole gathered parameters": control(
            "tests/test_fsdp_depth.py::test_reshard_after_forward_gathers_again_in_backward_and_holds_only_shards"),
        "False: nothing gathered again in backward": control(
            "tests/test_fsdp_depth.py::test_reshard_after_forward_gathers_again_in_backward_and_holds_only_shards"),
        "HSDP divides the state by its shard group, not the world": inline('2 * shard_bytes["FSDP, 4 ranks"]'),
        "the planner charges the all-reduces real tensor-parallel ranks make": control(
            NCA + "test_without_fs_all_reduce_the_split_gpt_no_longer_matches_the_whole_one"),
        "the rule comes from the links' bandwidths, not from the planner": inline("len(flat_times) == 1"),
        "every question has its evidence above": sanity("bookkeeping: every drill question has its evidence"),
    },
}


# ----------------------------------------------------------------------------- reading notebooks and tests

@dataclass(frozen=True)
class Assert:
    cell: int
    message: str | None  # the message when it is a plain string
    expression: str  # the asserted expression's source, whitespace collapsed
    source: str  # the whole statement's source, whitespace collapsed


def _squash(text: str) -> str:
    return " ".join(text.split())


def _python(cell_source: str) -> str:
    """A code cell as Python: an IPython line magic (``%pip``, ``!ls``) becomes ``pass``, indentation kept."""
    lines = cell_source.splitlines()
    return "\n".join(line[: len(line) - len(line.lstrip())] + "pass" if line.lstrip().startswith(("%", "!")) else line
                     for line in lines)


def notebook_asserts(path: Path) -> list[Assert]:
    found = []
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        source = _python(cell.source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Assert):
                message = node.msg.value if isinstance(node.msg, ast.Constant) and isinstance(node.msg.value, str) else None
                found.append(Assert(index, message, _squash(ast.get_source_segment(source, node.test)),
                                    _squash(ast.get_source_segment(source, node))))
    return found


def matches(key: str, found: Assert) -> bool:
    """An entry's key names an assert by its message, or by a substring of its expression."""
    return key == found.message or _squash(key) in found.expression


def defined_tests(path: Path) -> set[str]:
    """The module-level ``test_*`` functions a test file defines (read, not imported)."""
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")}


# ----------------------------------------------------------------------------- the tests

def test_every_notebook_of_01_to_16_has_its_registry_and_only_those():
    assert [p.stem for p in NOTEBOOKS] == sorted(REGISTRY), "REGISTRY's notebooks are not notebooks 01-16"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_assert_has_exactly_one_entry_and_no_entry_is_stale(path):
    entries, asserts = REGISTRY.get(path.stem, {}), notebook_asserts(path)
    problems = []
    for found in asserts:
        keys = [key for key in entries if matches(key, found)]
        if len(keys) != 1:
            problems.append(f"cell {found.cell}: `{found.source[:160]}` matches {len(keys)} entries {keys}: give it exactly "
                            f"one in REGISTRY[{path.stem!r}] (its message, or a substring of its expression)")
    for key in entries:
        hits = [f for f in asserts if matches(key, f)]
        if len(hits) != 1:
            problems.append(f"entry {key!r} matches {len(hits)} asserts: " +
                            ("stale (the assert changed or went): update or remove it" if not hits else "make it unique"))
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_every_entry_is_a_control_an_inline_control_or_a_reason():
    for stem, entries in REGISTRY.items():
        for key, entry in entries.items():
            assert isinstance(entry, Entry) and entry.kind in ("control", "inline", "sanity"), (stem, key)
            assert entry.text.strip(), f"{stem}: {key!r} has an empty {entry.kind}"


def test_every_control_names_a_test_that_exists():
    defined: dict[str, set[str]] = {}
    missing = []
    for stem, entries in REGISTRY.items():
        for key, entry in entries.items():
            if entry.kind != "control":
                continue
            file, _, name = entry.text.partition("::")
            path = REPO / file
            if file not in defined:
                defined[file] = defined_tests(path) if path.is_file() and file.startswith("tests/") else set()
            if name not in defined[file]:
                missing.append(f"{stem}: {key!r} -> {entry.text}")
    assert not missing, "controls that name no test function:\n" + "\n".join(missing)


def test_every_inline_control_is_an_assert_of_its_notebook():
    missing = []
    for path in NOTEBOOKS:
        sources = [f.source for f in notebook_asserts(path)]
        for key, entry in REGISTRY[path.stem].items():
            if entry.kind == "inline" and not any(_squash(entry.text) in s for s in sources):
                missing.append(f"{path.stem}: {key!r} -> inline({entry.text!r})")
    assert not missing, "inline controls found in no assert of their notebook:\n" + "\n".join(missing)


def test_the_registry_can_fail(tmp_path):
    """The checks above, on a notebook they have not seen: a new assert without an entry is named."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('if True:\n    %pip install x\nassert 1 + one == 2, "new"')])
    path = tmp_path / "99_new.ipynb"
    nbformat.write(nb, path)
    found = notebook_asserts(path)
    assert [(f.cell, f.message, f.expression) for f in found] == [(0, "new", "1 + one == 2")]
    assert matches("new", found[0]) and matches("1 + one", found[0]) and not matches("1 + two", found[0])
    assert "test_every_control_names_a_test_that_exists" in defined_tests(Path(__file__))
