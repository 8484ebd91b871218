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

Two details of gloo dumps (torch 2.13) that the analyzer does not expect, handled by :func:`gloo_pg_config`:
the process-group table (``pg_config``) of a gloo rank's dump holds a single entry keyed ``''``, while
every recorded collective names its group (``'0'`` for the default group). The analyzer looks groups
up by that name (its ``build_groups_memberships`` describes a table that the NCCL backend fills in as
it creates communicators), so it fails with a ``KeyError`` on gloo dumps as they are.
And the analyzer reads dumps with ``pickle.load``; here they are read by an unpickler that accepts
plain data only.

The launcher uses this module for its stall reports: its ranks keep the recorder on (:func:`keep_on`),
dump their rings into the run folder when a collective fails under them or when the launcher names them
stalled (:func:`dump_on_signal`), and the report ends with :func:`stall_summary`.

With two ranks, "the culprit" is a coin toss: the analyzer compares every rank with the first one and
blames the rank that differs, so with ranks 0 and 1 it blames rank 1 whichever of them is wrong. With
three or more, the odd one out is the rank that differs from the others.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import pickle
import signal
from argparse import Namespace
from dataclasses import dataclass, field

import torch

from ddpkit.files import write_atomic

ENV = "TORCH_FR_BUFFER_SIZE"
OLD_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"  # read too, after ENV (torch's FlightRecorder.hpp)
DUMP_PREFIX = "fr_rank_"
DEFAULT_ENTRIES = 2000
DUMP_SIGNAL = signal.SIGUSR2
"""What the launcher sends a stalled rank to make it dump its ring (see :func:`dump_on_signal`). Not SIGTERM:
a trainer's rank takes SIGTERM as a preemption notice (``ddpkit.preemption``)."""
_LOGGER = "Flight Recorder"  # the analyzer reports through this logger


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

    ``entries=0`` turns the recorder off."""
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


def has_dumps(folder: str) -> bool:
    """True when ``folder`` holds at least one rank's dump."""
    with contextlib.suppress(OSError):
        return any(n.startswith(DUMP_PREFIX) and n[len(DUMP_PREFIX):].isdigit() for n in os.listdir(folder))
    return False


class _PlainData(pickle.Unpickler):
    """A dump holds dicts, lists, strings and numbers only: refuse anything that would run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a Flight Recorder dump should hold plain data, not {module}.{name}")


def read_dumps(folder: str) -> dict[int, dict]:
    """Every rank's dump in ``folder``, by rank."""
    dumps = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith(DUMP_PREFIX) and name[len(DUMP_PREFIX):].isdigit():
            with open(os.path.join(folder, name), "rb") as handle:
                dumps[int(name[len(DUMP_PREFIX):])] = _PlainData(io.BytesIO(handle.read())).load()
    if not dumps:
        raise FileNotFoundError(f"no {DUMP_PREFIX}<rank> files in {folder}")
    return dumps


def gloo_pg_config(dump: dict, world: list[int]) -> dict:
    """``dump`` with its process-group table keyed by group name, as the analyzer expects.

    On gloo, ``pg_config`` holds a single entry keyed ``''``, while every recorded collective names its
    group: ``'0'`` for the default group, ``'1'``, ``'2'``... for groups made later. The analyzer looks
    groups up by that name and fails with a ``KeyError``; so the placeholder becomes ``'0'``, and every
    group the entries name gets an entry. Ranks: the placeholder's list when it has one, else ``world``
    (a group made by ``new_group()`` without ranks was dumped with ``[]``, which means every rank).
    """
    config = dict(dump["pg_config"])
    placeholder = config.pop("", None)
    ranks = placeholder["ranks"] if placeholder and placeholder.get("ranks", "[]") != "[]" else str(list(world))
    for entry in dump["entries"]:
        name, desc = entry["process_group"]
        config.setdefault(name, {"name": name, "desc": desc, "ranks": ranks})
    if placeholder is not None:
        config.setdefault("0", {"name": "0", "desc": "default_pg", "ranks": ranks})
    return {**dump, "pg_config": config}


def write_fixed(folder: str, out: str) -> str:
    """Copy the dumps in ``folder`` to ``out`` with :func:`gloo_pg_config` applied, so that torch's own
    command, ``torchfrtrace out``, can analyze them. Returns ``out``."""
    raw = read_dumps(folder)
    os.makedirs(out, exist_ok=True)
    for rank, dump in raw.items():
        write_atomic(os.path.join(out, f"{DUMP_PREFIX}{rank}"), pickle.dumps(gloo_pg_config(dump, sorted(raw))))
    return out


@dataclass
class Finding:
    """What the analyzer found: the first collective the ranks do not agree on, if any."""

    ok: bool
    seq: int | None = None  # collective sequence number of the first disagreement
    op: str = ""  # the op the reference rank issued there, e.g. gloo:all_reduce
    differing: dict[int, str] = field(default_factory=dict)  # rank -> what it issued instead
    kinds: dict[int, str] = field(default_factory=dict)  # rank -> the analyzer's mismatch type
    missing: list[int] = field(default_factory=list)  # ranks that never issued it
    issued: dict[int, int] = field(default_factory=dict)  # rank -> collectives in its ring
    report: str = ""  # the analyzer's own text
    where: str = ""  # the first frame outside torch of a call to that collective, e.g. "train.py:88 in step"

    @property
    def culprits(self) -> list[int]:
        return sorted(set(self.differing) | set(self.missing))

    def describe(self) -> str:
        if self.ok:
            return f"flight recorder: every rank issued the same collectives ({self.issued})"
        what = [f"rank {r} issued {op} ({self.kinds[r]})" for r, op in sorted(self.differing.items())]
        what += [f"rank {r} never issued it" for r in self.missing]
        called = f", called at {self.where}" if self.where else ""
        return (f"flight recorder: collective #{self.seq} ({self.op}{called}) disagrees: {'; '.join(what)}; "
                f"collectives issued per rank: {self.issued}")


def analyze(folder: str) -> Finding:
    """Run torch's analyzer on the dumps in ``folder`` (gloo's table fixed) and return its first finding."""
    raw = read_dumps(folder)
    dumps = {rank: gloo_pg_config(d, sorted(raw)) for rank, d in raw.items()}
    details = {f"{DUMP_PREFIX}{r}": {"host_name": f"host_rank{r}", "rank": r, "entries": d["entries"],
                                     "version": d["version"], "pg_config": d["pg_config"]} for r, d in dumps.items()}
    args = Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=False, mismatch_cap=10,
                     selected_ranks=None, pg_filters=None, print_stack_trace=False)
    issued = {r: len(d["entries"]) for r, d in dumps.items()}
    from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger

    FlightRecorderLogger()  # its first instance adds a console handler: let it happen before the capture
    with _captured(_LOGGER) as report:
        from torch.distributed.flight_recorder.components.builder import build_db  # warns without tabulate

        db = build_db(details, args, str(next(iter(dumps.values()))["version"]))
    for coll in db.collectives:
        if coll.pass_check and not coll.missing_ranks:
            continue
        mism = coll.mismatch_collectives or {}
        return Finding(False, coll.collective_seq_id, coll.collective_name,
                       {r: c.collective_name for r, c in mism.items()},
                       {r: c.type_of_mismatch.state.name if c.type_of_mismatch else "" for r, c in mism.items()},
                       sorted(coll.missing_ranks or ()), issued, _findings_only(report.getvalue()),
                       _call_site(dumps, coll.collective_seq_id, coll.collective_name,
                                  set(mism) | set(coll.missing_ranks or ())))
    return Finding(True, issued=issued, report=_findings_only(report.getvalue()))


def _call_site(dumps: dict[int, dict], seq: int, op: str, culprits: set[int]) -> str:
    """Where a rank that is not a culprit issued collective ``seq`` (``op``): its entry's first frame
    outside torch (each entry keeps the Python stack that issued it)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    for rank in sorted(set(dumps) - culprits) or sorted(dumps):
        for entry in dumps[rank]["entries"]:
            if entry.get("collective_seq_id") != seq or entry.get("profiling_name") != op:
                continue
            for frame in entry.get("frames", []):
                if not frame["filename"].startswith(torch_dir):
                    return f"{os.path.basename(frame['filename'])}:{frame['line']} in {frame['name']}"
    return ""


def _findings_only(report: str) -> str:
    """The analyzer's text without its warning that the optional table printer (tabulate) is missing."""
    return "\n".join(line for line in report.splitlines() if not line.startswith("tabulate is not installed"))


def stall_summary(folder: str, max_chars: int = 400, ranks: list[int] | None = None) -> str:
    """A few lines for a stall report: the analyzer's finding on the dumps in ``folder``, or why there is none.

    ``ranks``: every rank of the job. When some left no dump (a rank blocked inside a C++ call cannot run
    the Python handler that dumps it), the rings of the others cannot say who is missing from what: the
    summary names the silent ranks and counts the others' collectives instead."""
    try:
        dumps = read_dumps(folder)
        silent = sorted(set(ranks or ()) - set(dumps))
        if silent:
            text = (f"flight recorder: no ring from rank(s) {silent} (blocked inside a C++ call?); collectives "
                    f"issued per rank: {({r: len(d['entries']) for r, d in dumps.items()})}")
        else:
            text = analyze(folder).describe()
    except (OSError, KeyError, ValueError, AssertionError, pickle.UnpicklingError) as exc:
        text = f"flight recorder: no analysis ({type(exc).__name__}: {exc})"
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


@contextlib.contextmanager
def _captured(name: str):
    """Collect what a logger writes (and keep it off the console) for the duration of the block."""
    logger, buffer = logging.getLogger(name), io.StringIO()
    handler = logging.StreamHandler(buffer)
    saved = logger.handlers[:], logger.propagate, logger.level
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    try:
        yield buffer
    finally:
        logger.handlers, logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])
