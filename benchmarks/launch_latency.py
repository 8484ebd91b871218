"""How long a notebook cell waits for N ranks to reach a barrier and come back, measured side by side.

* ``ddpkit.launch`` (fork; root-cause reports, output relay, stall watchdog, CPU copies of results);
* the same launch with rank 0 opening the rendezvous port itself (env://), as the launcher did before it
  handed rank 0 a socket that already listens: the slow tail this benchmark exists to watch (a client
  rank refused by a port not yet open waits out c10d's 0.25-0.75 s connect back-off);
* a bare fork: raw ``torch.multiprocessing.start_processes``, doing only the process-group set-up;
* ``accelerate.notebook_launcher`` (optional: measured when accelerate is installed), whose function
  builds a ``PartialState`` (which joins the process group) and waits for everyone.

Each launch runs the same work: join a gloo process group, one barrier, leave. The ways are interleaved
(the order rotates every round), so a busy machine slows them alike; the load average is recorded.
Reported: p50 and p90 of the warm launches (and the max). Targets: ddpkit's p90 <= 1.5x its p50 (no
tail), its p50 <= 1.3x the bare fork's, and <= accelerate's. Also: the first launch in a fresh
interpreter (which pays the imports forked ranks then inherit), and a teardown check: N launches in a
row, none may end in an abort.
"""

import contextlib
import datetime
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summarize, write_results  # noqa: E402

from ddpkit.launch import free_port, launch  # noqa: E402
from ddpkit.failures import LaunchError  # noqa: E402

launcher = sys.modules["ddpkit.launch"]  # the package exports the function under the module's name
TARGET_TAIL = 1.5  # p90 / p50
TARGET_OVER_FORK = 1.3  # p50 / the bare fork's p50


def ddpkit_barrier(ctx):
    dist.barrier()


def raw_barrier(rank, world_size, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=30))
    dist.barrier()


def ddpkit_env_rendezvous(world_size: int) -> None:
    """ddpkit with rank 0 opening the port itself: what the launcher did before (see the docstring)."""
    saved = launcher.store_takes_listening_socket
    launcher.store_takes_listening_socket = lambda: False
    try:
        launch(ddpkit_barrier, world_size=world_size, start_method="fork", output="none")
    finally:
        launcher.store_takes_listening_socket = saved


ACCELERATE_WORKER = """
import contextlib, io, os, sys, time
from accelerate import PartialState, notebook_launcher
from ddpkit.launch import free_port

def barrier():
    PartialState().wait_for_everyone()

for line in sys.stdin:
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per launch
        notebook_launcher(barrier, num_processes=int(line), use_port=str(free_port()))
    os.write(int(sys.argv[1]), f"{time.perf_counter() - started}\\n".encode())
"""


class AccelerateLauncher:
    """``accelerate.notebook_launcher`` in an interpreter of its own, driven one launch at a time.

    On a loaded machine (load average 12-15 on 2 cores) some of its launches never end: in this
    process, one of 160, a forked child sitting single-threaded in a futex while its peers waited on;
    in a worker of its own, 2 of 40 four-rank launches. Nothing in ``notebook_launcher`` bounds that
    wait, so here a launch that takes longer than ``HANG_S`` is counted as hung (``accelerate_hung``),
    its process group killed, and a fresh worker started. The worker times each launch itself, so the
    timings compare like for like.
    """

    HANG_S = 60.0

    def __init__(self, world_size: int) -> None:
        self.world_size, self.hung, self.proc = world_size, 0, None

    def start(self) -> None:
        read, write = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", ACCELERATE_WORKER, str(write)], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                                     pass_fds=(write,), start_new_session=True)
        os.close(write)
        self.results = os.fdopen(read)

    def __call__(self) -> float | None:
        if self.proc is None:
            self.start()
        self.proc.stdin.write(f"{self.world_size}\n")
        self.proc.stdin.flush()
        if select.select([self.results], [], [], self.HANG_S)[0]:
            return float(self.results.readline())
        self.hung += 1
        self.close()
        return None

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.results.close()
            self.proc = None


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def launchers(world_size: int) -> dict:
    """Each way: a callable that makes one launch and returns how long it took (None: it hung)."""
    found = {
        "ddpkit": lambda: timed(lambda: launch(ddpkit_barrier, world_size=world_size, start_method="fork",
                                               output="none")),
        "ddpkit_env_rendezvous": lambda: timed(lambda: ddpkit_env_rendezvous(world_size)),
        "raw_start_processes": lambda: timed(lambda: mp.start_processes(
            raw_barrier, args=(world_size, free_port()), nprocs=world_size, start_method="fork")),
    }
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return found
    found["accelerate_notebook_launcher"] = AccelerateLauncher(world_size)
    return found


FIRST_LAUNCH = """
import time
started = time.perf_counter()
import torch.distributed as dist
from ddpkit import launch
imported = time.perf_counter()
def barrier(ctx):
    dist.barrier()
if __name__ == "__main__":
    launch(barrier, world_size=2, output="none")
    first = time.perf_counter()
    launch(barrier, world_size=2, output="none")
    print(imported - started, first - imported, time.perf_counter() - first)
"""


def first_launch() -> dict:
    """In a fresh interpreter: importing ddpkit, the first launch (which imports what ranks need), the second."""
    out = subprocess.run([sys.executable, "-c", FIRST_LAUNCH], capture_output=True, text=True, check=True).stdout
    imports, first, second = (float(x) for x in out.split())
    return {"import_s": imports, "first_launch_s": first, "second_launch_s": second}


def tail_summary(samples: list[float]) -> dict:
    """p50, p90 (nearest rank) and max of repeated timings."""
    ordered = sorted(samples)
    return {**summarize(samples), "p50_s": statistics.median(ordered),
            "p90_s": ordered[math.ceil(0.9 * len(ordered)) - 1], "max_s": ordered[-1]}


def main(repeats: int = 40, teardown_launches: int = 200) -> dict:
    load_before = os.getloadavg()[0]
    results = {"first_launch_fresh_interpreter": first_launch()}
    for world_size in (2, 4):
        ways = launchers(world_size)
        for run in ways.values():  # warm-up: imports, first-touch of everything
            run()
        times = {name: [] for name in ways}
        names = list(ways)
        for i in range(repeats):
            for name in names[i % len(names):] + names[:i % len(names)]:  # rotate the order
                elapsed = ways[name]()
                if elapsed is not None:
                    times[name].append(elapsed)
        s = {name: tail_summary(values) for name, values in times.items()}
        ours, old = s["ddpkit"], s["ddpkit_env_rendezvous"]
        entry = {**s, "ratio_to_raw": ours["p50_s"] / s["raw_start_processes"]["p50_s"],
                 "target_ratio_to_raw": TARGET_OVER_FORK, "tail_p90_over_p50": ours["p90_s"] / ours["p50_s"],
                 "target_tail_p90_over_p50": TARGET_TAIL, "env_rendezvous_p90_over_p50": old["p90_s"] / old["p50_s"]}
        if "accelerate_notebook_launcher" in s:
            ways["accelerate_notebook_launcher"].close()
            entry["accelerate_hung"] = ways["accelerate_notebook_launcher"].hung
            entry["ratio_to_accelerate"] = ours["p50_s"] / s["accelerate_notebook_launcher"]["p50_s"]
            entry["target_ratio_to_accelerate"] = 1.0
        results[f"world_{world_size}"] = entry
    aborted = 0
    for _ in range(teardown_launches):
        try:
            launch(ddpkit_barrier, world_size=2, output="none")
        except LaunchError:
            aborted += 1
    results["teardown"] = {"launches": teardown_launches, "failed": aborted}
    results["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0], "cpus": os.cpu_count()}
    return write_results("launch_latency", results)


if __name__ == "__main__":
    main()
