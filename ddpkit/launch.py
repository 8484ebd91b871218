"""Start real ranks from a notebook, a script or a test, and tell the truth when one fails.

``launch(fn, *args, world_size=N)`` starts N processes, makes each one a rank of a fresh
``torch.distributed`` process group, calls ``fn(ctx, *args)`` on every rank (``ctx`` is that rank's
:class:`~ddpkit.runtime.RankContext`) and returns the list of their return values, index = rank.
Under ``torchrun`` nothing is spawned: ``fn`` runs as the rank torchrun made us, and every rank gets
the same list (gathered with ``all_gather_object``).

What it does that ``torch.multiprocessing.start_processes`` leaves to you:

* **start method**: a function defined in a notebook cell lives in ``__main__`` and cannot be
  imported by a fresh ``spawn`` interpreter ("Can't get attribute ... on <module '__main__'>"), so
  ``auto`` forks on Linux/macOS, and refuses to fork once CUDA is initialised in this process (CUDA
  state does not survive ``fork``) unless the function is importable, in which case it spawns;
* **isolation**: a fresh free port per launch; rank variables are set only inside the ranks; the
  one variable set around process start (``OMP_NUM_THREADS``, so ranks x threads <= cores) is
  restored; no signal handler of the caller is touched; nothing is left running;
* **threads**: spawned ranks get cores // ranks threads each; forked ranks get 1, because GNU
  OpenMP's thread pool does not survive ``fork`` (a child that opens a parallel region after the
  parent used one hangs in a futex, seen here with torch 2.13);
* **failures**: one :class:`~ddpkit.failures.LaunchError` naming the root-cause rank, its exception and
  traceback, with knock-on failures listed apart; all other ranks are stopped;
* **no endless waits**: a short collective timeout, and a watchdog that names the rank everyone else
  is waiting for (with its Python stack) instead of hanging;
* **output**: each rank's stdout/stderr go to ``rank{N}.log`` (file descriptors 1 and 2, so C++
  messages too) and are relayed to the caller as ``[rank N] ...`` lines, or rank 0 only.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import io
import json
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpkit import runtime
from ddpkit.failures import LaunchError, RankFailure, exit_failure

OUTPUT_MODES = ("all", "rank0", "none")
POLL_S = 0.005  # parent poll period: adds at most this much latency to a launch
KNOCK_ON_WINDOW_S = 1.0  # after the first failure, how long survivors get to report theirs
STOP_GRACE_S = 1.0  # SIGTERM, then SIGKILL after this long


def launch(fn: Callable[..., Any], *args: Any, world_size: int = 2, backend: str = "auto",
           start_method: str = "auto", timeout: float = runtime.DEFAULT_TIMEOUT_S,
           output: str = "all", log_dir: str | None = None, kwargs: dict | None = None,
           deadline: float | None = None) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` real ranks; return their results by rank.

    ``timeout`` bounds every collective (and the wait for stragglers once a rank has finished);
    ``deadline``, if given, bounds the whole launch. ``output`` is ``all``, ``rank0`` or ``none``.
    ``log_dir`` keeps the per-rank logs there; by default they go to a temporary folder that is
    removed after a clean run and kept (and named in the error) after a failure.
    """
    kwargs = dict(kwargs or {})
    if runtime.under_torchrun():
        return _run_as_external_rank(fn, args, kwargs, backend, timeout)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if output not in OUTPUT_MODES:
        raise ValueError(f"output must be one of {', '.join(OUTPUT_MODES)}, got {output!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    resolved_backend = runtime.resolve_backend(backend, world_size)
    method = resolve_start_method(start_method, fn)

    own_dir = log_dir is None
    run_dir = tempfile.mkdtemp(prefix="ddpkit-launch-") if own_dir else os.path.abspath(log_dir)
    os.makedirs(run_dir, exist_ok=True)
    for stale in os.listdir(run_dir):  # a reused log_dir must not hand back an old result
        if stale.endswith((".result", ".error.json", ".log")):
            os.remove(os.path.join(run_dir, stale))
    spec = dict(world_size=world_size, backend=resolved_backend, port=free_port(),
                timeout=timeout, run_dir=run_dir)
    monitor = _Monitor(world_size, run_dir, output, timeout, deadline)
    procs: list[Any] = []
    context = mp.get_context(method)
    sys.stdout.flush()
    sys.stderr.flush()  # a forked child must not inherit (and print again) unflushed output
    try:
        # GNU OpenMP's thread pool does not survive fork: a forked child that opens a parallel
        # region after the parent used one deadlocks (PyTorch's DataLoader workers also run 1 thread).
        threads = 1 if method == "fork" else runtime.threads_per_rank(world_size)
        with _patched_env({"OMP_NUM_THREADS": str(threads)}):
            for rank in range(world_size):
                proc = context.Process(target=_rank_main, name=f"ddpkit-rank{rank}",
                                       args=(fn, args, kwargs, rank, spec))
                proc.start()
                procs.append(proc)
        failures = monitor.watch(procs)
    finally:
        _stop(procs)
        monitor.close()
    if failures:
        raise LaunchError.from_failures(failures, log_dir=run_dir)
    results = [_read_result(run_dir, rank) for rank in range(world_size)]
    if own_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    return results


def resolve_start_method(requested: str, fn: Callable[..., Any]) -> str:
    """Pick fork or spawn, or explain in one line why neither can work."""
    methods = mp.get_all_start_methods()
    if requested not in ("auto", *methods):
        raise ValueError(f"start_method must be auto or one of {', '.join(methods)}, got {requested!r}")
    cuda_ready = torch.cuda.is_initialized()
    importable = is_importable(fn)
    name = getattr(fn, "__qualname__", repr(fn))
    if requested == "auto":
        if "fork" in methods and not cuda_ready:
            return "fork"
        if importable:
            return "spawn"
        raise ValueError(
            f"cannot start ranks for {name}: CUDA is already initialised here, so ranks cannot be "
            "forked, and the function is defined in __main__ (a notebook cell), so spawn cannot import "
            "it; move it into a .py module and import it, or restart the kernel and launch before using CUDA"
        )
    if requested == "fork" and cuda_ready:
        raise ValueError(
            "cannot fork ranks after CUDA is initialised in this process: use start_method='spawn' "
            "with an importable function, or restart the kernel and launch before using CUDA"
        )
    if requested != "fork" and not importable:
        raise ValueError(
            f"{name} is defined in __main__ (or locally), so a {requested}ed rank cannot import it: "
            "use start_method='fork' (or 'auto'), or move the function into a .py module"
        )
    return requested


def is_importable(fn: Callable[..., Any]) -> bool:
    """True when a fresh interpreter could find ``fn`` by its module and qualified name."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return False
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return False
    return obj is fn


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _patched_env(values: dict[str, str]):
    """Set environment variables for a block and put back exactly what was there before."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _run_as_external_rank(fn, args, kwargs, backend, timeout) -> list[Any]:
    """Under torchrun: we already are a rank. Run fn here and share every rank's result."""
    ctx = runtime.RankContext.from_env(backend)
    runtime.init_process_group(ctx, timeout)
    try:
        result = _to_cpu(fn(ctx, *args, **kwargs))
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        runtime.destroy_process_group()


# ----------------------------------------------------------------------------- inside a rank

def _rank_main(fn, args, kwargs, rank: int, spec: dict) -> None:
    """Entry point of one rank process."""
    run_dir = spec["run_dir"]
    _die_with_parent()
    _redirect_output(os.path.join(run_dir, f"rank{rank}.log"))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a forked rank inherits the kernel's
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # stack dump on demand
    world_size = spec["world_size"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(spec["port"]), DDPKIT_LAUNCHED="1")
    try:
        ctx = runtime.RankContext(rank, rank, world_size, world_size, spec["backend"],
                                  runtime.device_for(spec["backend"], rank))
        runtime.init_process_group(ctx, spec["timeout"])
        result = _to_cpu(fn(ctx, *args, **kwargs))
        _write_atomic(os.path.join(run_dir, f"rank{rank}.result"), pickle.dumps(result))
        runtime.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are failures too
        record = {"type": type(exc).__name__, "message": str(exc), "time": time.time(),
                  "traceback": traceback.format_exc()}
        _write_atomic(os.path.join(run_dir, f"rank{rank}.error.json"), json.dumps(record).encode())
        sys.stderr.write(record["traceback"])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit hooks inherited from the parent (a notebook kernel's, say)
    sys.stdout.flush()
    sys.stderr.flush()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if the launching process dies (no orphans after a kernel crash)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _redirect_output(path: str) -> None:
    """Send file descriptors 1 and 2 (Python's and C++'s output) to the rank's log file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0, closefd=False),
                                  line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0, closefd=False),
                                  line_buffering=True, write_through=True)


def _to_cpu(value: Any) -> Any:
    """Detached CPU copies of every tensor in a nested result: nothing shared with a dying process."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, _to_cpu(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _read_result(run_dir: str, rank: int) -> Any:
    # Written by our own child process a moment ago: trusted IPC, not a checkpoint from disk.
    with open(os.path.join(run_dir, f"rank{rank}.result"), "rb") as handle:
        return pickle.load(handle)


# ----------------------------------------------------------------------------- the parent side

class _Monitor:
    """Polls the ranks: relays their output, records how each ended, and runs the watchdog."""

    def __init__(self, world_size: int, run_dir: str, output: str, timeout: float,
                 deadline: float | None) -> None:
        self.world_size, self.run_dir, self.output = world_size, run_dir, output
        self.timeout, self.deadline = timeout, deadline
        self.logs: dict[int, Any] = {}
        self.partial: dict[int, bytes] = {}

    def watch(self, procs: list[Any]) -> list[RankFailure]:
        start = time.monotonic()
        finished: dict[int, float] = {}  # rank -> when it returned cleanly
        failures: dict[int, RankFailure] = {}
        first_failure_at = None
        while True:
            self.relay()
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank in finished or rank in failures or proc.exitcode is None:
                    continue
                failure = self._ended(rank, proc.exitcode)
                if failure is None:
                    finished[rank] = now
                else:
                    failures[rank] = failure
                    first_failure_at = first_failure_at or now
            alive = [r for r in range(len(procs)) if r not in finished and r not in failures]
            if not alive:
                break
            verdict = None  # (kind, why) once we stop waiting for the ranks still alive
            if first_failure_at is not None and now - first_failure_at > KNOCK_ON_WINDOW_S:
                if all(f.is_knock_on for f in failures.values()):
                    verdict = ("stalled", "the other ranks timed out or lost their peers waiting for it")
                else:
                    verdict = ("stopped", "stopped by the launcher after another rank failed")
            elif finished and now - min(finished.values()) > self.timeout + KNOCK_ON_WINDOW_S:
                verdict = ("stalled", f"still running {self.timeout:g}s after rank "
                                      f"{min(finished, key=finished.get)} finished")
            elif self.deadline is not None and now - start > self.deadline:
                verdict = ("stalled", f"still running at the launch deadline ({self.deadline:g}s)")
            if verdict:
                for rank in alive:
                    failures[rank] = self._give_up_on(rank, procs[rank], *verdict)
                break
            time.sleep(POLL_S)
        self.relay()
        return list(failures.values())

    def _ended(self, rank: int, exitcode: int) -> RankFailure | None:
        """None if the rank returned cleanly, else what went wrong."""
        error_path = os.path.join(self.run_dir, f"rank{rank}.error.json")
        if os.path.exists(error_path):
            with open(error_path) as handle:
                rec = json.load(handle)
            return RankFailure(rank, "raised", rec["type"], rec["message"], rec["traceback"], rec["time"])
        if exitcode == 0 and os.path.exists(os.path.join(self.run_dir, f"rank{rank}.result")):
            return None
        return exit_failure(rank, exitcode, time.time())

    def _give_up_on(self, rank: int, proc: Any, kind: str, why: str) -> RankFailure:
        """Stop a rank that is still running; for a stalled one, capture where it is stuck."""
        stack = ""
        if kind == "stalled" and proc.pid is not None:
            mark = self._log_size(rank)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)  # faulthandler writes its stack to the log
            time.sleep(0.3)
            stack = self._log_tail(rank, mark)
        return RankFailure(rank, kind, kind, why, stack, time.time())

    def _log_size(self, rank: int) -> int:
        with contextlib.suppress(OSError):
            return os.path.getsize(os.path.join(self.run_dir, f"rank{rank}.log"))
        return 0

    def _log_tail(self, rank: int, offset: int) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.run_dir, f"rank{rank}.log"), "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
        return ""

    def relay(self) -> None:
        """Copy complete new lines of each rank's log to our stdout as ``[rank N] line``."""
        for rank in range(self.world_size):
            handle = self.logs.get(rank)
            if handle is None:
                path = os.path.join(self.run_dir, f"rank{rank}.log")
                if not os.path.exists(path):
                    continue
                handle = self.logs[rank] = open(path, "rb")  # noqa: SIM115 - closed in close()
            chunk = handle.read()
            if not chunk:
                continue
            data = self.partial.get(rank, b"") + chunk
            *lines, self.partial[rank] = data.split(b"\n")
            if self.output == "all" or (self.output == "rank0" and rank == 0):
                for line in lines:
                    sys.stdout.write(f"[rank {rank}] {line.decode(errors='replace')}\n")
                sys.stdout.flush()

    def close(self) -> None:
        self.relay()
        for rank, rest in self.partial.items():
            if rest and (self.output == "all" or (self.output == "rank0" and rank == 0)):
                sys.stdout.write(f"[rank {rank}] {rest.decode(errors='replace')}\n")
        for handle in self.logs.values():
            handle.close()
        self.logs.clear()


def _stop(procs: list[Any]) -> None:
    """Make sure no rank outlives the launch: SIGTERM, a grace period, then SIGKILL; reap all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()
