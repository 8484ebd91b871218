"""``ddpkit train --launcher ray``: the kit's Trainer in Ray Train's worker group, bit for bit, and nothing left behind."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest

from conftest import REPO, cli_env, run_cli
from ddpkit.engines import missing, ray_launch

CONFIG = ("--world-size", "2", "--steps", "6", "--timeout", "20")


def ray_leftovers() -> tuple[set, set]:
    """Processes whose command line names a ddpkit Ray session folder, and those folders."""
    procs = set()
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as handle:
                if ray_launch.TEMP_PREFIX.encode() in handle.read():
                    procs.add(int(path.split("/")[2]))
        except OSError:
            continue
    procs.discard(os.getpid())
    return procs, set(glob.glob(os.path.join(tempfile.gettempdir(), ray_launch.TEMP_PREFIX + "*")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One Ray run and two runs of the kit's launcher (the same config, and a control with another seed)."""
    reason = missing("ray")
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("ray")
    before = ray_leftovers()
    out = {}
    for name, extra in (("ray", ("--launcher", "ray")), ("ddpkit", ()), ("control", ("--seed", "18"))):
        path = folder / f"{name}.json"
        proc = run_cli("train", *CONFIG, *extra, "--summary-json", str(path), timeout=300)  # Ray may start its head twice
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = json.loads(path.read_text())
        out[name + "_stdout"] = proc.stdout
    out["leftovers"] = [new - old for new, old in zip(ray_leftovers(), before)]
    return out


def test_ray_trains_the_same_bits_as_the_kits_launcher(runs):
    ray, ddp = runs["ray"], runs["ddpkit"]
    assert ray["world_size"] == ddp["world_size"] == 2 and ray["backend"] == "gloo"
    assert ray["param_sha256"] == ddp["param_sha256"]
    assert ray["optimizer_sha256"] == ddp["optimizer_sha256"] and ray["data_sha256"] == ddp["data_sha256"]
    assert [x["loss"] for x in ray["losses"]] == [x["loss"] for x in ddp["losses"]]
    assert "done: step 6" in runs["ray_stdout"], "rank 0's summary line reaches the driver"


def test_the_hash_comparison_can_fail(runs):
    # negative control: another seed, same launcher, same shapes: the hashes differ
    assert runs["control"]["param_sha256"] != runs["ddpkit"]["param_sha256"]
    assert runs["control"]["data_sha256"] != runs["ddpkit"]["data_sha256"]


def test_no_ray_session_or_process_is_left(runs):
    procs, folders = runs["leftovers"]
    assert not procs and not folders, (procs, folders)


def test_a_world_ray_cannot_place_is_refused_before_ray_starts():
    if missing("ray"):
        pytest.skip(missing("ray"))
    before = ray_leftovers()
    too_many = ray_launch.visible_cpus() + 1
    env = {k: v for k, v in cli_env().items() if k != "RAY_ADDRESS"}
    proc = run_cli("train", "--launcher", "ray", "--world-size", str(too_many), "--steps", "1", timeout=60, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and f"needs {too_many} CPUs" in lines[0], proc.stderr
    assert ray_leftovers() == before, "nothing was started"


def test_placement_rule():
    ray_launch.check_placement(2, 2)
    with pytest.raises(ValueError, match="use --world-size 2 or fewer"):
        ray_launch.check_placement(3, 2.0)


IMPORTS_GRAMMAR = "import sys, jsonschema; print('rfc3987_syntax' in sys.modules)"


def test_rays_processes_skip_the_iri_grammar():
    """Ray's processes import jsonschema; under the launcher's environment that import leaves rfc3987_syntax out."""
    env = {**cli_env(), **ray_launch.session_env(cli_env())}
    proc = subprocess.run([sys.executable, "-c", IMPORTS_GRAMMAR], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and proc.stdout.split() == ["False"], proc.stderr
    assert env["PYTHONPATH"].split(os.pathsep)[0] == ray_launch.PYTHONPATH_DIR


def test_the_grammar_check_can_fail():
    # negative control: the same import without the launcher's PYTHONPATH builds the grammar
    if importlib.util.find_spec("rfc3987_syntax") is None:
        pytest.skip("rfc3987_syntax is not installed here: nothing to leave out")
    proc = subprocess.run([sys.executable, "-c", IMPORTS_GRAMMAR], capture_output=True, text=True, timeout=60, env=cli_env())
    assert proc.returncode == 0 and proc.stdout.split() == ["True"], proc.stderr


def test_without_ray_the_extra_is_named_in_one_line():
    code = ("import sys; sys.modules['ray'] = None; from ddpkit.cli import main; "
            "sys.exit(main(['train', '--launcher', 'ray', '--steps', '1']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=cli_env(), cwd=REPO)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "pip install 'ddpkit[ray]'" in lines[0], proc.stderr


def test_notebook_22s_ray_section_runs_and_its_records_hold(tmp_path, monkeypatch):
    """Notebook 22 with run_ray = True: its Ray Train section against the kit's launcher, checked by check_22.
    Kept out of the notebook's own run, which it would take past a minute (it adds 22-56 s here)."""
    if missing("ray"):
        pytest.skip(missing("ray"))
    import papermill

    from ddpkit.notebook import read_records
    from test_notebooks import check_22

    monkeypatch.setenv("DDPKIT_PROGRESS", "text")
    before = ray_leftovers()
    out = tmp_path / "22_engines.ipynb"
    papermill.execute_notebook(str(REPO / "notebooks" / "22_engines.ipynb"), str(out), parameters={"run_ray": True},
                               kernel_name="python3", cwd=str(REPO / "notebooks"), execution_timeout=300, progress_bar=False)
    records = read_records(json.loads(out.read_text()))
    check_22(records)
    assert records["ray"] == {"equal": True, "sha_equal": True}
    assert all(records["seed_table"]["rows"].values()), "with Ray, every row of seed 003's table is proved in the notebook"
    assert [new - old for new, old in zip(ray_leftovers(), before)] == [set(), set()]
