"""Start real ranks from a notebook, a script or a test, and tell the truth when one fails.

``launch(fn, *args, world_size=N)`` starts N processes, makes each one a rank of a fresh
``torch.distributed`` process group, calls ``fn(ctx, *args)`` on every rank (``ctx`` is that rank's
:class:`~ddpkit.runtime.RankContext`) and returns the list of their return values, index = rank.
Under ``torchrun`` nothing is spawned: ``fn`` runs as the rank torchrun made us, and every rank gets
the same list (gathered with ``all_gather_object``).

What it does that ``torch.multiprocessing.start_processes`` leaves to you:

* **start method**: a function defined in a notebook cell lives in ``__main__`` and cannot be
  imported by a fresh ``spawn`` interpreter ("Can't get attribute ... on <module '__main__'>"), so
  ``auto`` forks on Linux/macOS. Forking is refused once the CUDA driver is live in this process
  (CUDA does not survive ``fork``); an importable function is spawned instead, and NCCL ranks are
  spawned whenever the function allows it;
* **a clean parent**: refuses a process that already belongs to a process group (forked ranks would
  inherit it) or whose environment already says it is a rank (``RANK``/``WORLD_SIZE``), with the fix;
* **isolation**: a fresh port per launch, already listening before any rank starts (so no rank waits
  out the store's connect back-off, see ``rank.py``); rank variables are set only inside the ranks; the
  one variable set around process start (``OMP_NUM_THREADS``) is restored; nothing is left running;
* **failures**: one :class:`~ddpkit.failures.LaunchError` naming the root-cause rank, its exception and
  traceback, with knock-on failures listed apart; all other ranks are stopped (see ``monitor.py``). A
  stall report adds what torch's Flight Recorder says: every rank keeps its ring of recent collectives
  (``TORCH_FR_BUFFER_SIZE``, set in the ranks unless the caller set it; 0 turns it off) and dumps it
  into the run folder when a collective fails under it or when it is named stalled; torch's analyzer
  then names the collective the stalled rank did not join (:func:`ddpkit.debug.flight.stall_summary`);
* **interrupts**: Ctrl-C, or Jupyter's stop button, stops every rank and raises one line,
  ``interrupted: 4 ranks stopped at step 70`` (a ``KeyboardInterrupt``, see ``Monitor.interrupted``),
  instead of each rank's relayed traceback and the monitor's own;
* **output**: each rank's stdout/stderr go to ``rank{N}.log`` (file descriptors 1 and 2, so C++
  messages too) and are relayed to the caller as ``[rank N] ...`` lines, or rank 0's only;
* **speed**: modules every training rank imports on first use (``torch._dynamo``, which the first
  optimizer step pulls in, and ``torch.distributed.checkpoint``) are imported once here before forking,
  so forked ranks inherit them; a rank ends with ``os._exit`` after a final barrier, skipping an
  interpreter teardown that would walk the whole heap it inherited from a notebook kernel.

Python 3.12 warns that "this process is multi-threaded, use of fork() may lead to deadlocks": a
child inherits only the forking thread, so a lock held by another thread stays locked forever in the
child. The launcher forks knowing this: the child flushes and replaces its standard streams, runs one
OpenMP thread, never touches a process group or CUDA state of the parent (both refused above), and so
never waits on a lock that only a parent thread could release. The warning is silenced for that one
call. DataLoader workers forked inside a rank are treated the same way (see ``train.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import shutil
import socket
import sys
import time
import warnings
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from ddpkit import progress as progress_view
from ddpkit import runtime
from ddpkit.config import check_timeout
from ddpkit.debug import flight
from ddpkit.failures import LaunchError, pick_root_cause
from ddpkit.files import write_atomic
from ddpkit.monitor import Monitor
from ddpkit.rank import FORK_WARNING, dumps_cpu, rank_main, store_takes_listening_socket
from ddpkit.run_folder import KEEP_FAILED_LOGS, LOG_PREFIX, make_run_dir, prune_failed_logs, read_result  # noqa: F401

OUTPUT_MODES = ("all", "rank0", "none")
MAX_LOCAL_RANKS = 64  # more processes than this on one machine is a typo, not a plan
STOP_GRACE_S = 1.0  # SIGTERM, then SIGKILL after this long


def launch(fn: Callable[..., Any], *args: Any, world_size: int | None = None, backend: str = "auto",
           start_method: str = "auto", timeout: float = runtime.DEFAULT_TIMEOUT_S,
           output: str = "all", log_dir: str | None = None, kwargs: dict | None = None,
           progress: str = "auto") -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` real ranks (2 by default); return results by rank.

    ``timeout`` bounds every collective (and the wait for stragglers once a rank has finished).
    ``output`` is ``all``, ``rank0`` or ``none``. ``log_dir`` keeps the per-rank logs there; by
    default they go to a temporary folder that is removed after a clean run and kept (and named in
    the error) after a failure; only the newest few failed ones are kept. ``progress`` shows a trainer's
    steps live while it runs: ``widget`` (a bar and a loss plot, in Jupyter), ``text``, ``off``, or
    ``auto`` (see :mod:`ddpkit.progress`).
    """
    kwargs = dict(kwargs or {})
    check_timeout(timeout)
    if runtime.under_torchrun():
        return _run_as_external_rank(fn, args, kwargs, world_size, backend, timeout)
    world_size = 2 if world_size is None else world_size
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= MAX_LOCAL_RANKS:
        raise ValueError(f"world_size must be a whole number from 1 to {MAX_LOCAL_RANKS}, got {world_size!r}")
    if output not in OUTPUT_MODES:
        raise ValueError(f"output must be one of {', '.join(OUTPUT_MODES)}, got {output!r}")
    if dist.is_available() and dist.is_initialized():
        raise ValueError("this process already belongs to a torch.distributed process group, which forked ranks "
                         "would inherit and hang on: call torch.distributed.destroy_process_group() first, "
                         "or restart the kernel")
    progress_mode = progress_view.resolve_mode(progress)
    resolved_backend = runtime.resolve_backend(backend, world_size)
    method = resolve_start_method(start_method, fn, resolved_backend)
    if method == "fork":
        _import_what_ranks_need()

    run_dir = make_run_dir(log_dir)
    listener = rendezvous_listener()
    port = listener.getsockname()[1] if listener is not None else free_port()
    recording = flight.keep_on(dict(os.environ))  # what each rank will decide (the ranks set the variable)
    spec = dict(world_size=world_size, backend=resolved_backend, port=port, timeout=timeout,
                run_dir=run_dir, forked=method == "fork", flight=recording,
                progress_file=os.path.join(run_dir, "progress.jsonl") if progress_mode != "off" else None)
    display = progress_view.Display(os.path.join(run_dir, "progress.jsonl"), progress_mode, world_size)
    monitor = Monitor(world_size, run_dir, output, timeout, display, flight.DUMP_SIGNAL if recording else None)
    procs: list[Any] = []
    context = mp.get_context(method)
    sys.stdout.flush()
    sys.stderr.flush()  # a forked child must not inherit (and print again) unflushed output
    started, interrupted = time.monotonic(), None  # interrupted: how many ranks had started
    try:
        with _patched_env({"OMP_NUM_THREADS": str(runtime.threads_per_rank(method == "fork"))}), \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=FORK_WARNING, category=DeprecationWarning)
            for rank in range(world_size):
                proc = context.Process(target=rank_main, name=f"ddpkit-rank{rank}",
                                       args=(fn, args, kwargs, rank, spec, listener))
                procs.append(proc)  # before start: an interrupt inside start() must not lose a child
                proc.start()
        if listener is not None:
            listener.close()  # every rank holds its own copy now; rank 0 serves on it
        failures = monitor.watch(procs)
    except KeyboardInterrupt:  # the cell was interrupted (Ctrl-C, Jupyter's stop button)
        interrupted = sum(proc.pid is not None for proc in procs)
    finally:
        if listener is not None:
            listener.close()
        _stop(procs)
        monitor.close(relay=interrupted is None)
    if interrupted is not None:  # one line instead of the monitor's frames and each rank's relayed traceback
        stopped = monitor.interrupted(interrupted, started)
        if log_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise stopped
    if failures:
        if log_dir is None:  # kept for the error report; the oldest failed ones go
            write_atomic(os.path.join(run_dir, "FAILED"), b"")
            prune_failed_logs()
        raise LaunchError.from_failures(failures, log_dir=run_dir,
                                        flight_summary=_flight_summary(run_dir, failures, world_size))
    results = [read_result(run_dir, rank) for rank in range(world_size)]
    if log_dir is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    return results


def resolve_start_method(requested: str, fn: Callable[..., Any], backend: str = "gloo") -> str:
    """Pick fork or spawn, or explain in one line why neither can work."""
    methods = mp.get_all_start_methods()
    if requested not in ("auto", *methods):
        raise ValueError(f"start_method must be auto or one of {', '.join(methods)}, got {requested!r}")
    cuda_live = runtime.cuda_touched()
    importable = is_importable(fn)
    name = getattr(fn, "__qualname__", repr(fn))
    if requested == "auto":
        if importable and (backend == "nccl" or cuda_live or "fork" not in methods):
            return "spawn"  # GPU ranks start clean; and nothing else is possible once CUDA is live here
        if "fork" in methods and not cuda_live:
            return "fork"
        raise ValueError(
            f"cannot start ranks for {name}: CUDA is already initialised here, so ranks cannot be "
            "forked, and the function is defined in __main__ (a notebook cell), so spawn cannot import "
            "it; move it into a .py module and import it, or restart the kernel and launch before using CUDA"
        )
    if requested == "fork" and cuda_live:
        raise ValueError(
            "cannot fork ranks after CUDA is initialised in this process (even torch.cuda.is_available() "
            "does it): use start_method='spawn' with an importable function, or restart the kernel and "
            "launch before using CUDA"
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


def rendezvous_listener() -> socket.socket | None:
    """A socket on 127.0.0.1 that listens before any rank starts, for rank 0's rendezvous store (see
    :func:`ddpkit.rank.rendezvous_store`: a client never finds the port closed, so never backs off);
    None when this torch's store cannot take a listening socket over."""
    if not store_takes_listening_socket():
        return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(MAX_LOCAL_RANKS)
    return sock


def _import_what_ranks_need() -> None:
    """Import once here what every training rank imports lazily (about 1 s each), so forks inherit it."""
    import torch._dynamo  # noqa: F401 - the first optimizer.step() / state_dict() imports it
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401


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


def _run_as_external_rank(fn, args, kwargs, world_size, backend, timeout) -> list[Any]:
    """Under torchrun: we already are a rank. Run fn here and share every rank's result."""
    env_world = int(os.environ["WORLD_SIZE"])
    in_kernel = "ipykernel" in sys.modules and "TORCHELASTIC_RUN_ID" not in os.environ
    if (world_size is not None and world_size != env_world) or in_kernel:
        raise ValueError(
            f"this process's environment already says it is rank {os.environ['RANK']} of {env_world} "
            f"(RANK/WORLD_SIZE are set, as torchrun sets them), so launch() would run here as that rank "
            f"instead of starting {world_size or 2} ranks: remove them first "
            "(for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'): os.environ.pop(k, None))"
        )
    created = not dist.is_initialized()
    ctx = runtime.init_process_group(runtime.RankContext.from_env(backend), timeout)
    try:
        result = pickle.loads(dumps_cpu(fn(ctx, *args, **kwargs)))
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        if created:
            runtime.destroy_process_group()


def _flight_summary(run_dir: str, failures: list[Any], world_size: int) -> str:
    """For a stall: what the ranks' Flight Recorder dumps say (see the module docstring); else "".
    Never raises: the report of the failure matters more than the summary of its evidence."""
    if pick_root_cause(failures).kind != "stalled" or not flight.has_dumps(run_dir):
        return ""
    try:
        return flight.stall_summary(run_dir, ranks=list(range(world_size)))
    except Exception as exc:  # noqa: BLE001
        return f"flight recorder: no analysis ({type(exc).__name__}: {exc})"


def _stop(procs: list[Any]) -> None:
    """Make sure no rank outlives the launch: SIGTERM, a grace period, then SIGKILL; reap all. A second
    interrupt during the grace period only makes it SIGKILL at once."""
    try:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        end = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            proc.join(max(0.0, end - time.monotonic()))
    finally:
        for proc in procs:
            if proc.pid is not None:  # started
                if proc.is_alive():
                    proc.kill()
                proc.join()
            proc.close()
