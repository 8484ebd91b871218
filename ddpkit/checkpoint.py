"""The artifact plane: what survives a crash, and how we know it is intact.

Weights alone are not a recovery plan. An exact resume needs the model, the optimizer (Adam's
moments), the AMP scaler, the sampler position, **every rank's** RNG states, the step, the running
data hash, and enough identity (config digest, world size, global batch) to refuse an incompatible
restore. Storage is part of the algorithm:

* **Atomic**: everything is written into a temporary folder, fsynced, a ``manifest.json`` holding the
  sha256 of every file is written **last**, and only then is the folder renamed into place. A crash
  mid-write leaves a temporary folder that is never read; it cannot damage an older checkpoint.
* **Verified**: "latest" means the newest checkpoint whose manifest verifies. A torn or altered one is
  skipped with a warning and the previous good one is used. The last ``keep_last`` are kept.
* **Data, not code**: files are read with ``torch.load(weights_only=True)``, which refuses arbitrary
  pickled objects, so a malicious checkpoint cannot run code. RNG states are stored as tensors and
  plain lists so that they load that way (``np.random.get_state()`` as-is does not).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddpkit.config import TrainConfig

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
STEP_DIR = re.compile(r"^step-(\d{8})$")
PROBE_RTOL = 1e-4  # a probe loss may differ this much after a restore on another device type


class CheckpointError(RuntimeError):
    """A checkpoint that must not be used, or a resume that would change training."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (torn, corrupted, or incomplete)."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def step_of(path: str | Path) -> int:
    """The step a checkpoint folder is named for (``step-00000012`` -> 12)."""
    match = STEP_DIR.match(Path(path).name)
    if not match:
        raise CheckpointError(f"{path} is not a checkpoint folder (expected a name like step-00000012)")
    return int(match.group(1))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save(root: str | Path, step: int, state: dict, keep_last: int = 3, meta: dict | None = None) -> Path:
    """Write ``state`` as checkpoint ``step`` atomically; prune to the newest ``keep_last``. Rank 0 only."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(tmp / STATE_FILE, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    manifest = {"format": 1, "step": step, "created": time.time(), "meta": meta or {},
                "files": {STATE_FILE: {"sha256": file_sha256(tmp / STATE_FILE),
                                       "bytes": (tmp / STATE_FILE).stat().st_size}}}
    with open(tmp / MANIFEST, "w") as handle:  # written last: its presence means "complete"
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_dir(tmp)
    final = step_dir(root, step)
    if final.exists():  # re-saving a step after a restart: swap, never leave a gap without it
        old = root / f".old-step-{step:08d}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    prune(root, keep_last)
    return final


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints, and leftovers of interrupted saves."""
    for stale in [*root.glob(".tmp-step-*"), *root.glob(".old-step-*")]:  # one writer: all are dead
        shutil.rmtree(stale, ignore_errors=True)
    for path in list_checkpoints(root)[keep_last:]:
        shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders, newest step first (verified or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)


def verify(path: str | Path) -> str | None:
    """None if the checkpoint is complete and every file matches its manifest, else why not."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (an interrupted save)"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    for name, info in manifest.get("files", {}).items():
        file = path / name
        if not file.exists():
            return f"{name} is missing"
        if file.stat().st_size != info["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, manifest says {info['bytes']} (truncated?)"
        if file_sha256(file) != info["sha256"]:
            return f"{name} does not match its sha256 (corrupted or altered)"
    return None


def latest_good(root: str | Path) -> Path | None:
    """The newest checkpoint that verifies; every newer one that does not is skipped with a warning."""
    for path in list_checkpoints(root):
        problem = verify(path)
        if problem is None:
            return path
        warnings.warn(f"skipping checkpoint {path.name}: {problem}", CheckpointWarning, stacklevel=2)
    return None


def load(path: str | Path) -> dict:
    """Read a verified checkpoint as plain data. Refuses anything that is not tensors and containers."""
    path = Path(path)
    problem = verify(path)
    if problem:
        raise CheckpointError(f"checkpoint {path.name} does not verify: {problem}")
    try:
        return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if "Unpickler error" in ln]
        first = lines[0] if lines else str(exc).strip().splitlines()[0]
        raise CheckpointError(
            f"refusing to load {path / STATE_FILE}: it holds objects other than tensors and plain "
            f"containers, and a checkpoint is data, not code ({first})"
        ) from None


# --------------------------------------------------------------------------- RNG states as data

def rng_state() -> dict:
    """This process's RNG states in a form ``weights_only`` loading accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(_as_tuple(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


# --------------------------------------------------------------------------- resume validation

def check_compatible(meta: dict, cfg: TrainConfig) -> None:
    """Refuse a resume that would silently change training; say what differs and how to fix it."""
    if meta["global_batch_size"] != cfg.global_batch_size:
        raise CheckpointError(
            f"checkpoint was trained with global batch {meta['global_batch_size']} "
            f"(micro {meta['micro_batch_size']} x accum {meta['grad_accum']} x world {meta['world_size']}); "
            f"this run has {cfg.global_batch_size} (micro {cfg.micro_batch_size} x accum {cfg.grad_accum} "
            f"x world {cfg.world_size}): keep micro x accum x world = {meta['global_batch_size']}"
        )
    if meta["config_digest"] != cfg.digest():
        ours = cfg.semantics()
        diffs = [f"{k}: {v!r} -> {ours.get(k)!r}" for k, v in sorted(meta["semantics"].items())
                 if ours.get(k) != v]
        raise CheckpointError(
            "resuming would change training (" + "; ".join(diffs) + "): use the checkpoint's values "
            "or start a new --checkpoint-dir"
        )


def check_restored(state: dict, optimizer: torch.optim.Optimizer | None, cfg: TrainConfig, expected_lr: float,
                   saved_at_step: int | None = None, probe_loss: float | None = None) -> None:
    """After a restore, refuse a state that would not continue the run it came from.

    Step (the folder's step is the state's), sampler progress (``consumed = step x global batch``),
    optimizer state (present for every parameter, and as many optimizer steps as training steps),
    scaler state (fp16), learning rate (the schedule's value at that step), and loss continuity (the
    fixed probe batch's loss, recorded at save, is reproduced by the weights now in memory).
    ``optimizer=None`` skips the optimizer checks (a deliberate weights-only restore).
    """
    train = state["train"]
    step, consumed = train["step"], train["consumed_samples"]
    if saved_at_step is not None and step != saved_at_step:
        raise CheckpointError(f"checkpoint folder says step {saved_at_step} but its state is at step {step}: "
                              f"the files were mixed up; start from another checkpoint")
    if consumed != step * cfg.global_batch_size:
        raise CheckpointError(f"sampler position {consumed} != step {step} x global batch {cfg.global_batch_size}")
    if cfg.amp == "fp16" and not state.get("scaler"):
        raise CheckpointError("amp fp16 needs the GradScaler state, and the checkpoint has none")
    if optimizer is not None and step > 0:
        if len(optimizer.state) != sum(len(g["params"]) for g in optimizer.param_groups):
            raise CheckpointError(f"optimizer state is missing for some parameters at step {step}")
        counts = {int(s["step"]) for s in optimizer.state.values() if "step" in s}
        # fp16 may skip steps on overflow, so fewer optimizer steps than training steps is legal there
        if counts and (max(counts) > step or (cfg.amp != "fp16" and counts != {step})):
            raise CheckpointError(f"optimizer state has taken {sorted(counts)} steps but the checkpoint is at "
                                  f"step {step}: it is not this run's optimizer state")
        saved_lr = optimizer.param_groups[0]["lr"]
        if abs(saved_lr - expected_lr) > 1e-12 * max(1.0, expected_lr):
            raise CheckpointError(f"learning rate jumps: checkpoint's last lr {saved_lr} != schedule's {expected_lr}")
    saved_probe = train.get("probe_loss")
    if saved_probe is not None and probe_loss is not None \
            and abs(probe_loss - saved_probe) > PROBE_RTOL * max(1.0, abs(saved_probe)):
        raise CheckpointError(f"loss is not continuous: the probe batch's loss was {saved_probe:.6f} at save and "
                              f"is {probe_loss:.6f} after restore: these are not the saved weights")
