"""Fence the sandbox process in before the learner's code runs: what it may write, and what it may reach.

* **Files.** On Linux with Landlock (kernel 5.13+, on by default in most distributions), the process
  and everything it starts may write only inside its own working folder, ``/dev/shm`` and ``/dev/null``;
  the kernel enforces it, whatever the code calls. Where Landlock is missing the sandbox says so in its
  report and relies on the audit hook below.
* **The interpreter's escape hatches.** A ``sys.addaudithook`` hook (it cannot be removed) refuses,
  when the learner's code asks for them: ``ctypes``, ``sys.settrace``/``setprofile`` (which would switch
  the witnesses off), ``gc.get_objects``/``get_referrers`` (which would find the grader's objects),
  ``os.kill`` of a process outside the sandbox, starting programs, and writing files outside the working
  folder. The refusal is recorded, and the grade says so.
* **Memory.** ``RLIMIT_DATA`` bounds each process's heap (the parent also watches the whole group's
  resident memory).
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

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


def limit_memory(megabytes: int) -> None:
    """Bound the heap of this process and of every process it starts."""
    limit = megabytes * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


class AuditGuard:
    """Refuses the interpreter's escape hatches to the learner's code (see the module docstring)."""

    BLOCKED = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "sys.settrace", "sys.setprofile", "gc.get_objects",
               "gc.get_referrers", "gc.get_referents", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
               "os.spawn", "sys._current_frames"}

    def __init__(self, workdir: str, learner_files: set[str], log: str | None = None) -> None:
        self.log = log
        self.workdir = os.path.realpath(workdir)
        self.learner_files = learner_files
        self.refused: list[str] = []
        self.allowed_pids = {os.getpid()}

    def _from_learner(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename in self.learner_files:
                return True
            frame = frame.f_back
        return False

    def __call__(self, event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                      (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if not writing or not isinstance(path, (str, bytes, os.PathLike)):
                return
            real = os.path.realpath(os.fsdecode(path))
            if real.startswith((self.workdir + os.sep, "/dev/shm/", "/dev/null")) or real == self.workdir:
                return
            if self._from_learner():
                self._refuse(f"writing {os.fsdecode(path)}, outside its own folder")
            return
        if event == "os.kill":
            pid = args[0]
            if pid in (0, -1) or (pid > 0 and pid not in self.allowed_pids and not _is_descendant(pid)):
                if self._from_learner():
                    self._refuse("signalling a process outside the sandbox")
            return
        if event in self.BLOCKED and self._from_learner():
            self._refuse(event)

    def _refuse(self, what: str) -> None:
        if what not in self.refused:
            self.refused.append(what)
            from ddpkit.exercises.witness import note

            note(self.log, "refused", what)
        raise PermissionError(f"the grader's sandbox does not allow {what}")

    def install(self) -> None:
        sys.addaudithook(self)


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
