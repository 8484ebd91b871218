"""Every notebook, executed for real by papermill, checked on what it recorded; and their conventions."""

import json
import time
from pathlib import Path

import nbformat
import papermill
import pytest

from ddpkit.notebook import read_records

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
RUNTIMES = REPO / "benchmarks" / "results" / "notebook_runtimes.json"


def check_01(records):
    assert records["digest"] == {"hash_values": 3, "sha256_values": 1}
    assert records["topology"]["data_sha256"] == 1 and records["topology"]["max_loss_diff"] < 1e-4


def check_02(records):
    assert records["partition"]["epochs_ok"] >= 2 and records["partition"]["plain_duplicates"] > 0
    sizes = records["handbook"]["epoch_sizes"]
    assert sizes[0] > 0 and all(n == 0 for n in sizes[1:])
    assert records["handbook"]["counted"] > records["handbook"]["trained"]


def check_03(records):
    assert records["optimizer_bytes"]["moment_bytes"] == 2 * records["optimizer_bytes"]["param_bytes"]
    lockstep = records["lockstep"]
    assert set(lockstep["ddp"]["diffs"]) == {0.0} and lockstep["ddp"]["param_hashes"] == lockstep["ddp"]["optimizer_hashes"] == 1
    assert min(lockstep["no_ddp"]["diffs"]) > 0 and min(lockstep["ddp_lr_differs"]["diffs"]) > 0
    trainer = records["trainer_lockstep"]
    assert trainer["ranks"] >= 2 and trainer["param_hashes"] == trainer["optimizer_hashes"] == 1
    assert trainer["trainer_param_sha256"] == trainer["loop_param_sha256"]


def check_04(records):
    table = records["rank_table"]
    assert [r["rank"] for r in table] == list(range(len(table))) and len({r["pid"] for r in table}) == len(table)
    assert records["stall"]["rank"] == len(table) - 1


def check_05(records):
    assert all(r["max_abs_diff"] < 1e-6 and r["bitwise_equal_across_ranks"] for r in records["accumulation"].values())
    calls = {mode: r["calls"] for mode, r in records["no_sync"].items()}
    assert calls["backward-only no_sync"] == calls["no no_sync"] == 4 * calls["ddpkit train_step"]
    memory = records["bucket_view"]["memory"]
    assert memory["as_view=True"]["distinct_bytes"] * 2 == memory["as_view=False"]["distinct_bytes"]
    assert records["amp_memory"]["activation_ratio"] < 0.75
    assert records["amp_underflow"]["fp16"]["zero_fraction"] > 0.5 > records["amp_underflow"]["bf16"]["zero_fraction"]
    clip = records["clipping"]
    assert clip["unscale, then clip"]["rel_diff"] < 1e-5 and clip["clip scaled gradients"]["norm"] < 1e-3 * clip["unscale, then clip"]["norm"]


def check_06(records):
    contents = records["contents"]
    assert 3 * contents["param_bytes"] <= contents["file_bytes"] < 3.2 * contents["param_bytes"]
    for name in ("exact_resume", "torn"):
        assert records[name]["resumed"] == records[name]["reference"], name
    assert records["weights_only"]["resumed"] != records["weights_only"]["reference"]
    torn = records["torn"]
    assert any("skipping checkpoint step-" in w for w in torn["warnings"]) and all(torn["used"] not in w for w in torn["warnings"])
    assert records["weights_only"]["max_loss_gap"] > 1e-4
    assert len(records["refusals"]) >= 8 and all(records["refusals"].values())
    cadence = records["cadence"]
    assert cadence[min(cadence, key=int)]["checkpoint_share"] > cadence[max(cadence, key=int)]["checkpoint_share"]


def check_07(records):
    assert records["logs"]["files"] == ["rank-00000.jsonl", "rank-00001.jsonl"]
    assert records["phases"]["data_share"]["slow data"] > 0.5 > records["phases"]["data_share"]["baseline"]
    assert records["comm"]["remainder_ms"] < records["comm"]["comm_ms"] < records["comm"]["backward_ms"]
    assert min(records["spikes"]["save_step_ms"]) > 1.5 * records["spikes"]["plain_ms"]
    assert records["straggler"]["0"]["step_time_s"] > 0.5 * records["straggler"]["1"]["data_s"] > 0


def check_08(records):
    assert records["kill"]["rank"] == 1 and records["kill"]["kind"] == "killed" and "SIGKILL" in records["kill"]["message"]
    assert records["restart"]["lost_steps"] > 0
    assert records["cli_restart"]["returncode"] == 0
    for name in ("restart", "cli_restart", "torchrun_restart"):  # the notebook's defaults run all three
        assert records[name]["resumed"] == records[name]["reference"], name
    assert records["cli_restart"]["restarts"] == records["torchrun_restart"]["restarts"] == 1


CHECKS = {"01": check_01, "02": check_02, "03": check_03, "04": check_04, "05": check_05, "06": check_06, "07": check_07, "08": check_08}


def test_every_notebook_has_a_results_check():
    assert {p.name[:2] for p in NOTEBOOKS} <= set(CHECKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_its_results_hold(path, tmp_path):
    started = time.monotonic()
    out = tmp_path / path.name
    papermill.execute_notebook(str(path), str(out), kernel_name="python3", cwd=str(path.parent),
                               execution_timeout=120, progress_bar=False)
    elapsed = time.monotonic() - started
    CHECKS[path.name[:2]](read_records(json.loads(out.read_text())))
    runtimes = json.loads(RUNTIMES.read_text()) if RUNTIMES.exists() else {}
    runtimes[path.stem] = round(elapsed, 1)
    RUNTIMES.parent.mkdir(parents=True, exist_ok=True)
    RUNTIMES.write_text(json.dumps(dict(sorted(runtimes.items())), indent=1) + "\n")
    assert elapsed < 60, f"{path.name} took {elapsed:.0f}s"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_conventions(path):
    nb = nbformat.read(path, as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code_cells), "stored with outputs"
    assert sum("parameters" in c.metadata.get("tags", []) for c in nb.cells) == 1, "exactly one parameters cell"
    assert "colab.research.google.com/assets/colab-badge.svg" in nb.cells[0].source, "Open in Colab badge"
    assert path.name in nb.cells[0].source, "the badge opens this notebook"
    first = code_cells[0].source
    assert 'if "google.colab" in sys.modules' in first and "%pip install" in first, "Colab-guarded install first"
