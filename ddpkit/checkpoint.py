"""The artifact plane's storage: what survives a crash, and how we know it is intact.

This module knows folders, files and manifests, nothing about training (what goes *into* a
checkpoint, and whether a resume may use it, is ``state.py``'s business). The protocol:

* **Atomic**: every file is written into a temporary folder ``.tmp-step-N-PID`` and fsynced; a
  ``manifest.json`` holding the sha256 and size of every file is written **last** (and fsynced), the
  folder is fsynced, renamed to ``step-N``, and its parent fsynced. A crash at any instant leaves a
  temporary folder that is never read, or a complete checkpoint: it cannot damage an older one.
* **Pluggable writer**: :func:`prepare` makes the folder, any writer fills it (``full``: rank 0 with
  one ``torch.save`` file, :func:`write_torch`; ``dcp``: every rank writing its own shards,
  ``sharded_checkpoint.py``), and :func:`publish` seals it. Hashes are computed while the bytes are written, not by a second pass.
* **Verified**: "latest" means the newest checkpoint whose manifest verifies (well-formed, every file
  present with its size and sha256). A torn, altered or malformed one is skipped with a warning. A
  resume that finds checkpoints but none that verifies refuses (:func:`resume_point`): starting again
  from step 0 would quietly throw the run away.
* **Never deletes what it could not read**: a checkpoint folder that does not verify (bit rot, a newer
  manifest format, a file a transient I/O error hid) is moved aside into ``unreadable/``
  (:func:`set_aside`), never pruned or overwritten.
* **Pruned safely**: the newest ``keep_last`` good checkpoints are kept, always including the one just
  written. A checkpoint counts among the kept ones only once its content verifies (every file's
  sha256, not only its size), so a bit-rotted one can never push a good older one out. Re-saving a step
  swaps folders with two renames, and a crash between them is recovered, not pruned.
* **Data, not code**: files are read with ``torch.load(weights_only=True)``, whose unpickler builds only
  tensors, plain containers and an allow-list of types, and refuses any other pickled object (so an
  ordinary pickled class or function in the file is refused, not run). It is not a sandbox: torch's own
  docs say never to load data from an untrusted source, and ``weights_only=True`` itself had
  code-execution advisories in earlier torch releases (:data:`WEIGHTS_ONLY_ADVISORIES`, fixed in 2.6 and
  2.10, before the 2.13 this kit requires); :func:`load` warns in one line should it run under one.
  Load only checkpoints you or your jobs wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import resource
import shutil
import threading
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from ddpkit.errors import UserError
from ddpkit.files import FollowingHash, file_sha256, fsync_path

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
FORMAT = 2  # manifest format this code writes; format 1 (no "writer" field) is still read
EXTRA_FILE = "extra.pt"  # dcp writer: everything but the sharded tensors
DCP_METADATA = ".metadata"  # dcp writer: DCP's map of which chunk of which tensor lies in which file
WRITERS = {"full": (STATE_FILE,), "dcp": (DCP_METADATA, EXTRA_FILE)}  # writer -> files its checkpoints must contain
UNREADABLE_DIR = "unreadable"  # where checkpoints that do not verify are moved (never deleted)
STEP_DIR = re.compile(r"^step-(\d{8,})$")
_OLD_DIR = re.compile(r"^\.old-step-(\d{8,})-\d+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(UserError):
    """A checkpoint that must not be used, or a resume that would change training."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (torn, corrupted, malformed or incomplete)."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def step_of(path: str | Path) -> int:
    """The step a checkpoint folder is named for (``step-00000012`` -> 12)."""
    match = STEP_DIR.match(Path(path).name)
    if not match:
        raise CheckpointError(f"{path} is not a checkpoint folder (expected a name like step-00000012)")
    return int(match.group(1))


# --------------------------------------------------------------------------- writing

def prepare(root: str | Path, step: int) -> Path:
    """An empty temporary folder in ``root`` for checkpoint ``step`` (one writer per root)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def write_torch(path: Path, obj: Any) -> dict:
    """``torch.save`` to ``path``, hashed while written, fsynced. Returns the manifest entry.

    ``torch.save`` writes the file through its own C++ writer; a second thread hashes the bytes as they
    reach the page cache (:class:`~ddpkit.files.FollowingHash`), so hashing overlaps both the
    serialisation and the ``fsync`` instead of reading the file back afterwards.
    """
    follower = FollowingHash(path)
    try:
        torch.save(obj, str(path))
        fsync_path(path)
    finally:
        sha256, nbytes = follower.finish()
    return {"sha256": sha256, "bytes": nbytes}


def publish(root: str | Path, step: int, tmp: Path, files: dict[str, dict], meta: dict | None = None,
            keep_last: int = 3, writer: str = "full") -> Path:
    """Seal ``tmp`` as checkpoint ``step``: manifest last, rename into place, prune. Returns its folder."""
    root = Path(root)
    manifest = {"format": FORMAT, "writer": writer, "step": step, "created": time.time(),
                "meta": meta or {}, "files": files}
    with open(tmp / MANIFEST, "w") as handle:  # written last: its presence means "complete"
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_path(tmp)  # the files' names in the folder are durable too
    final = step_dir(root, step)
    if final.exists():  # re-saving a step (after a restart): swap, never leave a moment without it
        old = root / f".old-step-{step:08d}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)  # a crash between the renames is repaired by recover()
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_path(root)
    prune(root, keep_last, keep=final)
    return final


def save(root: str | Path, step: int, state: Any, keep_last: int = 3, meta: dict | None = None) -> Path:
    """Write ``state`` as checkpoint ``step`` with the ``full`` writer (one ``torch.save`` file)."""
    tmp = prepare(root, step)
    try:
        return publish(root, step, tmp, {STATE_FILE: write_torch(tmp / STATE_FILE, state)}, meta, keep_last)
    except (OSError, RuntimeError) as exc:
        raise save_failed(root, step, tmp, exc) from exc


def save_failed(root: str | Path, step: int, tmp: Path, exc: BaseException) -> CheckpointError:
    """A save that could not finish (a full disk, a quota, a file-size limit, an I/O error): its
    temporary folder goes, and the error says why, how much room is left, and that the newest good
    checkpoint is untouched. (``torch.save``'s C++ writer hides the errno: "unexpected pos ...", so the
    free space is what makes a full disk recognisable.)"""
    shutil.rmtree(tmp, ignore_errors=True)
    cause = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else _first_line(exc)
    size_limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if size_limit != resource.RLIM_INFINITY:
        cause += f"; this process may write files of at most {size_limit} bytes (ulimit -f)"
    free = shutil.disk_usage(root).free if Path(root).exists() else 0
    # looked up without repairing anything (latest_good would): the folder is left as the failure left it
    previous = next((p for p in list_checkpoints(root) if verify(p, deep=False) is None), None)
    return CheckpointError(f"saving checkpoint step {step} in {root} failed ({cause}; {free / 2**20:.0f} MiB free "
                           f"there): free space or choose another --checkpoint-dir; the newest good checkpoint is "
                           f"still {previous.name if previous else 'none'}")


# --------------------------------------------------------------------------- housekeeping

def recover(root: str | Path) -> None:
    """Repair a re-save interrupted between its two renames: the step lives on only as ``.old-step-N``."""
    root = Path(root)
    if not root.is_dir():
        return
    for path in root.iterdir():
        match = _OLD_DIR.match(path.name)
        if not match:
            continue
        final = step_dir(root, int(match.group(1)))
        if final.exists():
            shutil.rmtree(path, ignore_errors=True)  # the swap completed; this is the replaced copy
        else:
            os.rename(path, final)
            fsync_path(root)


def prune(root: str | Path, keep_last: int, keep: Path | None = None) -> None:
    """Keep ``keep`` and the newest good checkpoints, ``keep_last`` in all; move checkpoints that do not
    verify aside (:func:`set_aside`); delete older good ones and leftovers of interrupted saves (one
    writer per root, so every temporary folder is dead).

    Before a checkpoint is kept in place of an older one, its content is verified (every file's sha256):
    a bit-rotted checkpoint of the right size must not push a good one out. That reads the kept
    checkpoints back at every save that deletes one (``keep_last - 1`` of them): the price of knowing.

    Deleting a large folder takes a while (every block is freed), and nothing waits for it: what goes
    is first renamed to ``.trash-*`` (instant, and never listed as a checkpoint), then deleted on a
    background thread. Trash left by a process that ended first is deleted by the next prune.
    """
    root = Path(root)
    recover(root)
    doomed = list(root.glob(".tmp-step-*"))
    kept = [keep] if keep is not None else []
    candidates = [p for p in list_checkpoints(root) if p != keep]
    for n, path in enumerate(candidates):
        if len(kept) >= keep_last:
            doomed.append(path)
            continue
        problem = verify(path, deep=n + 1 < len(candidates))  # deep when keeping it costs an older one
        if problem is None:
            kept.append(path)
        else:
            set_aside(root, path, problem)
    for n, path in enumerate(doomed):
        with contextlib.suppress(OSError):
            os.rename(path, root / f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}-{n}")
    trash = list(root.glob(".trash-*"))
    if trash:
        threading.Thread(target=_delete, args=(trash,), name="ddpkit-prune", daemon=True).start()


def set_aside(root: str | Path, path: Path, problem: str) -> Path:
    """Move a checkpoint folder that does not verify into ``root/unreadable/`` (with a warning naming
    where): it may be repaired, read by a newer version, or have been hidden by a passing I/O error;
    deleting it would lose that chance, and leaving it would let a later save overwrite it."""
    aside = Path(root) / UNREADABLE_DIR
    aside.mkdir(exist_ok=True)
    target, n = aside / path.name, 1
    while target.exists():
        target, n = aside / f"{path.name}.{n}", n + 1
    os.rename(path, target)
    fsync_path(root)
    warnings.warn(f"checkpoint {path.name} does not verify ({problem}): moved to {target}", CheckpointWarning,
                  stacklevel=2)
    return target


def _delete(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def clear(root: str | Path) -> list[str]:
    """Delete every checkpoint and leftover in ``root`` (a run told to start clean). Returns what went."""
    root = Path(root)
    gone = [p.name for p in list_checkpoints(root)]
    for path in [*list_checkpoints(root), *root.glob(".tmp-step-*"), *root.glob(".old-step-*"), *root.glob(".trash-*")]:
        shutil.rmtree(path, ignore_errors=True)
    return gone


# --------------------------------------------------------------------------- reading

def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders, newest step first (verified or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=step_of, reverse=True)


def read_manifest(path: str | Path) -> dict:
    """The manifest of a checkpoint folder, checked for shape; raises CheckpointError with the reason."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError("no manifest (an interrupted save)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"manifest is a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") not in (1, FORMAT):
        raise CheckpointError(f"manifest format {manifest.get('format')!r} is not one this version reads (1 or {FORMAT})")
    writer = manifest.get("writer", "full")
    if writer not in WRITERS:
        raise CheckpointError(f"manifest names an unknown writer {writer!r}")
    if manifest.get("step") != step_of(path):
        raise CheckpointError(f"manifest says step {manifest.get('step')!r}, the folder says {step_of(path)}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError("manifest lists no files")
    for name in WRITERS[writer]:
        if name not in files:
            raise CheckpointError(f"manifest does not list {name}")
    for name, info in files.items():
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or (name.startswith(".") and name != DCP_METADATA):
            raise CheckpointError(f"manifest lists a file name that is not a plain name: {name!r}")
        if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) or isinstance(info.get("bytes"), bool) \
                or info["bytes"] < 0 or not isinstance(info.get("sha256"), str) or not _SHA256.match(info["sha256"]):
            raise CheckpointError(f"manifest entry for {name} needs a byte count and a sha256")
    if not isinstance(manifest.get("meta"), dict):
        raise CheckpointError("manifest has no meta object (the run's identity)")
    return manifest


def verify(path: str | Path, deep: bool = True) -> str | None:
    """None if the checkpoint is complete and every file matches its manifest, else why not.
    ``deep=False`` checks the manifest and the file sizes only (cheap; used when pruning)."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        return str(exc)
    for name, info in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != info["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, manifest says {info['bytes']} (truncated?)"
        if deep and file_sha256(file) != info["sha256"]:
            return f"{name} does not match its sha256 (corrupted or altered)"
    return None


def latest_good(root: str | Path, deep: bool = True) -> Path | None:
    """The newest checkpoint that verifies; every newer one that does not is skipped with a warning."""
    recover(root)
    for path in list_checkpoints(root):
        problem = verify(path, deep)
        if problem is None:
            return path
        warnings.warn(f"skipping checkpoint {path.name}: {problem}", CheckpointWarning, stacklevel=2)
    return None


def resume_point(root: str | Path, deep: bool = True, set_newer_aside: bool = True) -> Path | None:
    """Where a resume starts: the newest checkpoint that verifies, None in a folder without checkpoints.

    Refuses (one line, nothing changed) when there are checkpoints but none verifies: a resume from step
    0 would throw the run away, and its first save would prune what could not be read. When an older
    one verifies, the newer ones that do not are moved aside (``set_newer_aside``): the run will save
    those steps again.
    """
    recover(root)
    found, problems = list_checkpoints(root), []
    for path in found:
        problem = verify(path, deep)
        if problem is None:
            for skipped, why in problems if set_newer_aside else []:
                set_aside(root, skipped, why)
            return path
        problems.append((path, problem))
    if found:
        why = "; ".join(f"{p.name}: {problem}" for p, problem in problems[:3]) + ("; ..." if len(problems) > 3 else "")
        raise CheckpointError(f"--resume found {len(found)} checkpoint(s) in {root} and none of them verifies ({why}): "
                              f"nothing was changed; repair or move them, or start a new --checkpoint-dir")
    return None


# Published advisories against torch.load(weights_only=True) itself: (first fixed release, advisory).
WEIGHTS_ONLY_ADVISORIES = (
    ((2, 6), "GHSA-53q9-r3pm-6pq6 (CVE-2025-32434)"),  # torch <= 2.5.1: a crafted file runs code
    ((2, 10), "GHSA-63cw-57p8-fm3p (CVE-2026-24747)"),  # torch < 2.10: memory corruption, possible code execution
)


def weights_only_advisories(version: str | None = None) -> list[str]:
    """The advisories in :data:`WEIGHTS_ONLY_ADVISORIES` that affect ``version`` (default: this torch)."""
    numbers = re.findall(r"\d+", (version or torch.__version__).split("+")[0])
    release = tuple(int(n) for n in numbers[:2])
    return [name for fixed_in, name in WEIGHTS_ONLY_ADVISORIES if release < fixed_in]


def warn_if_advisories(stacklevel: int = 2) -> None:
    """One warning line before a ``weights_only`` load under a torch release with a known advisory."""
    if advisories := weights_only_advisories():
        warnings.warn(f"torch {torch.__version__} has known weights_only loading advisories ({', '.join(advisories)}): "
                      "load only checkpoints you wrote, or upgrade torch to 2.10 or newer", CheckpointWarning,
                      stacklevel=stacklevel)


def load(path: str | Path) -> dict:
    """Read a verified checkpoint as plain data. Refuses anything that is not tensors and containers."""
    path = Path(path)
    warn_if_advisories(stacklevel=3)
    problem = verify(path)
    if problem:
        raise CheckpointError(f"checkpoint {path.name} does not verify: {problem}")
    if not zipfile.is_zipfile(path / STATE_FILE):  # what torch.save writes; anything else is not ours
        raise CheckpointError(f"{path / STATE_FILE} is not a readable torch file (not the zip archive torch.save writes)")
    try:
        return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only load failed" not in str(exc).lower():
            raise CheckpointError(f"{path / STATE_FILE} is not a readable torch file ({_first_line(exc)})") from None
        lines = [ln.strip() for ln in str(exc).splitlines() if "Unpickler error" in ln]
        raise CheckpointError(
            f"refusing to load {path / STATE_FILE}: it holds objects other than tensors and plain "
            f"containers, and a checkpoint is data, not code ({lines[0] if lines else _first_line(exc)})"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise CheckpointError(f"{path / STATE_FILE} is not a readable torch file ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
