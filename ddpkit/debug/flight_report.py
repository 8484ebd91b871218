"""Summarizing Flight Recorder dumps: torch's analyzer on every rank's ring, its finding, the stall report.

torch's analyzer (``torch.distributed.flight_recorder``, installed as the ``torchfrtrace`` command) lines
the rings up by sequence number and reports the first collective that the ranks do not all agree on: a
different op, size or dtype on some rank, or a rank that never issued it. :func:`analyze` runs it on
the dumps of a folder (read and fixed for gloo by :mod:`ddpkit.debug.flight_read`) and returns that
finding, with where the collective was called; :func:`stall_summary` is the few lines the launcher's
stall report ends with.

With two ranks, "the culprit" is a coin toss: the analyzer compares every rank with the first one and
blames the rank that differs, so with ranks 0 and 1 it blames rank 1 whichever of them is wrong. With
three or more, the odd one out is the rank that differs from the others.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
from argparse import Namespace
from dataclasses import dataclass, field

import torch

from ddpkit.debug.flight_read import DUMP_PREFIX, gloo_pg_config, read_dumps

_LOGGER = "Flight Recorder"  # the analyzer reports through this logger


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


@dataclass
class CommandRun:
    """What torch's own command said about a folder of dumps: its text, and the exception it ended with."""

    output: str  # what it printed and logged
    error: str = ""  # "KeyError: ''" when it raised, else empty

    @property
    def ok(self) -> bool:
        return not self.error


def torchfrtrace(folder: str) -> CommandRun:
    """Run torch's command ``torchfrtrace FOLDER`` (its entry point, ``fr_trace.main``) in this process, which
    has imported torch already (a new ``torchfrtrace`` process spends seconds on that), and return its text
    and the exception it raised, if any. On gloo's dumps as written it raises ``KeyError: ''`` (their group
    table, see :mod:`ddpkit.debug.flight_read`); on the copies :func:`~ddpkit.debug.flight_read.write_fixed`
    writes it names the culprit rank. The command reads the dumps with ``pickle.load``: give it only dumps
    your own job wrote (:func:`~ddpkit.debug.flight_read.read_dumps` accepts plain data only)."""
    from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger

    FlightRecorderLogger()  # its first instance adds a console handler: let it happen before the capture
    printed, error = io.StringIO(), ""
    with _captured(_LOGGER) as report, contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        from torch.distributed.flight_recorder.fr_trace import main  # says once that tabulate is missing

        try:
            main([folder])
        except Exception as exc:  # noqa: BLE001 - the command's own failure is the finding
            error = f"{type(exc).__name__}: {exc}"
    return CommandRun(_findings_only(printed.getvalue() + report.getvalue()), error)


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
