"""The launcher, on real processes and real gloo process groups."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import multiprocessing
import nbformat
import papermill
import pytest
import torch
import torch.distributed as dist

import ddpkit

from ddpkit.launch import launch, resolve_start_method


def rank_sum(ctx, offset):
    """all_reduce of (rank + offset): the answer is known in closed form."""
    value = torch.tensor([float(ctx.rank + offset)])
    dist.all_reduce(value)
    print(f"rank {ctx.rank} of {ctx.world_size} got {value.item():g}")
    return {"rank": ctx.rank, "world": dist.get_world_size(), "sum": value}


def fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("bad batch 7 on purpose")
    dist.barrier()  # rank 0 waits here and loses its peer: a knock-on failure


def exit_on_rank_one(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.barrier()


def hang_on_rank_one(ctx):
    if ctx.rank == 1:
        time.sleep(600)
    dist.barrier()


def children() -> set[int]:
    """PIDs of this process's live children, straight from /proc.

    Python's own ``multiprocessing.resource_tracker`` is left out: one per interpreter, started by
    the first spawn and shared by all later ones, it is not something a launch leaves behind.
    """
    me, found = str(os.getpid()), set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                with open(f"/proc/{pid}/cmdline") as f:
                    if "resource_tracker" not in f.read():
                        found.add(int(pid))
    return found


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_by_rank(world_size):
    results = launch(rank_sum, 10, world_size=world_size, output="none")
    expected = sum(r + 10 for r in range(world_size))
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world"] == world_size for r in results)
    for r in results:  # a real CPU tensor, owned by us, not shared with a dead process
        assert isinstance(r["sum"], torch.Tensor) and r["sum"].item() == expected


def test_output_is_relayed_with_rank_prefix_or_rank0_only(capsys):
    launch(rank_sum, 0, world_size=2, output="all")
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 of 2 got 1" in out and "[rank 1] rank 1 of 2 got 1" in out
    launch(rank_sum, 0, world_size=2, output="rank0")
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 of 2 got 1" in out and "[rank 1]" not in out


def test_spawn_works_for_an_importable_function():
    results = launch(rank_sum, 1, world_size=2, start_method="spawn", output="none")
    assert [r["sum"].item() for r in results] == [3.0, 3.0]


def test_raising_rank_is_named_with_type_message_and_traceback():
    started = time.monotonic()
    with pytest.raises(ddpkit.LaunchError) as info:
        launch(fail_on_rank_one, world_size=2, output="none")
    elapsed = time.monotonic() - started
    error = info.value
    assert error.rank == 1 and error.root_cause.exc_type == "ValueError"
    assert "bad batch 7 on purpose" in error.root_cause.message
    assert "fail_on_rank_one" in error.root_cause.traceback  # the rank's own traceback
    assert str(error).splitlines()[0] == "rank 1 raised: ValueError: bad batch 7 on purpose"
    assert [f.rank for f in error.others] == [0]  # rank 0's lost peer is listed, not blamed
    assert elapsed < 10, f"took {elapsed:.1f}s to report"
    assert not children()


def test_rank_that_exits_early_is_named():
    with pytest.raises(ddpkit.LaunchError) as info:
        launch(exit_on_rank_one, world_size=2, output="none")
    assert info.value.rank == 1 and info.value.root_cause.exc_type == "exit code 3"
    assert not children()


def test_hanging_rank_is_named_as_stalled_within_the_timeout():
    timeout = 2.0
    started = time.monotonic()
    with pytest.raises(ddpkit.LaunchError) as info:
        launch(hang_on_rank_one, world_size=2, timeout=timeout, output="none")
    elapsed = time.monotonic() - started
    cause = info.value.root_cause
    assert cause.rank == 1 and cause.kind == "stalled"
    assert "hang_on_rank_one" in cause.traceback  # its Python stack, dumped before it was stopped
    assert elapsed < timeout + 5, f"stall reported after {elapsed:.1f}s"
    assert not children()


def test_fifty_launches_leak_nothing():
    launch(rank_sum, 0, world_size=2, output="none")  # warm up lazy imports
    env = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)}
    fds = set(os.listdir("/proc/self/fd"))
    for i in range(50):
        assert launch(rank_sum, i, world_size=2, output="none")[1]["sum"].item() == 2 * i + 1
    assert not children() and not multiprocessing.active_children()
    assert dict(os.environ) == env
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert set(os.listdir("/proc/self/fd")) == fds


def test_log_dir_keeps_per_rank_logs(tmp_path):
    launch(rank_sum, 0, world_size=2, output="none", log_dir=str(tmp_path))
    assert "rank 1 of 2 got 1" in (tmp_path / "rank1.log").read_text()


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0), "world_size must be"),
    (dict(world_size="2"), "world_size must be"),
    (dict(world_size=2, backend="nccl"), "--backend gloo"),
    (dict(world_size=2, output="loud"), "output must be"),
    (dict(world_size=2, start_method="spawn"), "cannot import it"),
])
def test_bad_requests_fail_before_spawning(kwargs, message):
    def local_fn(ctx):  # defined locally: not importable, like a notebook cell's function
        return ctx.rank
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        launch(local_fn, **kwargs)
    assert time.monotonic() - started < 1 and not children()


def test_fork_after_cuda_init_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="after CUDA is initialised"):
        launch(rank_sum, 0, world_size=2, start_method="fork")
    with pytest.raises(ValueError, match="defined in __main__"):
        resolve_start_method("auto", lambda ctx: None)
    assert resolve_start_method("auto", rank_sum) == "spawn"  # importable: spawn is fine
    assert not children()


def test_function_defined_in_main_runs_from_a_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from ddpkit import launch

        def worker(ctx):
            t = torch.ones(1) * (ctx.rank + 1)
            dist.all_reduce(t)
            print("total", int(t.item()))
            return int(t.item())

        if __name__ == "__main__":
            print("results", launch(worker, world_size=2))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "[rank 1] total 3" in proc.stdout and "results [3, 3]" in proc.stdout


def test_notebook_cell_launches_its_own_function(tmp_path):
    """papermill runs a real kernel: the function lives in the kernel's __main__ and needs fork."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("n = 2", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(textwrap.dedent("""
            import torch, torch.distributed as dist
            import ddpkit

            def cell_worker(ctx):
                t = torch.tensor([ctx.rank + 1.0])
                dist.all_reduce(t)
                print(f"hello from rank {ctx.rank}, sum {t.item():g}")
                return t.item()

            results = ddpkit.launch(cell_worker, world_size=n)
            assert results == [3.0, 3.0], results
        """)),
    ]
    src, out = tmp_path / "launch.ipynb", tmp_path / "out.ipynb"
    nbformat.write(nb, src)
    papermill.execute_notebook(str(src), str(out), kernel_name="python3", cwd=str(tmp_path),
                               execution_timeout=120, progress_bar=False)
    text = "".join(o.get("text", "") for c in nbformat.read(out, as_version=4).cells
                   for o in c.get("outputs", []))
    assert "[rank 1] hello from rank 1, sum 3" in text
