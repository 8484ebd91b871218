"""Checks for the exercises in ``exercises/``: each runs the learner's code on real ranks and says, in one
sentence, what is wrong and the evidence, or that it passed.

A check never raises for a wrong answer. It returns a :class:`Result` (``passed``, ``message``), which
the notebook shows. Called from a notebook cell, a check does not run the learner's objects in the
kernel: it turns them back into the code of their cells (:mod:`ddpkit.exercises.sources`) and runs that
in a fresh, bounded sandbox (:mod:`ddpkit.exercises.sandbox`), the same way ``ddpkit check`` grades a
room. So the kernel's own state (a process group it joined, CUDA it touched, names it redefined)
changes nothing. In the sandbox a check runs in a process that never loads the learner's code: it is
given a :class:`~ddpkit.exercises.learner.LearnerRef` per contract name, the learner's code runs in
processes of its own that get only their own inputs and send back plain data
(:mod:`ddpkit.exercises.learner`, :mod:`ddpkit.exercises.ranks`), and the check compares that data with
values it computes itself. Those processes see what runs (:mod:`ddpkit.exercises.witness`): the kit's
own answer or PyTorch's feature, reached under any name, is refused.

An untouched stub (it raises ``NotImplementedError``) gets "not implemented yet: write <name> between the
markers". Code that raises on one rank, or hangs on one rank, gets a sentence naming the rank, within a
limit sized from this machine's measured speed (:mod:`ddpkit.exercises.timing`), which also tells a rank
that hung (no CPU used) from one that was only too slow here. Ranks that all gave up waiting for each
other (gloo's own timeouts, in a send or a receive) get a sentence about the deadlock, not gloo's file
and line.

One module per lesson group (``data``, ``step``, ``ddp``, ``collectives``, ``sharding``, ``fsdp``,
``checkpointing``, ...); :mod:`~ddpkit.exercises.catalog` lists every exercise, its checks and what it
refuses. :func:`hint` reveals a hint on demand.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from ddpkit.exercises import timing

IN_SANDBOX_ENV = "DDPKIT_EXERCISE_SANDBOX"  # set inside the grader's sandbox process


@dataclass(frozen=True)
class Result:
    """What a check found: ``passed``, and one sentence that says why."""

    passed: bool
    message: str

    def __str__(self) -> str:
        return f"{'PASSED' if self.passed else 'NOT YET'}: {self.message}"

    __repr__ = __str__  # what a notebook shows as text

    def _repr_markdown_(self) -> str:
        return f"{'✅' if self.passed else '❌'} **{'passed' if self.passed else 'not yet'}**: {self.message}"


class Wrong(Exception):
    """Raised inside a check (never out of it) to stop at the first problem, with its sentence."""


def not_implemented(name: str) -> Result:
    return Result(False, f"not implemented yet: write {name} between the markers")


def run_on_ranks(name: str, worker: Callable[..., Any], *args: Any, world_size: int, timeout: float | None = None,
                 kwargs: dict | None = None, rank_args: list | None = None, idle_after: float | None = None,
                 ) -> list[Any] | Result:
    """``worker(ctx, *args, *rank_args[rank])`` on ``world_size`` real gloo ranks (:mod:`ddpkit.exercises.ranks`):
    each rank's return value (plain data), or a :class:`Result` that names the rank and what it raised,
    or whether it hung or was only too slow for this machine (see :mod:`ddpkit.exercises.timing`); a
    ``NotImplementedError`` gets the stub's sentence. ``rank_args`` give each rank inputs of its own
    that no other rank's process ever holds."""
    from ddpkit.exercises import ranks

    timeout = timing.collective_timeout() if timeout is None else timeout
    children = ranks.start(ranks.rank_tasks(worker, args, kwargs, world_size, timeout, rank_args), timeout,
                           idle_after=idle_after)
    if all(c.result is not ranks.NOTHING for c in children):
        return [c.result for c in children]
    return _failure(name, children, timeout)


def _failure(name: str, children: list, timeout: float) -> Result:
    """The sentence for a job that did not answer on every rank: its root cause, not its knock-on errors."""
    from ddpkit.exercises.ranks import NOTHING

    errors = sorted((c for c in children if c.error), key=lambda c: (c.error.get("time", 0), c.rank))
    primary = [c for c in errors if not c.error.get("knock_on")]
    stalled = [c for c in children if c.stalled]
    died = [c for c in children if c.result is NOTHING and not c.error and not c.stalled]
    if primary:
        cause = primary[0]
        kind, text = str(cause.error.get("type")), str(cause.error.get("message", ""))
        if kind == "NotImplementedError":
            return not_implemented(name)
        if kind in ("Wrong", "Refused"):
            return Result(False, _short(text, 190))
        return Result(False, f"rank {cause.rank} raised {kind}: {_short(text)}")
    if died:  # gone without a word (gloo aborts a rank, os._exit, a crash): its peers' errors follow from it
        return Result(False, f"rank {died[0].rank} ended its process without returning ({died[0].how_it_ended()})")
    if stalled and len(stalled) == len(children) and not any(c.busy for c in stalled) and not errors:
        return Result(False, "every rank hung, waiting and using no CPU: each waits for a message or a collective that "
                             "another rank has not reached")
    if stalled:
        rank = stalled[0]
        if rank.busy:
            return Result(False, f"too slow on this machine: rank {rank.rank} was still computing after {timeout:.0f} s "
                                 f"(a limit set from this machine's speed now); retry when it is less busy, or look "
                                 f"for a loop that never ends")
        return Result(False, f"rank {rank.rank} hung: its peers waited {timeout:.0f} s while it used no CPU, for a message "
                             f"or a collective that it never sent or joined")
    deadlock = _deadlock(errors)
    if deadlock:
        return Result(False, deadlock)
    cause = errors[0]
    return Result(False, f"rank {cause.rank} raised {cause.error.get('type')}: {_short(str(cause.error.get('message')))}")


_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (send|recv) op")


def _deadlock(errors: list) -> str | None:
    """The sentence for ranks that all gave up waiting (gloo's own timeouts, or a peer that closed the
    connection after its timeout): a deadlock, said in the learner's terms, not torch's file and line."""
    sends, receives, closed, waited = [], [], [], 0.0
    for child in errors:
        text = str(child.error.get("message", ""))
        found = _GLOO_TIMEOUT.search(text)
        if found:
            waited = max(waited, int(found.group(1)) / 1000)
            (sends if found.group(2) == "send" else receives).append(child.rank)
        elif "connection closed by peer" in text.lower() or "connection reset by peer" in text.lower():
            closed.append(child.rank)
        else:
            return None  # an error of another kind: said as it is
    if sends and receives:
        return (f"deadlock: {_ranks(sends)} waited {waited:.0f} s in a send that no peer received, {_ranks(receives)} in "
                f"a receive or a collective: a send waits for its matching receive; look at what each rank does first")
    if sends:
        return (f"deadlock: {_ranks(sends)} waited {waited:.0f} s in a send that no peer received: a send waits until "
                f"its peer posts the matching receive; look at what each rank does first at every step")
    if receives:
        return (f"deadlock: {_ranks(receives)} waited {waited:.0f} s for a message or a collective that no peer sent or "
                f"joined: look at which rank each one waits on, and whether that rank ever gets there")
    if closed:
        return (f"{_ranks(closed)} lost the connection to a peer that ended or gave up while waiting: look for a "
                f"message or a collective that not every rank reaches")
    return None


def _ranks(ranks: list) -> str:
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"


def _short(text: str, limit: int = 120) -> str:
    """The first sentence of an error, cut to ``limit`` characters (torch's messages run to hundreds)."""
    text = text.strip().split("\n")[0]
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def in_sandbox() -> bool:
    return os.environ.get(IN_SANDBOX_ENV) == "1"


def graded(exercise: str, check: str):
    """Make a check callable from a notebook: outside the sandbox, the learner's objects are turned back
    into their code and the check runs in a fresh sandbox process (:mod:`ddpkit.exercises.sandbox`);
    inside it (or given keywords, as the kit's own tests do), the check itself runs. ``__wrapped__`` is
    the check."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*objects: Any, **kwargs: Any) -> Result:
            if in_sandbox() or kwargs:
                return fn(*objects, **kwargs)
            from ddpkit.exercises.sandbox import check_objects

            return check_objects(exercise, check, objects)
        wrapper.exercise, wrapper.check = exercise, check  # which exercise's check it is, for batch grading
        return wrapper
    return decorate


from ddpkit.exercises.hints import HINTS  # noqa: E402 - data, kept in its own file


def hint(name: str, level: int = 1) -> None:
    """Print hint ``level`` (1, 2, ...) for exercise ``name``; a higher level says more."""
    hints = HINTS.get(name)
    if not hints:
        raise KeyError(f"no hints for {name!r}: one of {', '.join(sorted(HINTS))}")
    print(f"hint {min(level, len(hints))} of {len(hints)} for {name}: {hints[min(level, len(hints)) - 1]}")
