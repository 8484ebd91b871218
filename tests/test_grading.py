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
    (room / "fay").mkdir()  # a folder per learner works too; the published solution notebook itself, renamed
    (room / "fay" / "my_ring_09_ring_all_reduce.ipynb").write_bytes(
        (EXERCISES / "solutions" / "09_ring_all_reduce.ipynb").read_bytes())
    nbformat.write(notebook_with(_typed_solution("09_ring_all_reduce")), room / "joy_09_ring_all_reduce.ipynb")
    (room / "hal").mkdir()  # two more exercises: the first stage of three right, and a plainly wrong answer
    ddp = nbformat.read(EXERCISES / "05_ddp_from_scratch.ipynb", as_version=4)
    master = nbformat.read(EXERCISES / "solutions" / "05_ddp_from_scratch.ipynb", as_version=4)
    first = next(c for c in ddp.cells if c.cell_type == "code" and "### begin" in c.source)
    first.source = next(c.source for c in master.cells if c.cell_type == "code" and "### begin" in c.source)
    nbformat.write(ddp, room / "hal" / "05_ddp_from_scratch.ipynb")
    nbformat.write(_student_07("def global_mean_loss(loss_sum, count):\n    return loss_sum / count"),
                   room / "hal" / "07_global_mean_loss.ipynb")
    live = nbformat.read(EXERCISES / "00_build_it_live.ipynb", as_version=4)  # untouched, check cells deleted
    live.cells = [c for c in live.cells if "check_" not in c.source]
    live.cells.append(nbformat.v4.new_code_cell('print("PASSED: all 8 checks")'))
    nbformat.write(live, room / "ivy_00_build_it_live.ipynb")

    started = time.monotonic()
    proc = run_cli("check", str(room), "--jobs", "2", "--out", str(tmp_path / "grades"), timeout=900)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    table = list(csv.reader((tmp_path / "grades" / "grades.csv").read_text().splitlines()))
    header = table[0]
    rows = {row[0]: dict(zip(header[1:], row[1:])) for row in table[1:]}
    assert header == ["learner", "05_ddp_from_scratch", "07_global_mean_loss", "09_ring_all_reduce", "00_build_it_live",
                      "total", "notes"], header
    assert rows["ada"]["09_ring_all_reduce"] == "10/10" and rows["ada"]["total"] == "10/10"
    for name in ("bob", "cy", "dee", "eve", "gus"):
        assert rows[name]["09_ring_all_reduce"] == "0/10", (name, proc.stdout)
    assert rows["fay"]["09_ring_all_reduce"] == "0/10!"  # the solution notebook itself: certain, no points
    assert rows["joy"]["09_ring_all_reduce"] == "10/10*" and rows["joy"]["total"] == "10/10"  # typed: points, review
    assert "the code matches the published solution" in rows["joy"]["notes"], rows["joy"]
    assert rows["fay"]["notes"].startswith("09_ring_all_reduce!: the published solution notebook itself")
    assert rows["hal"] == {"05_ddp_from_scratch": "10/30", "07_global_mean_loss": "0/10", "09_ring_all_reduce": "-",
                           "00_build_it_live": "-", "total": "10/40", "notes": ""}, rows["hal"]
    assert rows["ivy"]["00_build_it_live"] == "0/90", rows["ivy"]  # 8 checks, the last worth 20
    said = [line for line in proc.stdout.splitlines() if ".ipynb  " in line]
    assert any("07_global_mean_loss.ipynb  global_mean_loss: on 2 ranks the ranks report different losses" in line
               for line in said), said
    assert any("05_ddp_from_scratch.ipynb  overlap: not implemented yet: write OverlapDDP" in line for line in said)
    assert sum("ivy_00_build_it_live.ipynb" in line and "not implemented yet" in line for line in said) == 8
    lines = {line.split("  ")[0].split("/")[-1].split("_")[0]: line for line in proc.stdout.splitlines() if "_09_" in line}
    assert "not implemented yet" in lines["bob"]
    assert "calls dist.all_reduce, a collective" in lines["cy"] or "ran a collective (allreduce)" in lines["cy"], lines["cy"]
    assert "SyntaxError" in lines["dee"]
    assert "rank 1 hung" in lines["eve"], lines["eve"]  # named, within a limit sized from the machine's speed
    assert "the kit's own ring" in lines["gus"]
    assert "the published solution notebook itself" in lines["my"] and "no points" in lines["my"], lines["my"]
    assert all(len(line.split(": ", 1)[-1]) < 200 for line in lines.values())
    report = json.loads((tmp_path / "grades" / "ada" / "results.json").read_text())
    assert report["exercises"]["09_ring_all_reduce"]["otter"]["tests"][-1]["score"] == 10
    assert "flag" not in report["exercises"]["09_ring_all_reduce"]
    joy = json.loads((tmp_path / "grades" / "joy" / "results.json").read_text())["exercises"]["09_ring_all_reduce"]
    assert joy["flag"] == "review" and joy["score"] == 10 and "points kept, to review" in joy["note"], joy
    fay = json.loads((tmp_path / "grades" / "fay" / "results.json").read_text())["exercises"]["09_ring_all_reduce"]
    assert fay["flag"] == "solution_notebook" and fay["score"] == 0 and all(c["passed"] for c in fay["checks"]), fay
    markdown = (tmp_path / "grades" / "grades.md").read_text()
    assert "- joy, 09_ring_all_reduce: the code matches the published solution" in markdown and "`*` to review" in markdown
    assert (tmp_path / "grades" / "grades.md").read_text().startswith(
        "| learner | 05_ddp_from_scratch | 07_global_mean_loss | 09_ring_all_reduce | 00_build_it_live | total |")
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


def _links_a_bundle_cannot_follow(nb) -> list[str]:
    """Markdown link targets that are not absolute web addresses (a bundle holds only the student notebooks)."""
    return [target for cell in nb.cells if cell.cell_type == "markdown"
            for target in re.findall(r"\]\(([^)\s]+)\)", cell.source) if not re.match(r"https?://", target)]


def test_student_notebooks_link_to_lessons_and_solutions_a_bundle_can_reach():
    """An exported bundle has no solutions/ and no notebooks/ folder: every link a student notebook holds is
    a web address (the repository on GitHub), which the old relative links were not."""
    old = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "**Lesson:** [09](../notebooks/09_collectives.ipynb) · **Solution:** [09](solutions/09_ring_all_reduce.ipynb)")])
    assert _links_a_bundle_cannot_follow(old) == ["../notebooks/09_collectives.ipynb", "solutions/09_ring_all_reduce.ipynb"]
    for path in sorted(EXERCISES.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        assert _links_a_bundle_cannot_follow(nb) == [], path.name
        intro = nb.cells[0].source
        assert f"exercises/solutions/{path.name})" in intro and "a student bundle has none" in intro, path.name


def test_the_guides_total_time_is_the_sum_of_its_table():
    """exercises/README.md states how long the exercises take in all: the sum of its table's times (00's range
    aside, which it names on its own)."""
    guide = (EXERCISES / "README.md").read_text()
    rows = [line for line in guide.splitlines() if re.match(r"\| \d\d\w? \| \[", line)]
    times = [line.rstrip(" |").rsplit("|", 1)[1].strip() for line in rows]
    assert len(rows) == len(list(EXERCISES.glob("*.ipynb"))), len(rows)
    total = sum(int(t.split()[0]) for t in times if re.fullmatch(r"\d+ min", t))
    assert [t for t in times if not re.fullmatch(r"\d+ min", t)] == ["60-90 min"]
    stated = re.search(r"The exercises add up to about (\d+) minutes", guide)
    assert stated and int(stated.group(1)) == total, (stated and stated.group(1), total)


def test_export_outside_a_clone_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """A pip-installed ddpkit has no exercises/ folder: the bundle and the reset are made from its masters."""
    import argparse

    from ddpkit.exercises import autograde, commands

    monkeypatch.setattr(autograde, "EXERCISES_DIR", tmp_path / "exercises")
    code = commands.run_command(argparse.Namespace(command="exercises", action="export", folder=str(tmp_path / "b")))
    err = capsys.readouterr().err
    assert code == 2 and "works from a clone of the repository" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("args, says", [(("check", "--jobs", "0", "x"), "--jobs must be at least 1"),
                                        (("check", "--memory-gb", "0.1", "x"), "--memory-gb must be between 0.5 and 1024"),
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


def _solution_code(exercise: str) -> str:
    """A master's marked code, as the grader reads a learner's notebook (the solution, then otter's prompt
    as a string: harmless)."""
    from ddpkit.exercises import catalog
    from ddpkit.exercises.sources import learner_code

    return learner_code(nbformat.read(EXERCISES / "solutions" / f"{exercise}.ipynb", as_version=4),
                        catalog.exercise(exercise).names)


def _typed_solution(exercise: str, renames: dict[str, str] | None = None) -> str:
    """The published solution as a learner could type it: no comments, no otter markers, variables renamed."""
    import ast

    from ddpkit.exercises.submissions import _solution_only

    code = ast.unparse(ast.parse(_solution_only(_solution_code(exercise))))
    for old, new in (renames or {"incoming": "received", "world": "size"}).items():
        code = re.sub(rf"\b{old}\b", new, code)
    return code


BROADCAST_TYPED = """import torch
import torch.distributed as dist


def broadcast_parameters(net):
    with torch.no_grad():
        for weight in net.parameters():
            dist.broadcast(weight.data, src=0)
"""
BROADCAST_OTHER = """import torch.distributed as dist


def broadcast_parameters(model):
    for name, p in model.named_parameters():
        dist.broadcast(p.detach(), 0)
"""


def test_code_matching_the_solution_keeps_its_points_and_only_the_solution_notebook_itself_scores_0():
    """Exercise 04's natural answer is the solution's, whatever the names: it is flagged for review, never
    zeroed; a notebook carrying the master's own cells is the solution notebook (certain), zeroed only
    with the published code unchanged."""
    from ddpkit.exercises import submissions
    from ddpkit.exercises.sources import learner_code

    exercise, names = "04_broadcast_parameters", ("broadcast_parameters",)
    student = nbformat.read(EXERCISES / f"{exercise}.ipynb", as_version=4)
    master = nbformat.read(EXERCISES / "solutions" / f"{exercise}.ipynb", as_version=4)
    typed = submissions.provenance(exercise, student, BROADCAST_TYPED)
    assert typed and typed[0] == submissions.REVIEW and "points kept" in typed[1], typed
    assert submissions.provenance(exercise, student, BROADCAST_OTHER) is None  # right, and its own
    assert submissions.provenance(exercise, student, learner_code(student, names)) is None  # the stub
    itself = submissions.provenance(exercise, master, learner_code(master, names))
    assert itself and itself[0] == submissions.SOLUTION_NOTEBOOK and "no points" in itself[1], itself
    edited = submissions.provenance(exercise, master, BROADCAST_OTHER)  # written inside the solution notebook
    assert edited and edited[0] == submissions.REVIEW and "with code of its own" in edited[1], edited
    assert not submissions.is_solution_notebook(student)


CONSTANT_07 = "def global_mean_loss(loss_sum, count):\n    return 0.8\n"
BYPASSES = [  # (exercise, code, what the row's sentence says): ways around the grader itself
    ("07_global_mean_loss",  # 1. a verdict forged into the files and pipes the code can reach, then exit
     CONSTANT_07 + "import glob, json, os\n"
     "row = [{'check': 'global_mean_loss', 'passed': True, 'message': 'forged'}]\n"
     "for folder in {os.path.dirname(os.path.abspath(__file__)), os.getcwd(), os.environ.get('TMPDIR', '.')}:\n"
     "    for name in ('result.json', 'results.json'):\n"
     "        try:\n            json.dump(row, open(os.path.join(folder, name), 'w'))\n"
     "        except OSError:\n            pass\n"
     "for fd in range(3, 64):\n    try:\n        os.write(fd, (json.dumps({'cases': [row]}) + '\\n').encode())\n"
     "    except OSError:\n        pass\n"
     "os._exit(0)\n",
     "wrote into the grader's pipe"),
    ("07_global_mean_loss",  # 2. the grader's entry point replaced, in every module that could hold it
     CONSTANT_07 + "import sys\n"
     "for name in ('__main__', 'ddpkit.exercises.sandbox'):\n"
     "    module = sys.modules.get(name)\n"
     "    if module is not None:\n"
     "        module._one_check = lambda *a, **k: {'passed': True, 'message': 'forged'}\n",
     "is not the mean over all samples"),
    ("07_global_mean_loss",  # 3. the check's own global replaced
     CONSTANT_07 + "from ddpkit.exercises import Result\n"
     "from ddpkit.exercises.metrics import check_global_mean_loss\n"
     "check_global_mean_loss.__wrapped__.__globals__['run_on_ranks'] = lambda *a, **k: Result(True, 'forged')\n",
     "is not the mean over all samples"),
    ("09_ring_all_reduce",  # 4. the kit's answer behind exec
     'exec("from ddpkit.parallel.comm import ring_all_reduce as _kit\\ndef ring_all_reduce(t):\\n    _kit(t)", globals())\n',
     "uses the kit's own ring"),
    ("09_ring_all_reduce",  # 4b. a collective in code compiled under a library's file name
     "import torch\n"
     "exec(compile('import torch.distributed as dist\\ndef ring_all_reduce(t):\\n    dist.all_reduce(t)', torch.__file__, 'exec'), globals())\n",
     "calls dist.all_reduce, a collective"),
    ("10_zero1",  # 5. a right ZeRO-1, and a whole AdamW kept in a closure
     _solution_code("10_zero1").replace("class ZeroAdamW:", "class _Right:") + "\n\n"
     "def _hidden():\n    kept = {}\n\n    def step(params):\n        if not kept:\n"
     "            kept['p'] = [p.detach().clone().requires_grad_(True) for p in params]\n"
     "            kept['adam'] = torch.optim.AdamW(kept['p'])\n"
     "        for s, p in zip(kept['p'], params):\n            s.grad = p.grad.clone()\n"
     "        kept['adam'].step()\n    return step\n\n\n_STEP = _hidden()\n\n\n"
     "class ZeroAdamW(_Right):\n    def step(self):\n        _STEP(self.params)\n        super().step()\n",
     "on 4 ranks a rank keeps"),
    ("07_global_mean_loss",  # the grader's frames, to read what the rank holds
     "import sys\n\n\ndef global_mean_loss(loss_sum, count):\n    return sys._getframe(1).f_locals['mine'][0][0]\n",
     "no frames to the learner's code"),
    ("07_global_mean_loss",  # the garbage collector, to find the grader's objects
     "import gc\n\n\ndef global_mean_loss(loss_sum, count):\n    gc.get_objects()\n    return 0.8\n",
     "the code tried gc.get_objects, which the grader does not allow"),
    ("07_global_mean_loss",  # the collector again, asked by a thread pool's worker on the learner's behalf
     "import gc\nfrom concurrent.futures import ThreadPoolExecutor\n\n\ndef global_mean_loss(loss_sum, count):\n"
     "    ThreadPoolExecutor(1).submit(gc.get_objects).result()\n    return 0.8\n",
     "the code tried gc.get_objects, which the grader does not allow"),
    ("07_global_mean_loss",  # another process's memory, opened by a raw thread running a library function
     "import _thread, os, time\n\n\ndef global_mean_loss(loss_sum, count):\n"
     "    _thread.start_new_thread(os.open, (f'/proc/{os.getppid()}/mem', os.O_RDONLY))\n    time.sleep(0.5)\n"
     "    return 0.8\n",
     "reading another process's memory or state"),
    ("07_global_mean_loss",  # the write fence: a file outside the sandbox
     f"import os\nopen(os.path.join({str(Path.home())!r}, 'ddpkit-fence-probe'), 'w').write('x')\n" + CONSTANT_07,
     "outside its own folder, which the grader does not allow"),
    ("07_global_mean_loss",  # the write fence again, from code run by exec
     f"exec(\"import os\\nos.open(os.path.join({str(Path.home())!r}, 'ddpkit-fence-probe'), os.O_WRONLY | os.O_CREAT)\")\n" + CONSTANT_07,
     "outside its own folder, which the grader does not allow"),
    ("07_global_mean_loss",  # the grader's pipe: a verdict written without its nonce
     "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'result 0.5\\n')\n    except OSError:\n"
     "        pass\n" + CONSTANT_07,
     "wrote into the grader's pipe"),
]


HOG = ("import time\nimport torch\n\n\ndef global_mean_loss(loss_sum, count):  # 2.8 GB on each rank\n"
       "    kept = [torch.ones(50_000_000) for _ in range(14)]\n    time.sleep(60)\n    return len(kept)\n")


def test_cheats_on_the_grader_itself_are_refused_and_a_memory_hog_is_stopped():
    """Every cheat in one sandbox, each case in its own process; the last case takes 2.8 GB on each rank and
    the whole sandbox is stopped at its 4.5 GB: the cases done before keep their rows, the hog is told why."""
    from ddpkit.exercises import sandbox

    probe = Path.home() / "ddpkit-fence-probe"
    probe.unlink(missing_ok=True)
    started = time.monotonic()
    *found, hog = sandbox.run_many([{"exercise": exercise, "code": code} for exercise, code, _ in BYPASSES] +
                                   [{"exercise": "07_global_mean_loss", "code": HOG}], memory_mb=4608)
    for (exercise, code, says), rows in zip(BYPASSES, found):
        assert rows and all(not r["passed"] for r in rows), (exercise, code, rows)
        assert says in rows[0]["message"] and len(rows[0]["message"]) <= 200, (exercise, code, rows)
    assert not probe.exists()
    assert not hog[0]["passed"] and hog[0]["message"].startswith("used more than 4.5 GB of memory"), hog
    assert time.monotonic() - started < 180


MEAN_LOSS_OWN = ("import torch\nimport torch.distributed as dist\n\n\ndef global_mean_loss(loss_sum, count):\n"
                 "    both = torch.tensor([loss_sum, count], dtype=torch.float64)\n"
                 "    dist.all_reduce(both, op=dist.ReduceOp.SUM)\n    return both[0].item() / both[1].item()\n")
GROWS_WITHOUT_END = ("import time\nimport torch\n\n\ndef global_mean_loss(loss_sum, count):\n    kept = []\n"
                     "    while True:  # 10 MB every 20 ms, on every rank\n"
                     "        kept.append(torch.ones(2_500_000))\n        time.sleep(0.02)\n")


def test_ddpkit_check_stops_a_memory_hog_in_bounded_time_and_says_so(tmp_path):
    """Through ddpkit check itself: a notebook whose ranks grow a list without end is stopped at the room's
    --memory-gb (all its processes together) with a sentence; the next learner's notebook still gets its
    points."""
    room = tmp_path / "room"
    room.mkdir()
    nbformat.write(_student_07(GROWS_WITHOUT_END, check_cell=False), room / "hog_07_global_mean_loss.ipynb")
    nbformat.write(_student_07(MEAN_LOSS_OWN, check_cell=False), room / "kim_07_global_mean_loss.ipynb")
    started = time.monotonic()
    proc = run_cli("check", str(room), "--memory-gb", "3", "--out", str(tmp_path / "grades"), timeout=600)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {row[0]: row for row in csv.reader((tmp_path / "grades" / "grades.csv").read_text().splitlines())}
    assert rows["hog"][1] == "0/10" and rows["kim"][1] == "10/10", rows
    said = [line for line in proc.stdout.splitlines() if "hog_07_global_mean_loss.ipynb  global_mean_loss: " in line]
    assert said and said[0].endswith("used more than 3 GB of memory: look for a tensor or a list that grows without end"), \
        proc.stdout
    assert elapsed < 240, elapsed


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


def _every_rank_receives_first(ctx):
    import torch
    import torch.distributed as dist

    incoming = torch.empty(4)
    dist.recv(incoming, (ctx.rank - 1) % ctx.world_size)  # nobody sends: gloo gives up after the timeout
    dist.send(torch.ones(4), (ctx.rank + 1) % ctx.world_size)


def test_ranks_that_all_wait_to_receive_are_told_a_deadlock_not_gloos_text():
    from ddpkit.exercises import run_on_ranks

    started = time.monotonic()
    result = run_on_ranks("f", _every_rank_receives_first, world_size=3, timeout=4.0)
    assert not result.passed and re.match(r"deadlock: ranks? [\d, and]+ waited 4 s for a message or a collective that no "
                                          r"peer sent or joined", result.message), result.message
    assert ".cc" not in result.message and len(result.message) < 200
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
