"""Debugging lessons on real gloo ranks: each finding, and the same check failing without its mechanism."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from ddpkit.debug import flight, mismatch
from tests.conftest import REPO, cli_env

needs_fr = pytest.mark.skipif(not flight.available(), reason="this torch cannot dump a gloo Flight Recorder")

NAMED = {"op": "Op type:", "shape": "Tensor shapes", "dtype": "Tensor dtypes"}


@pytest.mark.parametrize("case", ["op", "shape", "dtype"])
def test_detail_names_the_mismatch_and_without_it_nothing_does(case):
    helped = mismatch.outcome(mismatch.mismatched_collective, case, True, 1.0)
    assert helped["raised"] and "Detected mismatch between collectives" in helped["root"]
    assert NAMED[case] in helped["root"] and "CollectiveFingerPrint" in helped["root"]
    # negative control: the same bug without DETAIL; no message names the two calls
    alone = mismatch.outcome(mismatch.mismatched_collective, case, False, 1.0, timeout=1.0)
    seen = alone["root"] + " ".join(alone["others"])
    assert alone["raised"] and "Detected mismatch" not in seen and "CollectiveFingerPrint" not in seen
    assert any(word in seen for word in ("Timed out", "Connection reset", "Connection closed", "SIGABRT")), seen


def test_detail_lets_agreeing_ranks_through():
    run = mismatch.outcome(mismatch.mismatched_collective, "none", True, 1.0)
    assert not run["raised"] and run["results"] == [[4.0] * 4] * 2


@needs_fr
def test_flight_recorder_names_the_odd_rank_out(tmp_path):
    with flight.recording():
        run = mismatch.outcome(mismatch.mismatched_collective, "op", False, 1.0, 1, str(tmp_path), world_size=3, timeout=1.0)
    assert run["raised"]
    found = flight.analyze(str(tmp_path))
    assert not found.ok and found.culprits == [1] and found.differing == {1: "gloo:broadcast"}
    assert found.kinds[1] == "COLLECTIVE_TYPE_MISMATCH" and found.op == "gloo:all_reduce"
    assert "Culprit rank 1" in found.report


@needs_fr
def test_torchfrtrace_reads_the_fixed_dumps_and_not_the_raw_ones(tmp_path):
    import subprocess
    import sys

    raw_dir = tmp_path / "raw"
    with flight.recording():
        mismatch.outcome(mismatch.mismatched_collective, "op", False, 1.0, 1, str(raw_dir), world_size=3, timeout=1.0)
    fixed = flight.write_fixed(str(raw_dir), str(tmp_path / "fixed"))
    # torchfrtrace's entry point (fr_trace:main) on both folders, in one interpreter: torch is imported once
    script = ("import sys, traceback\nfrom torch.distributed.flight_recorder.fr_trace import main\n"
              "main([sys.argv[1]])\nfor out in (sys.stdout, sys.stderr): print('=== raw', file=out, flush=True)\n"
              "try:\n    main([sys.argv[2]])\nexcept Exception:\n    traceback.print_exc()\n    sys.exit(3)\n")
    run = subprocess.run([sys.executable, "-c", script, fixed, str(raw_dir)], capture_output=True, text=True, timeout=120)
    assert "=== raw" in run.stdout, run.stderr  # the fixed dumps were analyzed without an error
    (good_out, bad_out), (good_err, bad_err) = run.stdout.split("=== raw"), run.stderr.split("=== raw")
    assert "Culprit rank 1" in good_out + good_err
    assert run.returncode == 3 and "KeyError" in bad_err  # control: gloo's raw table
    # the same command run in this process (what notebook 20 does): the same finding, the same failure
    assert flight.torchfrtrace(fixed).ok and "Culprit rank 1" in flight.torchfrtrace(fixed).output
    raw = flight.torchfrtrace(str(raw_dir))
    assert not raw.ok and raw.error.startswith("KeyError") and "'0'" in raw.error  # the group the entries name


@needs_fr
def test_flight_recorder_finds_nothing_when_ranks_agree(tmp_path):
    with flight.recording():
        run = mismatch.outcome(mismatch.mismatched_collective, "none", False, 1.0, 1, str(tmp_path), world_size=3, timeout=1.0)
    assert not run["raised"]
    found = flight.analyze(str(tmp_path))
    assert found.ok and found.culprits == [] and len(set(found.issued.values())) == 1


RECORDING_OFF = """
import json, sys
from ddpkit.debug import flight, mismatch
if sys.argv[2] == "touched":
    flight.dump(sys.argv[1] + "-parent", 0)  # the launching process creates its own recorder first
with flight.recording(0):
    run = mismatch.outcome(mismatch.mismatched_collective, "none", False, 1.0, 1, sys.argv[1], timeout=1.0)
print(json.dumps([run["raised"], [len(d["entries"]) for d in flight.read_dumps(sys.argv[1]).values()]]))
"""


def _entries_with_recording_off(folder: str, parent: str) -> tuple[bool, list[int]]:
    """In a fresh process: its ranks' ring sizes with ``TORCH_FR_BUFFER_SIZE=0``. The recorder is one per
    process, created at its first use, and a forked rank inherits its launcher's: so the launching
    process must be one that has not used its own (a pytest worker may have)."""
    out = subprocess.run([sys.executable, "-c", RECORDING_OFF, folder, parent], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=cli_env())
    assert out.returncode == 0, out.stderr[-2000:]
    raised, sizes = json.loads(out.stdout.strip().splitlines()[-1])
    return raised, sizes


@needs_fr
def test_with_recording_off_the_rings_are_empty(tmp_path):
    raised, sizes = _entries_with_recording_off(str(tmp_path / "off"), "fresh")
    assert not raised and sizes and not any(sizes)
    # control: once the launching process has its own recorder, the forked ranks keep recording
    raised, sizes = _entries_with_recording_off(str(tmp_path / "touched"), "touched")
    assert not raised and all(sizes)


@needs_fr
def test_gloo_dumps_need_their_group_table_fixed(tmp_path):
    from torch.distributed.flight_recorder.components.builder import build_groups_memberships

    with flight.recording():
        mismatch.outcome(mismatch.mismatched_collective, "none", False, 1.0, 1, str(tmp_path), timeout=1.0)
    dumps = flight.read_dumps(str(tmp_path))
    assert all("" in d["pg_config"] for d in dumps.values()), "gloo leaves the table keyed ''"
    names = {e["process_group"][0] for d in dumps.values() for e in d["entries"]}
    _, _, _, _, raw = build_groups_memberships({r: d["pg_config"] for r, d in dumps.items()})
    assert not any((name, 0) in raw for name in names), "unfixed, the analyzer cannot find the groups"
    fixed = {r: flight.gloo_pg_config(d, sorted(dumps))["pg_config"] for r, d in dumps.items()}
    _, _, _, _, pg_guids = build_groups_memberships(fixed)
    assert all((name, r) in pg_guids for name in names for r in dumps)


def test_dumps_are_read_as_plain_data_only(tmp_path):
    (tmp_path / "fr_rank_0").write_bytes(pickle.dumps({"entries": [], "when": os.stat_result((0,) * 10)}))
    with pytest.raises(pickle.UnpicklingError, match="plain data"):
        flight.read_dumps(str(tmp_path))


@needs_fr
def test_a_skipped_collective_stalls_and_the_rings_name_the_rank(tmp_path):
    steps = 6
    with flight.recording():
        run = mismatch.outcome(mismatch.skipped_collective, steps, 2, str(tmp_path), timeout=2.0)
    assert run["raised"] and run["kind"] == "stalled" and run["rank"] == 1
    assert "skipped_collective" in run["stack"]
    found = flight.analyze(str(tmp_path))
    assert found.missing == [1] and found.issued[0] == found.issued[1] + 1
    assert "rank 1 never issued it" in flight.stall_summary(str(tmp_path))


def test_without_the_skip_every_rank_makes_every_collective():
    run = mismatch.outcome(mismatch.skipped_collective, 6, None, timeout=2.0, evaluate_s=0.0)
    assert not run["raised"] and run["results"] == [6, 6]


# --- silent bugs: each caught by a kit check, and the same check passing on the correct code --------------

from ddpkit import data  # noqa: E402
from ddpkit.debug import silent  # noqa: E402
from ddpkit.launch import launch  # noqa: E402


def _samplers(kind, n=32, epochs=2):
    return launch(silent.sampler_epochs, kind, n, epochs, world_size=2, output="none")


def test_ranks_fed_the_same_samples_fail_the_partition_check():
    broken = _samplers("not distributed")
    report = data.check_partition([rank[0] for rank in broken], range(32))
    assert not report.ok and len(report.duplicates) == 32
    assert data.check_partition([rank[0] for rank in _samplers("distributed")], range(32)).ok  # control


def test_a_forgotten_set_epoch_repeats_the_data_fingerprint():
    forgot = silent.epoch_fingerprints(_samplers("no set_epoch"), batch_per_rank=4)
    assert forgot[0] == forgot[1]
    right = silent.epoch_fingerprints(_samplers("distributed"), batch_per_rank=4)
    assert right[0] != right[1]  # control: set_epoch reshuffles


def test_per_rank_seeded_dropout_breaks_the_replicas():
    bad = launch(silent.replicated_dropout, "per rank", world_size=2, output="none")
    assert len(set(bad[0]["hashes"])) == 2 and all(0.4 < r["kept"] < 0.6 for r in bad)
    good = launch(silent.replicated_dropout, "shared", world_size=2, output="none")
    assert len(set(good[0]["hashes"])) == 1  # control


@pytest.mark.parametrize("drift", ["swap", "ulp"])
def test_hashes_see_drift_that_norms_miss(drift):
    runs = launch(silent.drifted_replica, drift, world_size=2, output="none")
    assert len(set(runs[0]["hashes"])) == 2
    if drift == "swap":
        assert runs[0]["norm"] == runs[1]["norm"], "a swap keeps the norm: the norm check is blind to it"
    same = launch(silent.drifted_replica, "none", world_size=2, output="none")
    assert len(set(same[0]["hashes"])) == 1 and same[0]["norm"] == same[1]["norm"]  # control


# --- where the time goes: the profiler on real DDP ranks ---------------------------------------------------

import json  # noqa: E402

from ddpkit.debug import timeline  # noqa: E402


def test_interval_arithmetic():
    compute = timeline._union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)])
    assert compute == [(0.0, 2.0), (3.0, 4.0)]
    assert timeline.overlapped_fraction(compute, [(1.5, 3.5)]) == pytest.approx(0.5)
    assert timeline.overlapped_fraction(compute, [(2.0, 3.0)]) == 0.0


def test_ddp_hides_communication_behind_backward_and_a_loop_after_backward_does_not(tmp_path):
    fractions, paths = {}, {}
    for mode in timeline.MODES:
        paths[mode] = launch(timeline.profiled_steps, mode, str(tmp_path), world_size=2, output="none")
        spans = [timeline.intervals(p) for p in paths[mode]]
        assert all(s["comm"] and s["compute"] and s["comm_threads"] >= 1 for s in spans)
        fractions[mode] = [timeline.overlapped_fraction(s["compute"], s["comm"]) for s in spans]
    assert max(fractions["after backward"]) == 0.0, "control: nothing runs while the loop waits"
    assert max(fractions["ddp"]) > 0.02, fractions  # on a loaded machine one rank may hide none
    names = {e["name"] for e in json.load(open(paths["ddp"][0]))["traceEvents"] if e.get("ph") == "X"}
    assert {"c10d::allreduce_", "gloo:all_reduce"} <= names
    merged = json.load(open(timeline.merge_traces(paths["ddp"], str(tmp_path / "ddp.trace.json"))))
    assert {e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"} == {"rank 0", "rank 1"}
    # what notebook 20 asserts with the helpers: each half of the all-reduce on its own threads, a process per rank
    for path in paths["ddp"]:
        threads = timeline.comm_threads(path)
        assert threads["c10d::allreduce_"] and threads["gloo:all_reduce"]
        assert not threads["c10d::allreduce_"] & threads["gloo:all_reduce"], "gloo exchanges on threads of its own"
    both = timeline.trace_processes(str(tmp_path / "ddp.trace.json"))
    assert [p["name"] for p in both.values()] == ["rank 0", "rank 1"] and all(p["events"] for p in both.values())
    one = timeline.trace_processes(timeline.merge_traces(paths["ddp"][:1], str(tmp_path / "one.trace.json")))
    assert [p["name"] for p in one.values()] == ["rank 0"]  # control: one rank's trace merged is one process


def test_a_trace_without_communication_has_no_all_reduce_threads(tmp_path):
    """The control of the helper the notebook asserts with: a profile with no collective finds none."""
    net = torch.nn.Linear(8, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        net(torch.randn(4, 8)).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "alone.json"))
    assert timeline.comm_threads(str(tmp_path / "alone.json")) == {"c10d::allreduce_": set(), "gloo:all_reduce": set()}


# --- DDP's buckets: the first-bucket rule, checked against the buckets DDP builds -------------------------------

from ddpkit.debug import buckets  # noqa: E402


def test_planned_sizes_close_a_bucket_once_it_reaches_its_limit():
    assert buckets.planned_sizes([3, 3, 3, 3, 1], cap_bytes=5, first_cap_bytes=2) == [3, 6, 4]
    assert buckets.planned_sizes([3, 3, 3, 3, 1], cap_bytes=5, first_cap_bytes=5) == [6, 6, 1]


def test_ddp_builds_the_buckets_the_first_bucket_rule_predicts():
    default, half, set_25 = launch(buckets.built_buckets, [None, 0.5, 25], world_size=2, output="none")[0]
    for row in (default, half, set_25):
        assert row["first_iteration"] == [row["param_bytes"]] and row["built"] == row["planned"], row
    assert len(default["built"]) == 2 and len(half["built"]) == 3 and len(set_25["built"]) == 1
    # negative control: the same prediction without the first-bucket rule misses DDP's default buckets
    assert default["planned_without_first_rule"] != default["built"]


def test_a_stall_summary_names_the_ranks_that_left_no_ring(tmp_path):
    flight.dump(str(tmp_path), 0)  # this process's (empty) ring stands for rank 0's
    assert "no ring from rank(s) [1]" in flight.stall_summary(str(tmp_path), ranks=[0, 1])
    assert "no ring" not in flight.stall_summary(str(tmp_path), ranks=[0])  # control: every rank dumped
