"""``ddpkit train --launcher ray``: the same Trainer, run inside Ray Train's worker group.

Ray Train's ``TorchTrainer`` starts ``num_workers`` actors (one Python process each), makes them one
``torch.distributed`` process group (``TorchConfig``: gloo when no GPU is requested, ``env://``
rendezvous on rank 0's address, see ``ray/train/torch/config.py``) and sets the variables torchrun sets
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``). Each worker then runs our function:
it builds its :class:`~ddpkit.runtime.RankContext` from those variables, exactly as a torchrun worker
does, and calls :func:`ddpkit.train.run`. So the training itself is the kit's, bit for bit: the same
config gives the same ``param_sha256`` as the kit's own launcher (``tests/test_ray_launch.py``).

What Ray adds is the layer around the processes: a cluster (``ray start --head`` on one machine,
``ray start --address=HEAD:6379`` on the others, then ``RAY_ADDRESS=HEAD:6379 ddpkit train --launcher
ray``), placement of workers on the CPUs or GPUs it knows of, and results handed back to the driver.
That is the step next to ``torchrun --nnodes``: torchrun needs the same command started on every
machine; Ray places the workers itself.

Three Ray habits this module handles, each with its reason:

* **results**: the value a worker function returns is dropped. A worker hands a result back with
  ``ray.train.report(metrics, checkpoint=...)``, a barrier that every worker must call the same number
  of times; ``Result.metrics`` stays empty until one does. Rank 0 reports its summary inside a
  checkpoint folder (copied to ``RunConfig.storage_path``), the other ranks report without one;
* **placement**: Ray reserves one CPU per worker (``ScalingConfig``); a worker group it cannot place
  is waited for (the run does not start until the resources exist). So a world larger than the CPUs Ray
  sees is refused here, in one line, before Ray starts (or, on a cluster, before the workers are requested);
* **leftovers**: a local Ray starts a head of its own (GCS server, raylet, dashboard and runtime-env
  agents). It runs with usage statistics off (``RAY_USAGE_STATS_ENABLED=0``) and in a temporary folder
  of its own; ``ray.shutdown()``, then any process still naming that folder (stopped by its id), then the
  folder's removal are in ``finally``.

One cost this module cuts: Ray's raylet gives its dashboard agent, a Python process, a fixed 15 s to
write its ports and aborts the head when it misses them (``WaitForDashboardAgentPorts`` in
``src/ray/raylet/node_manager.cc``, Ray 2.60). No setting moves that limit: ``ray.init`` cannot set the
agent's ports, and even ``ray start --head`` with every agent port given still waits for the file of the
agent's HTTP port, which the raylet is not told. Where Jupyter is installed, most of the agent's start-up
is ``jsonschema`` building an IRI grammar it never uses: Ray's processes get
:mod:`ddpkit.engines.ray_pythonpath` first on ``PYTHONPATH``, which leaves it out (``import ray`` went from
about 2.8 s to 0.7 s of CPU here, in each of Ray's Python processes). That makes a head start on two cores
next to two busy loops; with more load than that on the same two cores, it can still miss the 15 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from ddpkit import metrics, runtime, train
from ddpkit.config import TrainConfig
from ddpkit.engines import require
from ddpkit.errors import UserError

SUMMARY_FILE = "summary.json"
TEMP_PREFIX = "ddpkit-ray-"  # every local Ray session's folder (and its processes' command lines) carry it
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}  # no usage report at start-up, no prompt, no network call
PYTHONPATH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_pythonpath")
START_ATTEMPTS = 2  # a local head that fails to start is started once more (see start_ray)
STRAGGLER_GRACE_S = 10.0  # after ray.shutdown(), how long this session's processes get to exit on their own


def session_env(environ: dict | None = None) -> dict:
    """The variables the launcher sets while its Ray runs (Ray's processes inherit them): usage statistics
    off, and :data:`PYTHONPATH_DIR` first on ``PYTHONPATH`` (see the module's docstring)."""
    environ = os.environ if environ is None else environ
    path = os.pathsep.join(p for p in (PYTHONPATH_DIR, environ.get("PYTHONPATH", "")) if p)
    return {**RAY_ENV, "PYTHONPATH": path}


def visible_cpus() -> int:
    """CPUs a local Ray would see on this machine (Ray's own count: cgroup limits included)."""
    try:
        from ray._private.utils import get_num_cpus  # the function ray.init() uses to size the node

        return int(get_num_cpus())
    except (ImportError, AttributeError):
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check(cfg: TrainConfig) -> None:
    """Everything the Ray launcher can refuse before Ray starts (``UserError`` or ``ValueError``, one line)."""
    require("ray")
    if cfg.backend == "nccl":
        raise ValueError("--launcher ray runs CPU workers over gloo: use --backend gloo (or auto)")
    if cfg.max_restarts:
        raise ValueError("--max-restarts is the kit's launcher's: with --launcher ray, leave it out "
                         "(Ray restarts failed workers with RunConfig(failure_config=FailureConfig(max_failures=N)))")
    if not os.environ.get("RAY_ADDRESS"):
        check_placement(cfg.world_size, visible_cpus())


def check_placement(world_size: int, cpus: float) -> None:
    """Ray gives each worker one CPU: more workers than CPUs would wait forever to be placed."""
    if world_size > cpus:
        raise ValueError(f"--world-size {world_size} needs {world_size} CPUs for Ray's workers (one each) and Ray "
                         f"sees {cpus:g}: use --world-size {int(cpus)} or fewer, or a Ray cluster (RAY_ADDRESS)")


def launch(cfg: TrainConfig) -> dict:
    """Train ``cfg`` on ``cfg.world_size`` Ray Train workers; returns rank 0's summary.

    Starts a local Ray (or joins the cluster ``RAY_ADDRESS`` names), runs the job, and always shuts Ray
    down and removes its temporary folder. Raises ``UserError``/``ValueError`` for bad input (before Ray
    starts where it can), ``RuntimeError`` when the training failed.
    """
    check(cfg)
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    env = session_env()
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    try:
        start_ray(ray, temp_dir)
        check_placement(cfg.world_size, ray.cluster_resources().get("CPU", 0))
        trainer = TorchTrainer(
            worker,
            train_loop_config={"cfg": cfg.replace(summary_json=None)},  # the driver writes the summary
            torch_config=TorchConfig(backend="gloo", timeout_s=max(1, int(cfg.timeout))),
            scaling_config=ScalingConfig(num_workers=cfg.world_size, use_gpu=False),
            run_config=RunConfig(name="ddpkit", storage_path=os.path.join(temp_dir, "results")),
        )
        try:
            result = trainer.fit()
        except Exception as exc:  # Ray wraps a worker's exception (TrainingFailedError): one line up front
            raise RuntimeError(f"training under Ray failed: {_first_line(exc)}") from exc
        summary = read_summary(result)
    finally:
        ray.shutdown()
        stop_stragglers(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
    if cfg.summary_json:
        metrics.write_summary(cfg.summary_json, summary)
    return summary


def start_ray(ray, temp_dir: str) -> None:
    """``ray.init``: a local head in ``temp_dir``, or the cluster ``RAY_ADDRESS`` names.

    A local head's raylet waits 15 s for its dashboard agent (a Python process) to write its ports, then
    aborts ("The current node timed out during startup"; the raylet's log says "Timed out waiting for
    file ... metrics_agent_port"). On two cores shared with other jobs the agent's start-up alone took
    longer (measured here at load 12-20). So a head that fails to start is stopped and started once more,
    then the failure is reported in one line."""
    local = not os.environ.get("RAY_ADDRESS")
    for attempt in range(START_ATTEMPTS if local else 1):
        try:
            ray.init(address=None if local else os.environ["RAY_ADDRESS"], include_dashboard=False,
                     logging_level="WARNING", _temp_dir=temp_dir if local else None)
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception here
            ray.shutdown()
            stop_stragglers(temp_dir)
            if attempt + 1 == (START_ATTEMPTS if local else 1):
                raise RuntimeError(f"Ray did not start ({_first_line(exc)}); on a busy machine its dashboard agent "
                                   "can miss the raylet's 15 s limit: retry when the machine is less loaded") from exc
            print("ddpkit: Ray's head did not start in time (a busy machine?); starting it once more",
                  file=sys.stderr, flush=True)


def worker(config: dict) -> None:
    """One Ray Train worker: the rank Ray made this process, training with the kit's Trainer."""
    import ray.train

    cfg: TrainConfig = config["cfg"]
    # Ray has already joined the process group (TorchConfig); this sets the rank's threads and device
    ctx = runtime.init_process_group(runtime.RankContext.from_env("gloo"), cfg.timeout)
    summary = train.run(ctx, cfg)
    with tempfile.TemporaryDirectory(prefix="ddpkit-ray-report-") as folder:
        checkpoint = None
        if ctx.is_main:
            with open(os.path.join(folder, SUMMARY_FILE), "w") as handle:
                json.dump(summary, handle)
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        # every worker reports once (a barrier); only rank 0's metrics and checkpoint reach the driver
        ray.train.report({"step": summary["steps"], "param_sha256": summary["param_sha256"]}, checkpoint=checkpoint)


def session_processes(temp_dir: str) -> list[int]:
    """Processes of the local Ray this launcher started: each names its session folder in its command line."""
    pids = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as handle:
                    if temp_dir.encode() in handle.read():
                        pids.append(int(name))
            except OSError:
                continue
    return pids


def stop_stragglers(temp_dir: str, grace_s: float = STRAGGLER_GRACE_S) -> None:
    """After ``ray.shutdown()``: give this session's processes ``grace_s`` to exit, then SIGKILL them by id.

    Seen on a loaded machine: a head that failed to start left its runtime-env agent running, which
    recreated the session folder after it was removed."""
    end = time.monotonic() + grace_s
    while (pids := session_processes(temp_dir)) and time.monotonic() < end:
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def read_summary(result: Any) -> dict:
    """Rank 0's summary, from the checkpoint it reported."""
    if result.checkpoint is None:
        raise RuntimeError("Ray Train finished without rank 0's report: no summary to read")
    with result.checkpoint.as_directory() as folder:
        with open(os.path.join(folder, SUMMARY_FILE)) as handle:
            return json.load(handle)


def _first_line(exc: BaseException) -> str:
    """The innermost cause's message, first line (Ray's wrappers repeat the whole traceback)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"


def main(cfg: TrainConfig) -> int:
    """The command line's entry: exit 0 when trained, 2 for bad input (one line), 1 for a failure."""
    try:
        launch(cfg)
    except (UserError, ValueError) as exc:
        print(f"ddpkit: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"ddpkit: {exc}", file=sys.stderr)
        return 1
    return 0
