"""How long a notebook cell waits for N ranks to reach a barrier and come back, three ways, interleaved.

* ``ddpkit.launch`` (fork; root-cause reports, output relay, stall watchdog, CPU copies of results);
* raw ``torch.multiprocessing.start_processes`` with fork, doing only the process-group set-up;
* ``accelerate.notebook_launcher`` (optional: measured when accelerate is installed), whose function
  builds a ``PartialState`` (which joins the process group) and waits for everyone.

Each launch runs the same work: join a gloo process group, one barrier, leave. Target: ddpkit <=
accelerate. Also: the first launch in a fresh interpreter (which pays the imports forked ranks then
inherit), and a teardown check: N launches in a row, none may end in an abort.
"""

import contextlib
import datetime
import io
import os
import subprocess
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summarize, write_results  # noqa: E402

from ddpkit.launch import free_port, launch  # noqa: E402
from ddpkit.failures import LaunchError  # noqa: E402


def ddpkit_barrier(ctx):
    dist.barrier()


def raw_barrier(rank, world_size, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=30))
    dist.barrier()


def accelerate_barrier():
    from accelerate import PartialState

    PartialState().wait_for_everyone()


def launchers(world_size: int) -> dict:
    found = {
        "ddpkit": lambda: launch(ddpkit_barrier, world_size=world_size, start_method="fork", output="none"),
        "raw_start_processes": lambda: mp.start_processes(raw_barrier, args=(world_size, free_port()),
                                                          nprocs=world_size, start_method="fork"),
    }
    try:
        from accelerate import notebook_launcher
    except ImportError:
        return found

    def accelerate_launch():
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per launch
            notebook_launcher(accelerate_barrier, num_processes=world_size, use_port=str(free_port()))
    found["accelerate_notebook_launcher"] = accelerate_launch
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


def main(repeats: int = 15, teardown_launches: int = 200) -> dict:
    results = {"first_launch_fresh_interpreter": first_launch()}
    for world_size in (2, 4):
        ways = launchers(world_size)
        for run in ways.values():  # warm-up: imports, first-touch of everything
            run()
        times = {name: [] for name in ways}
        names = list(ways)
        for i in range(repeats):
            for name in names[i % len(names):] + names[:i % len(names)]:  # rotate the order
                started = time.perf_counter()
                ways[name]()
                times[name].append(time.perf_counter() - started)
        s = {name: summarize(values) for name, values in times.items()}
        entry = {**s, "ratio_to_raw": s["ddpkit"]["median_s"] / s["raw_start_processes"]["median_s"]}
        if "accelerate_notebook_launcher" in s:
            entry["ratio_to_accelerate"] = s["ddpkit"]["median_s"] / s["accelerate_notebook_launcher"]["median_s"]
            entry["target_ratio_to_accelerate"] = 1.0
        results[f"world_{world_size}"] = entry
    aborted = 0
    for _ in range(teardown_launches):
        try:
            launch(ddpkit_barrier, world_size=2, output="none")
        except LaunchError:
            aborted += 1
    results["teardown"] = {"launches": teardown_launches, "failed": aborted}
    return write_results("launch_latency", results)


if __name__ == "__main__":
    main()
