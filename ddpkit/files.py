"""Atomic and durable file writes: the one helper behind every file ddpkit writes.

Two properties, and what each costs:

* **Atomic**: a reader sees the old file or the whole new one, never a part. Write a temporary file
  in the same folder, then ``os.replace`` it over the target (a rename within one file system is
  atomic). On failure the temporary file is removed, so nothing is left behind.
* **Durable**: after the call returns, a power cut does not lose the file. ``fsync`` the file's data
  *and* the folder that holds its name (the rename is a change to the folder). Only checkpoints pay for
  this; a run summary or a launcher's result file does not need to survive a power cut.

:class:`FollowingHash` computes a file's sha256 while it is being written, on a second thread,
instead of reading the file back afterwards: a checkpoint's manifest costs little over the write.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import IO, Iterator


def fsync_path(path: str | os.PathLike) -> None:
    """Make a file's data, or a folder's entries (new names, renames, deletions), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", durable: bool = False) -> Iterator[IO]:
    """Open a temporary file beside ``path``; when the block ends without error, rename it over ``path``.

    ``durable=True`` also fsyncs the file before the rename and the folder after it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as handle:
            yield handle
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_path(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: bytes | str, durable: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (and durably if asked)."""
    with atomic_write(path, "wb" if isinstance(data, bytes) else "w", durable) as handle:
        handle.write(data)


class FollowingHash:
    """The sha256 and size of a file that another writer is writing now, read as it grows.

    A thread follows the file from its start, hashing each new block as soon as it is in the page
    cache (``hashlib`` releases the GIL, so this runs beside the writer), and :meth:`finish` collects
    what is left once the writer is done. The writer must write sequentially, never seeking back:
    ``torch.save`` does (its zip writer checks its own position on every write). The copy that the
    read makes happens on the hashing thread, not on the writer's.
    """

    def __init__(self, path: str | os.PathLike, poll_s: float = 0.0002) -> None:
        self.path, self.poll_s = Path(path), poll_s
        self.path.touch()  # exists, empty, before the writer starts
        self._done = threading.Event()
        self._result: tuple[str, int] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._follow, name="ddpkit-sha256", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        digest, nbytes = hashlib.sha256(), 0
        try:
            with open(self.path, "rb", buffering=0) as handle:
                while True:
                    finished = self._done.is_set()  # read before the last read: nothing is missed
                    block = handle.read(1 << 20)
                    if block:
                        digest.update(block)
                        nbytes += len(block)
                    elif finished:
                        break
                    else:
                        time.sleep(self.poll_s)
            self._result = (digest.hexdigest(), nbytes)
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self._error = exc

    def finish(self) -> tuple[str, int]:
        """The writer is done: hash the rest and return (sha256 hex digest, bytes)."""
        self._done.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
