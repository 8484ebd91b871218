"""torch's Flight Recorder on gloo ranks: record every rank's recent collectives, dump them, find the culprit.

A hung job tells you little: every rank sits in some collective and, after the timeout, reports that a
peer went away. The Flight Recorder keeps, on every rank, a ring buffer of its most recent collectives
(which group, which sequence number, the op, the tensor sizes and dtypes, the Python stack that issued
it). ``TORCH_FR_BUFFER_SIZE`` (``TORCH_NCCL_TRACE_BUFFER_SIZE`` is its older name) sets how many
entries it keeps, and must be in the rank's environment before its first collective; 0 turns it off.
torch 2.13 keeps the last 2000 when neither is set. Each rank dumps its ring (``torch._C._distributed_c10d._dump_fr_trace()`` returns it as pickled bytes), and torch's analyzer
(``torch.distributed.flight_recorder``, installed as the ``torchfrtrace`` command) lines the rings up
by sequence number and reports the first collective that the ranks do not all agree on: a different
op, size or dtype on some rank, or a rank that never issued it. See PyTorch's tutorial "Flight
Recorder for Debugging Stuck Jobs" (https://docs.pytorch.org/tutorials/unstable/flight_recorder_tutorial.html).

This module is the recording side: the ring's size, a rank's dump, the signal handlers that leave a
stalled rank's ring behind. Reading the dumps (plain data only, and gloo's process-group table fixed
for the analyzer) is :mod:`ddpkit.debug.flight_read`; the analysis and the stall report's lines are
:mod:`ddpkit.debug.flight_report`. Their functions are importable from here too.

The launcher uses this module for its stall reports: its ranks keep the recorder on (:func:`keep_on`),
dump their rings into the run folder when a collective fails under them or when the launcher names them
stalled (:func:`dump_on_signal`), and the report ends with :func:`stall_summary`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal

import torch

from ddpkit.debug.flight_read import DUMP_PREFIX, gloo_pg_config, has_dumps, read_dumps, write_fixed  # noqa: F401
from ddpkit.debug.flight_report import CommandRun, Finding, analyze, stall_summary, torchfrtrace  # noqa: F401
from ddpkit.files import write_atomic

ENV = "TORCH_FR_BUFFER_SIZE"
OLD_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"  # read too, after ENV (torch's FlightRecorder.hpp)
DEFAULT_ENTRIES = 2000
DUMP_SIGNAL = signal.SIGUSR2
"""What the launcher sends a stalled rank to make it dump its ring (see :func:`dump_on_signal`). Not SIGTERM:
a trainer's rank takes SIGTERM as a preemption notice (``ddpkit.preemption``)."""


def available() -> bool:
    """True when this torch can dump a gloo rank's Flight Recorder and ships the analyzer."""
    return (hasattr(torch._C._distributed_c10d, "_dump_fr_trace")
            and importlib.util.find_spec("torch.distributed.flight_recorder") is not None)


def require() -> None:
    if not available():
        raise RuntimeError(f"torch {torch.__version__} cannot dump or analyze the Flight Recorder of gloo ranks "
                           "(torch._C._distributed_c10d._dump_fr_trace or torch.distributed.flight_recorder is "
                           "missing): use a newer torch for this lesson")


@contextlib.contextmanager
def recording(entries: int = DEFAULT_ENTRIES):
    """Set ``TORCH_FR_BUFFER_SIZE`` around a launch (the ranks it starts inherit it); restore it afterwards.

    ``entries=0`` turns the recorder off. The recorder is one per process, sized when it is first used: a
    rank forked from a process that has already used its own (a collective of its own, or a dump) keeps
    that one, whatever this says. A notebook kernel that only launches ranks never has."""
    require()
    old = os.environ.get(ENV)
    os.environ[ENV] = str(int(entries))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def dump(folder: str, rank: int) -> str:
    """Write this rank's ring to ``folder/fr_rank_<rank>`` (atomically) and return the path."""
    require()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{DUMP_PREFIX}{rank}")
    write_atomic(path, torch._C._distributed_c10d._dump_fr_trace())
    return path


def dump_on_sigterm(folder: str, rank: int) -> None:
    """Dump this rank's ring when SIGTERM arrives, then exit (143, as SIGTERM's default would).

    A rank stuck outside a collective cannot dump by itself; the launcher stops a stalled rank with
    SIGTERM, so this handler leaves its ring behind. The handler runs between two Python bytecodes: a
    rank blocked inside a C++ call runs it only when the call returns.
    """
    def handler(signum, frame):  # noqa: ARG001
        dump(folder, rank)
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)


def keep_on(environ: dict | None = None) -> bool:
    """In a rank about to join its process group: keep the recorder on, and say whether it records.

    When neither ``TORCH_FR_BUFFER_SIZE`` nor its older name is set, set the former to torch 2.13's own
    default (2000 entries), so the ring is on whatever the torch version's default is; a value the user
    set (0 turns the recorder off) is kept. torch reads it once per process, when the recorder is first
    used (the ``FlightRecorder`` singleton's constructor), so it must be set before the rank's first
    process group; a rank forked from a process that had already used one inherits that process's
    recorder as it was.
    """
    environ = os.environ if environ is None else environ
    if ENV not in environ and OLD_ENV not in environ:
        environ[ENV] = str(DEFAULT_ENTRIES)
    value = environ.get(ENV, environ.get(OLD_ENV, "0")).strip()
    return available() and value.isdigit() and int(value) > 0


def dump_on_signal(folder: str, rank: int, signum: int = DUMP_SIGNAL) -> None:
    """Dump this rank's ring to ``folder`` whenever ``signum`` arrives, and carry on.

    The launcher sends it to a rank it names stalled, before stopping it: a rank outside any collective
    (evaluating, stuck in a loop, in a sleep) never times out, so it never dumps by itself. Python runs
    the handler between two bytecodes: a rank blocked inside one C++ call dumps only when the call returns.
    """
    def handler(signum, frame):  # noqa: ARG001
        with contextlib.suppress(Exception):  # a failed dump must not turn into this rank's error
            dump(folder, rank)

    signal.signal(signum, handler)
