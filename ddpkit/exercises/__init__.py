"""Checks for the exercises in ``exercises/``: each runs the learner's code on real ranks and says, in one
sentence, what is wrong and the evidence, or that it passed.

A check never raises for a wrong answer. It returns a :class:`Result` (``passed``, ``message``), which
the notebook prints. An untouched stub (it raises ``NotImplementedError``) gets "not implemented yet:
write <name> between the markers". Code that raises on one rank, or hangs on one rank, gets a sentence
naming the rank, within the check's time limit: the ranks are real processes under ``ddpkit.launch``
with a short collective timeout, so nothing waits forever.

One module per lesson group: ``data`` (the sampler), ``step`` (the train step), ``collectives`` (a
ring all-reduce), ``sharding`` (ZeRO-1), ``checkpointing`` (an atomic checkpoint), ``agreement`` (the
emergency-save decision). :func:`hint` reveals a hint on demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

CHECK_TIMEOUT_S = 5.0  # collective timeout inside a check: a hung learner rank is reported in seconds


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


def run_on_ranks(name: str, worker: Callable[..., Any], *args: Any, world_size: int, timeout: float = CHECK_TIMEOUT_S,
                 kwargs: dict | None = None) -> list[Any] | Result:
    """``ddpkit.launch(worker, *args)`` on ``world_size`` ranks; a failure becomes a :class:`Result` that
    names the rank and what it raised (or that it hung), and a ``NotImplementedError`` the stub sentence."""
    from ddpkit.failures import LaunchError
    from ddpkit.launch import launch

    try:
        return launch(worker, *args, world_size=world_size, backend="gloo", timeout=timeout, output="none",
                      progress="off", kwargs=kwargs)
    except LaunchError as exc:
        cause = exc.root_cause
        text = (cause.message.strip().splitlines() or [cause.kind])[0]
        if cause.exc_type == "NotImplementedError":
            return not_implemented(name)
        if cause.exc_type == "Wrong":
            return Result(False, text)
        if cause.kind == "stalled" or "timed out" in text.lower():
            # the rank that hung is the one still running when its peers timed out waiting for it
            hung = [f.rank for f in (cause, *exc.others) if f.kind in ("stalled", "stopped")]
            rank = hung[0] if hung else cause.rank
            return Result(False, f"rank {rank} hung: its peers waited more than {timeout:g} s for a message or a collective "
                                 f"that it never sent or joined")
        return Result(False, f"rank {cause.rank} raised {cause.exc_type}: {text[:200]}")


from ddpkit.exercises.hints import HINTS  # noqa: E402 - data, kept in its own file


def hint(name: str, level: int = 1) -> None:
    """Print hint ``level`` (1, 2, ...) for exercise ``name``; a higher level says more."""
    hints = HINTS.get(name)
    if not hints:
        raise KeyError(f"no hints for {name!r}: one of {', '.join(sorted(HINTS))}")
    print(f"hint {min(level, len(hints))} of {len(hints)} for {name}: {hints[min(level, len(hints)) - 1]}")
