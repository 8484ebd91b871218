"""The launcher, on real processes and real gloo process groups."""

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import collections
import dataclasses
import datetime
import multiprocessing
import tempfile
import threading
import warnings

import nbformat
import papermill
import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit import runtime
from ddpkit.launch import launch, resolve_start_method

launcher = sys.modules["ddpkit.launch"]  # the package exports the function under the module's name


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
    launch(rank_sum, 0, world_size=2, output="none")  # the cost of a launch on this machine, now: the baseline
    baseline = time.monotonic() - started
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
    assert elapsed < baseline + 5, f"took {elapsed:.1f}s to report (a plain launch took {baseline:.1f}s)"
    assert not children()


def test_rank_that_exits_early_is_named():
    with pytest.raises(ddpkit.LaunchError) as info:
        launch(exit_on_rank_one, world_size=2, output="none")
    assert info.value.rank == 1 and info.value.root_cause.exc_type == "exit code 3"
    assert not children()


def test_hanging_rank_is_named_as_stalled_within_the_timeout():
    timeout = 2.0
    started = time.monotonic()
    launch(rank_sum, 0, world_size=2, output="none")  # the cost of a launch on this machine, now: the baseline
    baseline = time.monotonic() - started
    started = time.monotonic()
    with pytest.raises(ddpkit.LaunchError) as info:
        launch(hang_on_rank_one, world_size=2, timeout=timeout, output="none")
    elapsed = time.monotonic() - started
    cause = info.value.root_cause
    assert cause.rank == 1 and cause.kind == "stalled"
    assert "hang_on_rank_one" in cause.traceback  # its Python stack, dumped before it was stopped
    assert elapsed < baseline + timeout + 3, f"stall reported after {elapsed:.1f}s (a plain launch took {baseline:.1f}s)"
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
    (dict(world_size=65), "world_size must be"),
    (dict(world_size=2, timeout=float("inf")), "timeout must be"),
    (dict(world_size=2, timeout=1e30), "timeout must be"),
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
    monkeypatch.setattr(runtime, "cuda_touched", lambda: True)
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


def user_timeout_on_rank_one(ctx):
    if ctx.rank == 1:
        raise TimeoutError("reading shard 3 timed out")
    time.sleep(3)  # healthy and busy: it has not reached the collective yet
    dist.barrier()


def test_a_users_timeout_error_is_the_cause_and_the_busy_peer_is_not_blamed():
    with pytest.raises(ddpkit.LaunchError) as info:
        launch(user_timeout_on_rank_one, world_size=2, output="none")
    cause = info.value.root_cause
    assert (cause.rank, cause.exc_type, cause.message) == (1, "TimeoutError", "reading shard 3 timed out")
    assert [(f.rank, f.kind) for f in info.value.others] == [(0, "stopped")]


WATCHDOG_LOG = ("[rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: "
                "WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 2001 milliseconds before timing out.")


def aborted_by_watchdog_while_rank0_hangs(ctx):
    if ctx.rank == 0:
        time.sleep(600)  # the real culprit: never reaches the collective
    sys.stderr.write(WATCHDOG_LOG + "\n")  # what NCCL's watchdog writes before it aborts a waiting rank
    sys.stderr.flush()
    os.abort()


def test_a_rank_sigabrted_after_a_collective_timeout_is_knock_on_and_the_hung_rank_is_named():
    with pytest.raises(ddpkit.LaunchError) as info:
        # The verdict comes one knock-on window after rank 1's abort, whatever the timeout: a short timeout
        # would only bound the process group's start, which a busy machine can miss.
        launch(aborted_by_watchdog_while_rank0_hangs, world_size=2, timeout=60, output="none")
    cause = info.value.root_cause
    assert (cause.rank, cause.kind) == (0, "stalled"), info.value.render()
    assert "aborted_by_watchdog" in cause.traceback
    assert [(f.rank, f.exc_type, f.is_knock_on) for f in info.value.others] == [(1, "SIGABRT", True)]
    assert not children()


def test_a_given_log_dir_keeps_the_users_files(tmp_path):
    mine = {"notes.log": "keep me", "rank0.txt": "and me", "train.log": "me too"}
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "rank1.result").write_bytes(b"a stale result of ours")
    launch(rank_sum, 0, world_size=2, output="none", log_dir=str(tmp_path))
    for name, text in mine.items():
        assert (tmp_path / name).read_text() == text
    assert "rank 1 of 2 got 1" in (tmp_path / "rank1.log").read_text()


def progress_bar(ctx):
    for i in (1, 2, 3):
        print(f"\rworking {i}/3", end="", flush=True)  # a progress bar: carriage returns, no newline
        time.sleep(1.0)
    return time.time()


class TimedStdout:
    def __init__(self):
        self.chunks = []

    def write(self, text):
        self.chunks.append((time.time(), text))

    def flush(self):
        pass


def test_progress_written_with_carriage_returns_is_relayed_while_the_rank_runs(monkeypatch):
    out = TimedStdout()
    monkeypatch.setattr(sys, "stdout", out)
    finished_at = launch(progress_bar, world_size=1, output="all")[0]
    first = next(t for t, text in out.chunks if "working 1/3" in text)
    assert first < finished_at - 1.5, "the first update was shown only at the end"
    assert any(text.endswith("\r") for _, text in out.chunks), "updates are redrawn in place"
    assert "working 3/3" in "".join(text for _, text in out.chunks)


Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Box:
    weights: torch.Tensor
    note: str


def odd_containers(ctx):
    grads = collections.defaultdict(list)
    grads["w"].append(torch.ones(2, requires_grad=True) * 2)  # a non-leaf that requires grad
    return {"grads": grads, "pair": Pair(torch.zeros(1, requires_grad=True), [torch.arange(3)]),
            "box": Box(torch.full((2,), float(ctx.rank)), "ok")}


def test_results_in_any_container_come_back_as_plain_cpu_tensors():
    result = launch(odd_containers, world_size=2, output="none")[1]
    assert isinstance(result["grads"], collections.defaultdict) and result["grads"]["w"][0].tolist() == [2.0, 2.0]
    assert isinstance(result["pair"], Pair) and torch.equal(result["pair"].right[0], torch.arange(3))
    assert isinstance(result["box"], Box) and result["box"].weights.tolist() == [1.0, 1.0]
    tensors = [result["grads"]["w"][0], result["pair"].left, result["box"].weights]
    assert all(t.device.type == "cpu" and not t.requires_grad for t in tensors)


def test_a_kernel_whose_environment_says_it_is_a_rank_is_refused(monkeypatch):
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(key, value)
    started = time.monotonic()
    with pytest.raises(ValueError, match="already says it is rank 0 of 1.*os.environ.pop"):
        launch(rank_sum, 0, world_size=2)
    assert time.monotonic() - started < 1 and not children()


def test_a_process_that_already_has_a_process_group_is_refused():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore(),
                            timeout=datetime.timedelta(seconds=5))
    try:
        with pytest.raises(ValueError, match="destroy_process_group"):
            launch(rank_sum, 0, world_size=2)
    finally:
        dist.destroy_process_group()
    assert not children()


def fail_fast(ctx):
    raise ValueError("on purpose")


def test_failed_launches_keep_only_the_newest_log_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for i in range(launcher.KEEP_FAILED_LOGS + 5):
        old = tmp_path / f"{launcher.LOG_PREFIX}old{i:02d}"
        old.mkdir()
        (old / "FAILED").write_text("")
        os.utime(old, (1000 + i, 1000 + i))
    running = tmp_path / f"{launcher.LOG_PREFIX}running"  # a launch in progress elsewhere: never touched
    running.mkdir()
    (running / "launcher.json").write_text(f'{{"pid": {os.getpid()}}}')
    with pytest.raises(ddpkit.LaunchError):
        launch(fail_fast, world_size=1, output="none")
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(launcher.LOG_PREFIX))
    assert len(left) == launcher.KEEP_FAILED_LOGS + 1 and running.name in left
    assert f"{launcher.LOG_PREFIX}old00" not in left and f"{launcher.LOG_PREFIX}old14" in left


def thread_count(ctx):
    return torch.get_num_threads()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_one_thread_rule_whatever_the_start_method(monkeypatch, method):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch(thread_count, world_size=2, start_method=method, output="none") == [1, 1]
    assert launch(thread_count, world_size=1, start_method=method, output="none") == [1]  # not cores / ranks
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's explicit choice: honoured where it is safe
    assert launch(thread_count, world_size=1, start_method=method, output="none") == [1 if method == "fork" else 2]


def test_forking_from_a_multi_threaded_process_does_not_warn():
    """Python 3.12+ warns when fork() runs beside other threads (a notebook kernel always has some)."""
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, daemon=True)
    helper.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            assert launch(rank_sum, 1, world_size=2, output="none")[0]["sum"].item() == 3.0
    finally:
        stop.set()


def hold_rank0_until_a_peer_probed(original, flag):
    """Wrap init_process_group: rank 1 tries the rendezvous port before rank 0 has built its store
    (rank 0 waits for that attempt), and writes down whether the connection was accepted or refused."""
    def init(ctx, *args, **kwargs):
        if ctx.rank == 0:
            deadline = time.monotonic() + 20
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            try:
                socket.create_connection(("127.0.0.1", int(os.environ["MASTER_PORT"])), timeout=10).close()
                outcome = "accepted"
            except ConnectionRefusedError:
                outcome = "refused"
            with open(flag + ".tmp", "w") as handle:
                handle.write(outcome)
            os.replace(flag + ".tmp", flag)
        return original(ctx, *args, **kwargs)
    return init


def first_probe(monkeypatch, tmp_path, name) -> str:
    flag = str(tmp_path / name)
    monkeypatch.setattr(runtime, "init_process_group", hold_rank0_until_a_peer_probed(runtime.init_process_group, flag))
    assert launch(rank_sum, 0, world_size=2, output="none")[1]["sum"].item() == 1.0
    monkeypatch.undo()
    with open(flag) as handle:
        return handle.read()


def test_a_peer_that_starts_before_rank_0_is_never_refused(monkeypatch, tmp_path):
    """A refused connection costs a client 0.25-0.75 s of c10d's back-off: the port must already listen."""
    assert first_probe(monkeypatch, tmp_path, "listening") == "accepted"
    # Negative control: rank 0 opening the port itself (env://), the same early peer is refused.
    monkeypatch.setattr(launcher, "store_takes_listening_socket", lambda: False)
    assert first_probe(monkeypatch, tmp_path, "env") == "refused"
    assert not children()


TRAIN_UNTIL_INTERRUPTED = """
import ddpkit
from ddpkit import train
from ddpkit.config import TrainConfig
ddpkit.launch(train.run, TrainConfig(steps=100_000, log_every=100_000), world_size=2, progress="text")
"""


def kernel_children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry))
    return found


def interrupt_a_training_cell(km, kc, tmp_path, name) -> tuple[str, list[str], float]:
    """Run a long training launch in the kernel, interrupt it as Jupyter's stop button does (SIGINT to the
    kernel's process group, ranks included) once rank 0 reported a few steps; return what the cell showed."""
    msg_id = kc.execute(TRAIN_UNTIL_INTERRUPTED)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        progress = list(tmp_path.glob("ddpkit-launch-*/progress.jsonl"))
        if progress and len(progress[0].read_text().splitlines()) >= 3:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"{name}: no training progress within 180 s")
    interrupted_at = time.monotonic()
    km.interrupt_kernel()
    shown, error = [], None
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            shown.append(content["text"])
        elif kind == "error":
            error = content
        elif kind == "status" and content["execution_state"] == "idle":
            break
    assert error is not None and error["ename"] == "KeyboardInterrupt", f"{name}: {error}"
    return "".join(shown), error["traceback"], time.monotonic() - interrupted_at


UNRENDERED = """
from ddpkit.monitor import Monitor
one_line = Monitor.interrupted
def without_rendering(self, *args):
    stopped = one_line(self, *args)
    del stopped._render_traceback_
    return stopped
Monitor.interrupted = without_rendering
"""


def test_interrupting_a_training_cell_shows_one_line_and_leaves_nothing(tmp_path):
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path), env={**os.environ, "TMPDIR": str(tmp_path)})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        kernel_pid = km.provisioner.process.pid
        text, error, took = interrupt_a_training_cell(km, kc, tmp_path, "launcher")
        assert len(error) == 1 and re.fullmatch(r"interrupted: 2 ranks stopped at step \d+", error[0]), error
        assert int(error[0].rsplit(" ", 1)[1]) >= 3  # the step rank 0 had reached, not a guess
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-2000:]
        assert took < 20, f"took {took:.1f}s to stop"
        assert not kernel_children(kernel_pid), "a rank outlived the interrupted launch"
        assert not list(tmp_path.glob("ddpkit-launch-*")), "the interrupted launch left its folder"
        reply = kc.execute_interactive("print(6 * 7)", timeout=60)  # the kernel itself lives on
        assert reply["content"]["status"] == "ok"
        # Negative control: without the one-line rendering, Jupyter shows the full traceback again.
        kc.execute_interactive(UNRENDERED, timeout=60)
        _, error, _ = interrupt_a_training_cell(km, kc, tmp_path, "control")
        assert len(error) > 1 and any("Traceback" in line for line in error)
        assert not kernel_children(kernel_pid)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# --- the stall report's Flight Recorder summary --------------------------------------------------------------

from ddpkit.debug import flight, mismatch  # noqa: E402


def names_the_skipped_collective(report: str) -> bool:
    """The check: the report names the collective rank 1 never joined, and where its peer called it."""
    return re.search(r"collective #\d+ \(gloo:all_reduce, called at mismatch\.py:\d+ in skipped_collective\) "
                     r"disagrees: rank 1 never issued it", report) is not None


@pytest.mark.skipif(not flight.available(), reason="this torch cannot dump a gloo Flight Recorder")
def test_stall_report_names_the_collective_the_stalled_rank_skipped(monkeypatch):
    """Rank 1 skips one all-reduce in a branch and goes on outside any collective; rank 0 times out.
    The launcher keeps the recorder on by itself (nothing set here) and the report says which
    collective rank 1 did not join. Control: with the recorder off, no dumps, no summary."""
    def stall_report():
        with pytest.raises(ddpkit.LaunchError) as info:
            launch(mismatch.skipped_collective, 4, 1, world_size=2, timeout=1.5, output="none")
        assert info.value.rank == 1 and info.value.root_cause.kind == "stalled"
        return info.value

    monkeypatch.delenv(flight.ENV, raising=False)
    monkeypatch.delenv(flight.OLD_ENV, raising=False)
    started = time.monotonic()
    report = stall_report()
    assert names_the_skipped_collective(str(report)), str(report)
    assert "collectives issued per rank: {0: 4, 1: 3}" in report.flight_summary
    monkeypatch.setenv(flight.ENV, "0")  # negative control: the recorder off
    off = stall_report()
    assert not off.flight_summary and not names_the_skipped_collective(str(off))
    assert not [n for n in os.listdir(off.log_dir) if n.startswith(flight.DUMP_PREFIX)]
    assert time.monotonic() - started < 30
    assert not children()
