"""Inside one rank started by the launcher: from process start to ``os._exit``.

A rank process redirects its output to its log file, arranges to die with its parent, becomes rank
``r`` of a fresh process group, runs the user's function and leaves one of two files behind for the
parent: ``rank{r}.result`` (the return value, pickled with every tensor as a CPU copy) or
``rank{r}.error.json`` (the exception, its traceback, and whether it was raised inside a collective or
is a user error). A rank keeps torch's Flight Recorder on (:func:`ddpkit.debug.flight.keep_on`) and dumps
its ring of recent collectives to ``fr_rank_{r}`` when a collective fails under it or when the launcher,
having named it stalled, asks for it (``SIGUSR2``): the launcher's stall report summarizes those dumps. Then it exits with
``os._exit``, after a barrier so that nobody leaves while a peer may still be talking to it: no
interpreter teardown (which, in a process forked from a notebook kernel, would walk the kernel's whole
heap), no C++ destructors of a live process group (which can abort), no ``atexit`` hooks inherited
from the parent.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import io
import json
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ddpkit import progress, runtime
from ddpkit.debug import flight
from ddpkit.errors import UserError
from ddpkit.failures import knock_on_line, raised_in_collective
from ddpkit.files import write_atomic

FORK_WARNING = r".*multi-threaded, use of fork\(\) may lead to deadlocks"


def rank_main(fn, args, kwargs, rank: int, spec: dict, listener: Any = None) -> None:
    """Entry point of one rank process. It always ends in ``os._exit``: no teardown, no atexit hooks.

    ``listener`` is the rendezvous socket the launcher already listens on (see :func:`rendezvous_store`),
    or None: then rank 0 opens ``spec["port"]`` itself (env://)."""
    run_dir = spec["run_dir"]
    runtime.die_with_parent()
    _redirect_output(os.path.join(run_dir, f"rank{rank}.log"))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a forked rank inherits the kernel's
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a crash dumps its stack into this rank's log
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # and so does SIGUSR1, on demand
    warnings.filterwarnings("ignore", message=FORK_WARNING, category=DeprecationWarning)  # DataLoader workers
    world_size = spec["world_size"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(spec["port"]), DDPKIT_LAUNCHED="1")
    os.environ.pop(progress.ENV_FILE, None)
    if rank == 0 and spec.get("progress_file"):
        os.environ[progress.ENV_FILE] = spec["progress_file"]  # the trainer reports its steps there
    recording = spec.get("flight", False) and flight.keep_on()  # before the first process group
    if recording:
        flight.dump_on_signal(run_dir, rank)  # the launcher's request when it names this rank stalled
    try:
        ctx = runtime.RankContext(rank, rank, world_size, world_size, spec["backend"],
                                  runtime.device_for(spec["backend"], rank))
        store = None if listener is None else rendezvous_store(rank, world_size, spec["port"], listener, spec["timeout"])
        ctx = runtime.init_process_group(ctx, spec["timeout"], forked=spec["forked"], store=store)
        payload = dumps_cpu(fn(ctx, *args, **kwargs))
        if dist.is_initialized():
            dist.barrier()  # nobody exits while a peer may still be talking to it
        write_atomic(os.path.join(run_dir, f"rank{rank}.result"), payload)
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are failures too
        record = {"type": type(exc).__name__, "message": str(exc), "time": time.time(),
                  "traceback": traceback.format_exc(), "in_collective": raised_in_collective(exc),
                  "user_error": isinstance(exc, UserError)}
        write_atomic(os.path.join(run_dir, f"rank{rank}.error.json"), json.dumps(record).encode())
        if record["in_collective"] and recording:  # its ring: which collective it waited in, for the stall report
            with contextlib.suppress(Exception):
                flight.dump(run_dir, rank)
        if record["in_collective"]:  # a peer went away: one line; the traceback is in the error record
            sys.stderr.write(f"{knock_on_line(exc)} (traceback: rank{rank}.error.json)\n")
        else:
            sys.stderr.write(record["traceback"])
        _flush_and_exit(1)
    _flush_and_exit(0)


def store_takes_listening_socket() -> bool:
    """True when this torch's ``TCPStore`` can serve on a socket someone else already listens on
    (``master_listen_fd``); see :func:`rendezvous_store`."""
    return "master_listen_fd" in (dist.TCPStore.__init__.__doc__ or "")


def rendezvous_store(rank: int, world_size: int, port: int, listener: Any, timeout_s: float) -> dist.Store:
    """The job's rendezvous store on 127.0.0.1:``port``, served by rank 0 on ``listener``, a socket the
    launcher bound and put in the listening state before it started any rank.

    Why not let rank 0 open the port itself (env://)? A client rank whose connection is refused because
    rank 0 is not listening yet sleeps before it tries again: c10d's ``TCPStore`` client retries with
    exponential back-off and jitter, first delay 500 ms +- 50% (``ExponentialBackoffWithJitter`` in
    ``torch/csrc/distributed/c10d/Backoff.hpp``, used by ``TCPStore``'s connect in ``TCPStore.cpp``
    and ``socket.cpp``). Ranks start in whatever order the scheduler runs them, so on two busy cores
    a launch that takes 50 ms sometimes took 0.3-0.8 s. On a socket that already listens, the kernel
    accepts a client's connection into the backlog whatever the order, and the client's first
    request simply waits until rank 0's server reads it: no refusal, no back-off. Keeping the socket
    from the moment the port is chosen also means no other process can take the port in between. And
    the store's server thread, which names each client it accepts (``getnameinfo``), now sees plain
    IPv4 peers that ``/etc/hosts`` names, where on the dual-stack socket torch opens itself it saw
    IPv4-mapped IPv6 ones and asked the DNS resolver (strace: 2 lookups per 2-rank launch instead of
    4); a resolver that drops a query stalls that thread, and every rank with it, for its 5 s timeout.

    ``wait_for_workers=False``: the server need not poll (every 10 ms) until every client has
    connected; the process group's own rendezvous waits for every rank, and rank 0 lives until the
    launcher's final barrier. The libuv server listens on ``master_listen_fd`` only since torch 2.8
    (pytorch/pytorch#150215 added the missing ``uv_listen``), so older torch serves it with the classic
    backend.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        listener.close()  # only rank 0 serves; a peer's copy must not keep the port open after rank 0 dies
        return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout,
                             wait_for_workers=False)
    libuv = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach(), use_libuv=libuv)


def _flush_and_exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the teardown: C++ destructors of live process groups, inherited atexit hooks


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


class _CPUPickler(pickle.Pickler):
    """Pickles tensors as detached CPU copies wherever they sit: in a defaultdict, a namedtuple, a
    dataclass or any object. A CUDA tensor unpickled in the parent would initialise CUDA there (and
    every later fork would be refused); a tensor that requires grad cannot be pickled at all; and a view
    is pickled with its whole storage (four numbers sliced from a thousand carry the thousand), so it
    becomes a compact copy of its own elements."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and (obj.device.type != "cpu" or obj.requires_grad):
            return _same, (obj.detach().to("cpu", copy=True),)
        if type(obj) is torch.Tensor and obj.layout == torch.strided and \
                obj.untyped_storage().nbytes() != obj.numel() * obj.element_size():
            return _same, (obj.detach().clone(memory_format=torch.contiguous_format),)
        return NotImplemented


def _same(value: Any) -> Any:
    return value


def dumps_cpu(value: Any) -> bytes:
    """Pickle a rank's result with every tensor as a CPU copy (see :class:`_CPUPickler`)."""
    buffer = io.BytesIO()
    _CPUPickler(buffer).dump(value)
    return buffer.getvalue()
