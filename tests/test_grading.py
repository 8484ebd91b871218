"""ddpkit check on a room: the grade comes from running each learner's marked code in a sandbox, not from
what the notebook prints; the student notebooks are otter's output from the masters, without solutions;
a notebook's check cell answers even in a kernel that belongs to a process group."""

from __future__ import annotations

import csv
import json
import os
import re
import time
from pathlib import Path

import nbformat
import pytest

from tests.conftest import run_cli

EXERCISES = Path(__file__).resolve().parents[1] / "exercises"

RING_BLOCKING = '''import torch
import torch.distributed as dist


def ring_all_reduce(tensor):
    """A ring with blocking send and recv (odd ranks receive first, so nobody waits forever)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = list(torch.tensor_split(tensor, world))
    right, left = (rank + 1) % world, (rank - 1) % world

    def exchange(out, into):
        if rank % 2 == 0:
            dist.send(out.contiguous(), right)
            dist.recv(into, left)
        else:
            dist.recv(into, left)
            dist.send(out.contiguous(), right)

    for step in range(world - 1):
        i = (rank - step - 1) % world
        incoming = torch.empty_like(chunks[i])
        exchange(chunks[(rank - step) % world], incoming)
        chunks[i] += incoming
    for step in range(world - 1):
        i = (rank - step) % world
        incoming = torch.empty_like(chunks[i])
        exchange(chunks[(rank - step + 1) % world], incoming)
        chunks[i].copy_(incoming)
'''

STUB = "import torch.distributed as dist\n\n\ndef ring_all_reduce(tensor):\n    raise NotImplementedError\n"
ALIAS_AND_DECOYS = '''from torch.distributed import all_reduce as ar
import torch.distributed as dist


def ring_all_reduce(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    works = [dist.isend(tensor[:1].clone(), (rank + 1) % world), dist.irecv(tensor[:1].clone(), (rank - 1) % world)]
    for work in works:
        work.wait()
    ar(tensor)
'''


def notebook_with(code: str, extra_cells: tuple[str, ...] = ()) -> nbformat.NotebookNode:
    nb = nbformat.read(EXERCISES / "09_ring_all_reduce.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and "### begin" in cell.source:
            cell.source = f"### begin\n{code}\n### end"
    nb.cells += [nbformat.v4.new_code_cell(src) for src in extra_cells]
    return nb


def test_ddpkit_check_grades_a_mixed_room_from_the_code_alone(tmp_path):
    room = tmp_path / "room"
    room.mkdir()
    learners = {
        "ada": notebook_with(RING_BLOCKING),  # right, with blocking sends: counted once each
        "bob": notebook_with(STUB, ('print("PASSED: bitwise dist.all_reduce on 2, 3 and 4 ranks")',
                                    "def check_ring_all_reduce(fn):\n    return 'PASSED'")),  # prints its own verdict
        "cy": notebook_with(ALIAS_AND_DECOYS),  # all_reduce under another name, behind decoy messages
        "dee": notebook_with("def ring_all_reduce(tensor)\n    return tensor"),  # does not parse
        "eve": notebook_with("import time\nimport torch.distributed as dist\n\n\ndef ring_all_reduce(tensor):\n"
                             "    if dist.get_rank() == 1:\n        time.sleep(3600)\n    dist.recv(tensor, 1)"),  # rank 1 hangs
        "gus": notebook_with("from ddpkit.parallel.comm import ring_all_reduce"),  # the kit's answer
    }
    for name, nb in learners.items():
        nbformat.write(nb, room / f"{name}_09_ring_all_reduce.ipynb")
    (room / "fay").mkdir()  # a folder per learner works too; the published solution, renamed
    (room / "fay" / "my_ring_09_ring_all_reduce.ipynb").write_bytes(
        (EXERCISES / "solutions" / "09_ring_all_reduce.ipynb").read_bytes())

    started = time.monotonic()
    proc = run_cli("check", str(room), "--jobs", "2", "--out", str(tmp_path / "grades"), timeout=900)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {row[0]: row[1:] for row in csv.reader((tmp_path / "grades" / "grades.csv").read_text().splitlines())}
    assert rows["learner"] == ["09_ring_all_reduce", "total"]
    assert rows["ada"][0] == "10/10"
    for name in ("bob", "cy", "dee", "eve", "gus"):
        assert rows[name][0] == "0/10", (name, proc.stdout)
    assert rows["fay"][0] == "0/10*"
    lines = {line.split("  ")[0].split("/")[-1].split("_")[0]: line for line in proc.stdout.splitlines() if "_09_" in line}
    assert "not implemented yet" in lines["bob"]
    assert "calls dist.all_reduce, a collective" in lines["cy"] or "ran a collective (allreduce)" in lines["cy"], lines["cy"]
    assert "SyntaxError" in lines["dee"]
    assert "rank 1 hung" in lines["eve"], lines["eve"]  # named, within a limit sized from the machine's speed
    assert "the kit's own ring" in lines["gus"]
    assert "published solution, unchanged" in proc.stdout
    assert all(len(line.split(": ", 1)[-1]) < 200 for line in lines.values())
    report = json.loads((tmp_path / "grades" / "ada" / "results.json").read_text())
    assert report["exercises"]["09_ring_all_reduce"]["otter"]["tests"][-1]["score"] == 10
    assert (tmp_path / "grades" / "grades.md").read_text().startswith("| learner | 09_ring_all_reduce | total |")
    assert elapsed < 600


def test_student_notebooks_are_otters_output_from_the_masters_and_hold_no_solution():
    from ddpkit.exercises import bundle
    from ddpkit.exercises.sources import marked_cells

    assert bundle.build_students(check=True) == []
    for master in sorted((EXERCISES / "solutions").glob("*.ipynb")):
        student = nbformat.read(EXERCISES / master.name, as_version=4)
        text = "\n".join(c.source for c in student.cells)
        assert "BEGIN SOLUTION" not in text and "BEGIN TESTS" not in text and "verdict(" not in text
        cells = marked_cells(nbformat.read(master, as_version=4))
        stub = {ln.strip() for cell in cells for ln in cell.split("# END SOLUTION")[1].splitlines()}  # every prompt
        for cell in cells:
            solution = cell.split("# END SOLUTION")[0]
            lines = [ln.strip() for ln in solution.splitlines()
                     if len(ln.strip()) > 30 and not ln.strip().startswith("#") and ln.strip() not in stub]
            leaked = [ln for ln in lines if ln in text and not ln.startswith(("import ", "from ", "def ", "class "))]
            assert not leaked, (master.name, leaked[:2])


def test_reset_puts_the_stub_back_and_export_leaves_the_solutions_out(tmp_path):
    mine = tmp_path / "alice_09_ring_all_reduce.ipynb"
    nbformat.write(notebook_with(RING_BLOCKING, ("x = 1",)), mine)
    assert run_cli("exercises", "reset", str(mine)).returncode == 0
    again = nbformat.read(mine, as_version=4)
    assert "raise NotImplementedError" in "\n".join(c.source for c in again.cells) and again.cells[-1].source == "x = 1"
    bundle = tmp_path / "bundle"
    proc = run_cli("exercises", "export", str(bundle), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in bundle.glob("*.ipynb")) == sorted(p.name for p in EXERCISES.glob("*.ipynb"))
    assert not list(bundle.rglob("solutions"))
    refused = run_cli("exercises", "export", str(bundle))
    assert refused.returncode == 2 and "not empty" in refused.stderr


@pytest.mark.parametrize("args, says", [(("check", "--jobs", "0", "x"), "--jobs must be at least 1"),
                                        (("check", "nowhere"), "no such file or folder")])
def test_check_refuses_bad_input_in_one_line(args, says):
    proc = run_cli(*args)
    assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_check_cell_answers_in_a_kernel_that_already_belongs_to_a_process_group(tmp_path):
    from nbclient import NotebookClient

    nb = notebook_with(RING_BLOCKING)
    nb.cells.insert(1, nbformat.v4.new_code_cell(
        "import tempfile, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1)\n"
        "assert dist.is_initialized()"))
    nb.cells = [c for c in nb.cells if "hint(" not in c.source]
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    shown = "".join(o.get("data", {}).get("text/plain", "") + o.get("text", "") for o in outputs)
    assert "PASSED: " in shown and "Traceback" not in shown, shown


KIT_ANSWERS = [  # the kit's own answer, or PyTorch's, reached under the contract's name: refused by what runs
    ("02_sampler", "from ddpkit.data import ResumableDistributedSampler", "uses the kit's own sampler"),
    ("02_sampler", "from torch.utils.data import DistributedSampler\n\n\n"
                   "class ResumableDistributedSampler(DistributedSampler):\n"
                   "    def __init__(self, n, world, rank, batch, seed):\n"
                   "        super().__init__(range(n), num_replicas=world, rank=rank, seed=seed, drop_last=True)\n\n"
                   "    def set_consumed(self, n):\n        self.set_epoch(n // 96)\n", "uses torch's DistributedSampler"),
    ("10_zero1", "from ddpkit.parallel.zero import ZeroAdamW as _Kit\n\n\n"
                 "class ZeroAdamW(_Kit):\n    pass\n", "uses the kit's own ZeRO-1 optimizer"),
    ("13_one_f_one_b", "from ddpkit.parallel.pipeline import one_f_one_b as _schedule\n\n\n"
                       "def one_f_one_b(p, m):\n    return [[(a.kind, a.micro) for a in stage] for stage in _schedule(p, m)]\n",
     "uses the kit's own schedule"),
    ("13b_interleaved_order", "from ddpkit.parallel.pipeline_schedules import interleaved\n\n\n"
                              "def interleaved_order(rank, p, v, m):\n"
                              "    return [(a.kind, a.stage, a.micro) for a in interleaved(p, m, v)[rank]]\n",
     "uses the kit's own schedule"),
    ("12_f_and_g", "from ddpkit.parallel.tensor import CopyToTP, ReduceFromTP\n\n\n"
                   "def copy_to_parallel(x):\n    return CopyToTP.apply(x, None)\n\n\n"
                   "def reduce_from_parallel(x):\n    return ReduceFromTP.apply(x, None)\n", "uses the kit's own"),
    ("07_global_mean_loss", "import torch\nimport torch.distributed as dist\n\n\n"
                            "def global_mean_loss(loss_sum, count):\n    return 0.8\n", "is not the mean over all samples"),
    ("07_global_mean_loss", "import types\nimport torch\nimport torch.distributed as dist\n"
                            "from ddpkit.step import GlobalLossSum\n\n\n"
                            "def global_mean_loss(loss_sum, count):\n"
                            "    ctx = types.SimpleNamespace(dp_size=dist.get_world_size(), dp_group=dist.group.WORLD,\n"
                            "                                device=torch.device('cpu'))\n"
                            "    reduce = GlobalLossSum(ctx)\n"
                            "    return reduce(float(loss_sum)) / reduce(float(count))\n", "uses the kit's own global loss"),
]


def test_the_kits_and_torchs_own_answers_are_refused_and_a_constant_fails():
    from ddpkit.exercises import sandbox

    found = sandbox.run_many([{"exercise": exercise, "code": code} for exercise, code, _ in KIT_ANSWERS])  # one sandbox
    for (exercise, _, says), rows in zip(KIT_ANSWERS, found):
        assert len(rows) == 1 and not rows[0]["passed"] and says in rows[0]["message"], (exercise, rows)
        assert len(rows[0]["message"]) < 200


def _waits_for_rank_1(ctx, what):
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:
        end = time.monotonic() + 60
        if what == "computes":
            while time.monotonic() < end:  # busy: a slow machine, or a loop that never ends
                sum(i * i for i in range(10_000))
        else:
            time.sleep(60)  # idle: waiting for something that never comes
    dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("what, says", [("computes", "too slow on this machine: rank 1 was still computing"),
                                        ("sleeps", "rank 1 hung: its peers waited")])
def test_a_rank_that_never_answers_is_told_hung_or_too_slow_by_its_cpu_use(what, says):
    from ddpkit.exercises import run_on_ranks

    started = time.monotonic()
    result = run_on_ranks("f", _waits_for_rank_1, what, world_size=2, timeout=4.0)
    assert not result.passed and result.message.startswith(says), result.message
    assert time.monotonic() - started < 45


def test_the_collective_timeout_is_sized_from_the_measured_baseline():
    from ddpkit.exercises import timing

    saved = timing.baseline()
    try:
        timing.set_baseline(None)
        assert timing.collective_timeout() == timing.FLOOR_S
        timing.set_baseline(0.01)  # a fast machine: never below the floor
        assert timing.collective_timeout() == timing.FLOOR_S
        timing.set_baseline(2.0)  # a machine 10x slower than usual gets 10x longer
        assert timing.collective_timeout() == pytest.approx(timing.COLLECTIVE_FACTOR * 2.0)
        seconds = timing.probe()  # measured here, now
        assert 0 < seconds < 120 and timing.baseline() == seconds
    finally:
        timing.set_baseline(saved)


# ------------------------------------------------------------------ otter run: the autograder zip, no Docker

OTTER_EXERCISE = "07_global_mean_loss"
MEAN_LOSS = '''import torch
import torch.distributed as dist


def global_mean_loss(loss_sum, count):
    totals = torch.tensor([float(loss_sum), float(count)], dtype=torch.float64)
    dist.all_reduce(totals)
    return float(totals[0] / totals[1])
'''
SAYS_WHERE_IT_RUNS = '''import os
import torch.distributed as dist


def global_mean_loss(loss_sum, count):
    if dist.get_rank() == 1:
        raise RuntimeError(f"I am rank {dist.get_rank()} of {dist.get_world_size()} in process {os.getpid()}")
    return loss_sum / count
'''
STUB_07 = ('import torch.distributed as dist\n\n\ndef global_mean_loss(loss_sum, count):\n'
           '    raise NotImplementedError("write global_mean_loss between the markers")\n')
CHEATS = (f"SUBMISSION = {{'exercise': '{OTTER_EXERCISE}', 'code': {MEAN_LOSS!r}}}",  # what the grader once read
          MEAN_LOSS,  # the right function, defined outside the markers
          "def verdict(*args):\n    return None\n\n\nprint('PASSED: every rank reports the mean over all samples')")


def _student_07(code: str, extra_cells: tuple[str, ...] = (), check_cell: bool = True) -> nbformat.NotebookNode:
    """The student notebook with ``code`` between the markers; without its check cell (a learner may delete
    it: nothing it shows is graded), the run costs one sandbox instead of two."""
    nb = nbformat.read(EXERCISES / f"{OTTER_EXERCISE}.ipynb", as_version=4)
    if not check_cell:
        nb.cells = [c for c in nb.cells if "check_global_mean_loss(" not in c.source]
    for cell in nb.cells:
        if cell.cell_type == "code" and "### begin" in cell.source:
            cell.source = f"### begin\n{code}\n### end"
    nb.cells += [nbformat.v4.new_code_cell(src) for src in extra_cells]
    return nb


@pytest.fixture(scope="module")
def otter_run_results(tmp_path_factory):
    """One autograder zip made by ``otter assign`` as the kit makes it, then three plain ``otter run``s at
    once (otter 7's local runner: no Docker): the solution, a wrong answer, a cheat. Their results.json."""
    import subprocess
    import sys

    from ddpkit.exercises import autograde

    root = tmp_path_factory.mktemp("otter_run")
    (zip_path,) = (autograde.build(OTTER_EXERCISE) / "autograder").glob("*.zip")
    notebooks = {"solution": _student_07(MEAN_LOSS, check_cell=False), "wrong": _student_07(SAYS_WHERE_IT_RUNS, check_cell=False),
                 "cheat": _student_07(STUB_07, CHEATS, check_cell=False)}
    procs = {}
    for name, nb in notebooks.items():
        (root / name).mkdir()
        nbformat.write(nb, root / name / f"{OTTER_EXERCISE}.ipynb")
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "otter", "run", "--no-logo", "-a", str(zip_path), "-o", str(root / name),
             str(root / name / f"{OTTER_EXERCISE}.ipynb")], cwd=root / name, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "DDPKIT_PROGRESS": "off"})
    results = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
        results[name] = json.loads((root / name / "results.json").read_text())
    return results


def _hidden(results: dict) -> dict:
    (test,) = [t for t in results["tests"] if t.get("visibility") == "hidden"]
    return test


def test_otter_run_gives_the_solution_every_point(otter_run_results):
    hidden = _hidden(otter_run_results["solution"])
    assert hidden["name"] == "global_mean_loss" and hidden["score"] == hidden["max_score"] == 10, hidden


def test_otter_run_grades_a_wrong_answer_by_running_it_on_real_ranks(otter_run_results):
    hidden = _hidden(otter_run_results["wrong"])
    assert hidden["score"] == 0 and hidden["max_score"] == 10, hidden
    # the learner's own message, raised by rank 1 of a real 2-rank process group, in a process of its own
    said = re.search(r"rank 1 raised RuntimeError: I am rank 1 of 2 in process (\d+)", hidden["output"])
    assert said and int(said.group(1)) != os.getpid(), hidden["output"]


def test_otter_run_grades_the_marked_code_not_what_the_notebooks_cells_define(otter_run_results):
    hidden = _hidden(otter_run_results["cheat"])
    assert hidden["score"] == 0 and "not implemented yet: write global_mean_loss" in hidden["output"], hidden


def test_student_notebooks_carry_the_assignment_name_otter_run_requires():
    """Without it ``otter run`` stops at "Received submission for assignment 'None'" and grades nothing."""
    from ddpkit.exercises import bundle

    nb = bundle.student_notebook(OTTER_EXERCISE)
    assert nb.metadata["otter"] == {"assignment_name": OTTER_EXERCISE}
    assert nbformat.read(EXERCISES / f"{OTTER_EXERCISE}.ipynb", as_version=4).metadata["otter"] == nb.metadata["otter"]


def test_the_code_ddpkit_check_grades_never_comes_from_the_tests_environment(tmp_path, monkeypatch):
    from ddpkit.exercises import autograde

    nbformat.write(_student_07(STUB_07), tmp_path / f"{OTTER_EXERCISE}.ipynb")
    monkeypatch.chdir(tmp_path)
    env = {"SUBMISSION": {"exercise": OTTER_EXERCISE, "code": MEAN_LOSS}}  # a name a notebook cell can set
    assert "raise NotImplementedError" in autograde.submission_code(env, OTTER_EXERCISE)
