"""Atomic and durable file writes: the one helper behind every file ddpkit writes.

Two properties, and what each costs:

* **Atomic**: a reader sees the old file or the whole new one, never a part. Write a temporary file
  in the same folder, then ``os.replace`` it over the target (a rename within one file system is
  atomic). On failure the temporary file is removed, so nothing is left behind.
* **Durable**: after the call returns, a power cut does not lose the file. ``fsync`` the file's data
  *and* the folder that holds its name (the rename is a change to the folder). Only checkpoints pay for
  this; a run summary or a launcher's result file does not need to survive a power cut.

:class:`HashingWriter` computes a sha256 while a file is written, on a second thread (``hashlib``
releases the GIL), instead of reading the file back afterwards: a checkpoint's manifest costs almost
nothing over the write itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
from pathlib import Path
from typing import IO, Iterator


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a folder's entries (new names, renames, deletions) durable."""
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
            fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: bytes | str, durable: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (and durably if asked)."""
    with atomic_write(path, "wb" if isinstance(data, bytes) else "w", durable) as handle:
        handle.write(data)


class HashingWriter:
    """A write-only file wrapper that hashes (sha256) and counts what passes through it.

    The hashing runs on a second thread, fed in order through a queue, so it overlaps with the
    serialisation that produces the bytes. Each chunk is copied before it is queued: the caller
    (``torch.save``) may reuse its buffer once ``write`` returns. Call :meth:`finish` once, at the end.
    """

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.nbytes = 0
        self._sha = hashlib.sha256()
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._hash, name="ddpkit-sha256", daemon=True)
        self._thread.start()

    def _hash(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            self._sha.update(chunk)

    def write(self, data) -> int:
        chunk = bytes(data)
        self._chunks.put(chunk)
        self.nbytes += len(chunk)
        return self.handle.write(chunk)

    def flush(self) -> None:
        self.handle.flush()

    def finish(self) -> tuple[str, int]:
        """Wait for the hashing thread; return (sha256 hex digest, bytes written)."""
        self._chunks.put(None)
        self._thread.join()
        return self._sha.hexdigest(), self.nbytes


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
