"""Fence in a process that runs the learner's code: what it may write, what it may reach, what it may learn.

* **Files.** On Linux with Landlock (kernel 5.13+, on by default in most distributions), the sandbox and
  everything it starts may write only inside its own working folder, ``/dev/shm`` and ``/dev/null``;
  the kernel enforces it, whatever the code calls. Where Landlock is missing the sandbox says so in its
  report and relies on the audit hook below.
* **The interpreter's escape hatches.** :func:`install_guard`, a ``sys.addaudithook`` hook (PEP 578: it
  cannot be removed, and it sees what happens in C as well as in Python, in every thread), refuses to the
  learner's code: frames (``sys._getframe``, a traceback's or a generator's frame: the way to the
  grader's own variables), the garbage collector's object lists, signalling a process outside its own,
  writing outside the working folder, and swapping a function's code; and to any code of a learner's
  process, whoever asks (a library's thread could be made to ask on the learner's behalf): ``ctypes``,
  tracing and profiling, starting programs, and another process's files or any process's memory under
  ``/proc``. Each refusal but the frames' is recorded, and the grade says so.
* **Other processes' memory.** The sandbox's processes are made not dumpable (:func:`not_dumpable`).
* **Whose code it is.** The learner's code is every function whose code does not come from the
  installed packages, the standard library or ddpkit, and every code object compiled while the
  learner's code was running (``exec``, ``compile``, ``code.replace``): code run through ``exec`` is the
  learner's too, whatever file name it claims. A thread started while the learner's code was running
  (a pool's worker too) is the learner's, whatever it runs (:func:`ddpkit.exercises.witness.watch_threads`).
* **Memory.** ``RLIMIT_DATA`` bounds each process's heap (the grader also watches the whole group's
  resident memory).

The guard is a closure referenced by the interpreter's list of hooks and by no module: the learner's
code, which is refused frames and the garbage collector, has no way to reach it, and it calls only the
functions it took when it was installed. (What it cannot stop: code that rewrites, in its own process,
the standard library functions those call, or starts a raw thread on a library function; a measurement
taken in that process can then be falsified. Neither reaches the verdict, which is decided elsewhere,
from data the grader checks against values it computed itself.)
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import sysconfig
import threading

LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446  # x86-64 and arm64 alike
PR_SET_NO_NEW_PRIVS = 38
_WRITE_ACCESS = (1 << 1) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12)
# write_file, remove_dir, remove_file, make_char, make_dir, make_reg, make_sock, make_fifo, make_block, make_sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14  # ABI 2 and 3


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_writes_only_under(folders: list[str]) -> str:
    """Allow writes only beneath ``folders`` for this process and its children; return what happened."""
    if not sys.platform.startswith("linux"):
        return "no Landlock on this system"
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(LANDLOCK_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return "Landlock is not enabled in this kernel"
    handled = _WRITE_ACCESS | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(handled)
    ruleset = libc.syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(8), 0)
    if ruleset < 0:
        return f"Landlock refused a ruleset (errno {ctypes.get_errno()})"
    try:
        for folder in folders:
            if not os.path.exists(folder):
                continue
            fd = os.open(folder, os.O_PATH | os.O_CLOEXEC)
            try:
                access = handled if os.path.isdir(folder) else handled & ((1 << 1) | _TRUNCATE)
                rule = _PathBeneath(access, fd)
                if libc.syscall(LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) != 0:
                    return f"Landlock refused a rule for {folder} (errno {ctypes.get_errno()})"
            finally:
                os.close(fd)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if libc.syscall(LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            return f"Landlock could not restrict this process (errno {ctypes.get_errno()})"
    finally:
        os.close(ruleset)
    return "landlock"


def not_dumpable() -> None:
    """Make this process (and the ones it forks) not dumpable: for a user other than root, the kernel then
    refuses other processes of the same user its memory (``/proc/<pid>/mem``, ``ptrace``). Root keeps
    that power: grade as an ordinary user where the room's code is not trusted."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


def limit_memory(megabytes: int) -> None:
    """Bound the heap of this process and of every process it starts."""
    limit = megabytes * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def trusted_roots() -> tuple[str, ...]:
    """Folders whose code is not the learner's: the standard library, the installed packages, ddpkit."""
    import ddpkit

    roots = {os.path.dirname(os.path.abspath(ddpkit.__file__))}
    for scheme_paths in (sysconfig.get_paths(), sysconfig.get_paths(vars={"base": sys.base_prefix,
                                                                          "platbase": sys.base_prefix})):
        roots |= {scheme_paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if scheme_paths.get(k)}
    roots |= {p for p in sys.path if p.rstrip(os.sep).endswith(("site-packages", "dist-packages", "lib-dynload"))}
    return tuple(sorted(os.path.realpath(r).rstrip(os.sep) + os.sep for r in roots))


FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "gi_yieldfrom"})
RUN_PROGRAMS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile",
                          "pty.spawn"})
INTROSPECTION = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames"})


def install_guard(workdir: str, report, protected_code: frozenset[str] = frozenset(),
                  watched_ids: frozenset[int] = frozenset(), watch_files: bool = False) -> None:
    """Install the audit hook of a process that runs the learner's code (see the module docstring).

    ``report(kind, text)`` is called with what it sees: ``refused`` (an escape hatch the learner's code
    tried), ``forbidden`` (a watched implementation ran: :mod:`ddpkit.exercises.witness` raises the
    ``ddpkit.forbidden`` event from inside it), and, with ``watch_files``, ``file`` (``fsync`` and
    ``rename`` of files, for the checkpoint check). ``protected_code`` are files whose modules must not
    be executed again (a re-import would bring back the watched functions unwatched); ``watched_ids``
    are the ``id()`` of the watched functions, whose code is not for the learner to read.

    The hook is a closure over the functions it needs, taken now: a module's or a class's attribute that
    the learner's code rewrites later changes nothing in it, and nothing but the interpreter's list of
    hooks refers to it."""
    workdir = os.path.realpath(workdir)
    roots = trusted_roots()
    realpath, isabs, getframe, getpid = os.path.realpath, os.path.isabs, sys._getframe, os.getpid
    get_ident = threading.get_ident
    learner_threads: set[int] = set()  # idents of threads started while the learner's code ran
    pending_threads: set[int] = set()  # id() of Thread objects started so, not running yet
    events, frame_attributes, run_programs = _EVENTS, FRAME_ATTRIBUTES, RUN_PROGRAMS
    introspection, path_of, descendant = INTROSPECTION, _path, _is_descendant
    learner_files: set[str] = set()
    verdicts: dict = {}
    seen: set = set()
    local = threading.local()
    allowed_writes = (workdir + os.sep, "/dev/shm/", "/dev/null")
    here = install_guard.__code__.co_filename  # frames of this hook are skipped when looking for the asker

    def is_learner_file(filename) -> bool:
        if type(filename) is not str:
            return True
        if filename in learner_files:
            return True
        known = verdicts.get(filename)
        if known is None:
            if filename.startswith("<frozen "):
                known = False
            elif filename.startswith("<") or not isabs(filename):
                known = True  # <string>, <stdin>, a notebook cell: exec'd or typed code
            else:
                known = not realpath(filename).startswith(roots)
            verdicts[filename] = known
        return known

    def requester():
        """The frame whose call raised the event (the first one outside this file)."""
        frame = getframe(1)  # raises the sys._getframe event: the hook is busy, so it is let through
        while frame is not None and frame.f_code.co_filename == here:
            frame = frame.f_back
        return frame

    def learner_on_stack() -> bool:
        if get_ident() in learner_threads:
            return True
        frame = requester()
        while frame is not None:
            if is_learner_file(frame.f_code.co_filename):
                return True
            frame = frame.f_back
        return False

    def frame_for_learner() -> bool:
        """Would a frame asked for now reach the learner's code? Yes when the learner's code asks, or asks
        through a function whose job is to hand frames out (``inspect``'s, ``traceback.walk_*``); not when
        library code asks for its own use under the learner's call (torch formats a stack, ``logging``
        finds its caller, ``typing`` and ``namedtuple`` read a module name)."""
        asking = requester()
        if asking is None or not learner_on_stack():
            return False
        code = asking.f_code
        return is_learner_file(code.co_filename) or code.co_filename.endswith(f"{os.sep}inspect.py") or \
            code.co_name in ("walk_stack", "walk_tb")

    def note(kind: str, text: str) -> None:
        if (kind, text) not in seen:
            seen.add((kind, text))
            report(kind, text)

    def refuse(what: str) -> None:
        note("refused", what)
        raise PermissionError(f"the grader's sandbox does not allow {what}")

    def handle(event: str, args: tuple) -> None:  # noqa: C901 - one branch per event, in one place
        if event == "ddpkit.forbidden":
            note("forbidden", str(args[0]))
        elif event == "ddpkit.thread":
            if learner_on_stack():
                pending_threads.add(id(args[1]))
        elif event == "ddpkit.thread_run":
            if id(args[1]) in pending_threads:
                pending_threads.discard(id(args[1]))
                learner_threads.add(get_ident())
        elif event == "sys._getframe" or (
                event == "object.__getattr__" and type(args[1]) is str and args[1] in frame_attributes):
            if frame_for_learner():  # not recorded: a ValueError, which namedtuple, typing and logging cope with
                raise ValueError("the grader's sandbox gives no frames to the learner's code")
        elif event == "object.__getattr__":
            if args[1] == "__code__" and id(args[0]) in watched_ids and learner_on_stack():
                refuse("reading the code of a function the grader watches")
        elif event == "object.__setattr__":
            if type(args[1]) is str and args[1] == "__code__" and learner_on_stack():
                refuse("swapping a function's code")
        elif event in ("compile", "code.__new__"):
            filename = args[1] if len(args) > 1 else None
            if type(filename) is bytes:
                filename = filename.decode(errors="replace")
            if type(filename) is str and learner_on_stack():
                learner_files.add(filename)  # whatever name it claims, code made by the learner's code is theirs
        elif event == "exec":
            if getattr(args[0], "co_filename", None) in protected_code:
                refuse("running a watched module's code again (a re-import)")
        elif event in ("sys.settrace", "sys.setprofile"):
            refuse(f"{event} (tracing would blind the grader's witnesses)")
        elif event[:7] == "ctypes.":  # whoever asks: a thread of a library's could be made to ask for the learner
            refuse(event)
        elif event in introspection:
            if learner_on_stack():
                refuse(event)
        elif event in run_programs:  # whoever asks, for the same reason
            refuse(f"starting a program ({event})")
        elif event in ("os.kill", "os.killpg"):
            target = args[0]
            if learner_on_stack() and (event == "os.killpg" or type(target) is not int or not descendant(target)):
                refuse("signalling a process outside its own")
        elif event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            path = path_of(path)
            if path is None:
                return
            writing = (type(mode) is str and any(c in mode for c in "wax+")) or \
                      (type(flags) is int and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if path.startswith("/proc/"):  # whoever asks: another process's files, or any process's memory
                parts = realpath(path).split("/")
                if len(parts) > 2 and parts[2].isdigit() and (int(parts[2]) != getpid() or "mem" in parts[3:]):
                    refuse("reading another process's memory or state")
            if not writing:
                return
            real = realpath(path)
            if not (real.startswith(allowed_writes) or real == workdir) and learner_on_stack():
                refuse(f"writing {path[:80]}, outside its own folder")
        elif event in ("os.rename", "os.link") and watch_files:
            src, dst = path_of(args[0]), path_of(args[1])
            if src and dst:
                report("file", ["rename", realpath(src), realpath(dst)])
        elif event == "ddpkit.fsync" and watch_files:
            report("file", ["fsync", str(args[0])])
        elif event == "ddpkit.sync" and watch_files:
            report("file", ["sync"])

    def hook(event: str, args: tuple) -> None:
        if event[:7] != "ctypes." and event not in events:
            return
        if getattr(local, "busy", False):
            return
        local.busy = True
        try:
            handle(event, args)
        finally:
            local.busy = False

    sys.addaudithook(hook)


_EVENTS = frozenset({"ddpkit.forbidden", "ddpkit.thread", "ddpkit.thread_run", "ddpkit.fsync", "ddpkit.sync", "sys._getframe", "object.__getattr__",
                     "object.__setattr__", "compile", "code.__new__", "exec", "sys.settrace", "sys.setprofile",
                     "os.kill", "os.killpg", "open", "os.rename", "os.link"}) | INTROSPECTION | RUN_PROGRAMS


def _path(value) -> str | None:
    """A path the hook may read without running the learner's code: str, bytes, or a pathlib path."""
    if type(value) is str:
        return value
    if type(value) is bytes:
        return value.decode(errors="replace")
    if type(value).__module__ == "pathlib":  # the standard library's own __fspath__
        return os.fspath(value)
    return None


def _is_descendant(pid: int) -> bool:
    """True when ``pid`` is this process or one it started (walking parents through /proc)."""
    me = os.getpid()
    for _ in range(64):
        if pid == me:
            return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                pid = int(handle.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False
