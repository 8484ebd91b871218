"""The learner's code, kept out of the processes that decide the grade.

The process that runs an exercise's checks (the case's process, :mod:`ddpkit.exercises.inside`) never
imports the learner's code. A check is given a :class:`LearnerRef` for each name the contract
defines; what the check does with it decides where the learner's code runs:

* passed to ranks (:func:`ddpkit.exercises.run_on_ranks`), it is loaded in each rank, a process of its
  own, and the rank's worker (grader code) calls it there;
* called by the check itself, the call runs in a child process (:func:`call`), and only plain data comes
  back (:mod:`ddpkit.exercises.channel`).

Every such process is forked from the case's spawner (:mod:`ddpkit.exercises.spawner`), so it holds
nothing of the check's but its own task, and before it loads anything of the learner's,
:func:`ddpkit.exercises.child.run_task` makes it a learner's process: the implementations the exercise must not use report
their calls (:func:`ddpkit.exercises.witness.watch`), the audit guard is installed
(:func:`ddpkit.exercises.confine.install_guard`), and what either sees goes to the grader at once, on the
child's nonce-stamped pipe, where the learner's code cannot take it back. The grader reads those
findings into :data:`SESSION` and the case runner turns them into the check's sentence.
"""

from __future__ import annotations

import os
import secrets
import select
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ddpkit.exercises import channel

_STATE: dict[str, Any] = {"learner": False, "submission": None, "refs": {}, "namespace": None}


@dataclass
class Session:
    """One case's learner code, as the grader's process knows it (never its objects)."""

    submission: str  # the path of submission.py
    refs: dict[str, str]  # contract name -> "module:qualname" for objects given by reference
    forbidden: dict[str, str]  # ref -> sentence (catalog.Exercise.forbidden)
    workdir: str  # where the learner's processes may write (the sandbox's folder)
    logdir: str = ""  # where their output goes (the case's folder)
    spawner: Any = None
    findings: list = field(default_factory=list)  # (kind, text) from the learner's processes, this check
    files: list = field(default_factory=list)  # file events (fsync, rename) in order, this check
    tampered: bool = False  # a learner process wrote into the grader's pipe

    def take(self, inbox: channel.Inbox) -> None:
        for kind, payload in inbox.messages:
            if kind == "finding":
                what, text = payload
                if what == "file":
                    self.files.append(list(text))
                elif (what, text) not in self.findings:
                    self.findings.append((what, text))
        self.tampered |= inbox.tampered


SESSION: Session | None = None  # set in the case's process while its checks run


class LearnerRef:
    """A name the contract defines, standing for the learner's object (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = self.__name__ = self.__qualname__ = name

    def __repr__(self) -> str:
        return f"<the learner's {self.name}>"

    def resolve(self) -> Any:
        """The learner's object itself: only in a learner's process, where it is loaded on first use."""
        if not _STATE["learner"]:
            raise RuntimeError("the learner's code is never loaded in the grader's process")
        return namespace()[self.name]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _STATE["learner"]:
            return self.resolve()(*args, **kwargs)
        return call(_apply, self, args, kwargs)

    def many(self, calls: list[tuple]) -> list:
        """``[self(*args) for args in calls]`` in one child process (one fork for many small calls)."""
        if _STATE["learner"]:
            return [self.resolve()(*args) for args in calls]
        return call(_apply_many, self, calls)


def real(obj: Any) -> Any:
    """The learner's object behind a :class:`LearnerRef` (in a learner's process), or ``obj`` itself."""
    return obj.resolve() if isinstance(obj, LearnerRef) else obj


def run(worker, *args: Any) -> Any:
    """``worker(*args)``: in a learner's child when an argument is a :class:`LearnerRef`, here otherwise
    (a check called directly, with the objects themselves, as the kit's own tests do)."""
    if any(isinstance(a, LearnerRef) for a in args) and not _STATE["learner"]:
        return call(worker, *args)
    return worker(*args)


def many(fn, calls: list[tuple]) -> list:
    """``[fn(*args) for args in calls]``: in one learner's child for a :class:`LearnerRef`, here otherwise."""
    if isinstance(fn, LearnerRef):
        return fn.many(calls)
    return [fn(*args) for args in calls]


def _apply(ref: LearnerRef, args: tuple, kwargs: dict) -> Any:
    return ref.resolve()(*args, **kwargs)


def _apply_many(ref: LearnerRef, calls: list[tuple]) -> list:
    fn = ref.resolve()
    return [fn(*args) for args in calls]


def namespace() -> dict[str, Any]:
    """The learner's module, loaded once in this (learner's) process, with the objects given by reference."""
    if _STATE["namespace"] is None:
        import importlib.util

        from ddpkit.exercises import witness

        path = _STATE["submission"]
        spec = importlib.util.spec_from_file_location(witness.SUBMISSION_MODULE, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[witness.SUBMISSION_MODULE] = module
        spec.loader.exec_module(module)
        found = dict(vars(module))
        for name, ref in _STATE["refs"].items():
            obj = witness.resolve(ref)
            if obj is None:
                raise ImportError(f"cannot find {ref}")
            found[name] = obj
        _STATE["namespace"] = found
    return _STATE["namespace"]


# ----------------------------------------------------------------------------- in the grader


class Raised(Exception):
    """The learner's call raised ``type_name``: ``message``; or ``type_name`` is ``hung``/``too slow``/``died``."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name

    def sentence(self, what: str, limit: int = 100) -> str:
        if self.type_name in ("hung", "too slow", "died"):
            return f"{what} {str(self)}"
        return f"{what} raised {self.type_name}: {short(str(self), limit)}"


def short(text: str, limit: int = 100) -> str:
    """The first line of a message, cut to ``limit`` characters (torch's run to hundreds)."""
    text = (str(text).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def task(worker, args=(), kwargs=None, **fields) -> dict:
    """A task for a child: the grader's ``worker``, its arguments, and how to run it."""
    session = SESSION
    out = {"worker": worker, "args": tuple(args), "kwargs": dict(kwargs or {}), "nonce": secrets.token_hex(16)}
    if session is not None:
        out.update(learner=True, submission=session.submission, refs=session.refs, forbidden=session.forbidden,
                   workdir=session.workdir)
    out.update(fields)
    return out


def call(worker, *args, timeout: float | None = None, watch_files: bool = False):
    """``worker(*args)`` in a learner's child process (grader code that uses :class:`LearnerRef` s); its
    return value as plain data. Raises ``NotImplementedError`` for the stub, :class:`Raised` otherwise."""
    from ddpkit.exercises import ranks, timing

    timeout = timing.collective_timeout() if timeout is None else timeout
    outcome = ranks.start([task(worker, args, log=_log("call"), watch_files=watch_files)], timeout,
                          limit=timeout)
    child = outcome[0]
    if child.result is not ranks.NOTHING:
        return child.result
    if child.error:
        if child.error["type"] == "NotImplementedError":
            raise NotImplementedError(child.error["message"])
        raise Raised(child.error["type"], child.error["message"])
    if child.stalled:
        if child.busy:
            raise Raised("too slow", f"was still computing after {timeout:.0f} s (a limit set from this machine's "
                                     f"speed now); look for a loop that never ends")
        raise Raised("hung", f"hung: after {timeout:.0f} s it was waiting, using no CPU")
    raise Raised("died", f"ended its process without returning ({child.how_it_ended()})")


def _log(kind: str) -> str | None:
    session = SESSION
    if session is None:
        return None
    return os.path.join(session.logdir or session.workdir, f"{kind}-{os.getpid()}-{time.monotonic_ns()}.log")


def wait_readable(fds: list[int], timeout: float) -> list[int]:
    if not fds:
        time.sleep(max(0.0, timeout))
        return []
    ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
    return ready
