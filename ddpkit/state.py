"""Training state: what an exact resume needs, how it is captured and restored, and how a restore is checked.

Weights alone are not a recovery plan. An exact resume needs the model, the optimizer (Adam's
moments), the AMP scaler, the sampler position, **every rank's** RNG states, the step, the running
data hash, and enough identity (config digest, world size, global batch, torch version) to refuse an
incompatible restore.

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict`` / ``set_state_dict``): parameters are keyed by their fully qualified name
(``net.0.weight``, never DDP's ``module.net.0.weight`` nor an optimizer's parameter index), and the same
call gathers a full tensor from a sharded one (FSDP, ZeRO). So one code path serves a replicated
model today and sharded ones tomorrow, and a checkpoint does not depend on how the model was wrapped.

RNG states are stored as tensors and plain lists, so that the checkpoint loads with
``torch.load(weights_only=True)`` (``np.random.get_state()`` as-is does not). Each rank stores only
its own device's CUDA generator: asking for all of them would create a CUDA context on every GPU.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

import ddpkit
from ddpkit.checkpoint import CheckpointError, list_checkpoints
from ddpkit.config import TrainConfig

PROBE_RTOL = 1e-4  # a probe loss may differ this much after a restore on another device type
_SAVE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0 only
_LOAD = StateDictOptions(full_state_dict=True)  # every rank reads the full state it is given


def model_and_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        rank0_only: bool = True) -> tuple[dict, dict]:
    """Full model and optimizer state dicts keyed by parameter name (collective: every rank calls).
    ``rank0_only`` leaves the other ranks empty dicts (what a single writer needs)."""
    return get_state_dict(model, optimizer, options=_SAVE if rank0_only else StateDictOptions(full_state_dict=True))


def load_model_and_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                             model_state: dict, optimizer_state: dict | None) -> None:
    """Put full state dicts back into a (possibly wrapped) model and its optimizer. The dicts given are
    left as they were (``set_state_dict`` renames keys in place, e.g. adding DDP's ``module.``)."""
    model_state = dict(model_state)
    if optimizer is None:
        set_model_state_dict(model, model_state, options=_LOAD)
        return
    optimizer_state = {**optimizer_state, "state": dict(optimizer_state["state"]),
                       "param_groups": [dict(g) for g in optimizer_state["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=_LOAD)


def run_id() -> str | None:
    """The id torchrun gives a job (kept across its restarts), or None outside torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def meta(cfg: TrainConfig) -> dict:
    """The identity a checkpoint carries: enough to refuse a resume that would change training."""
    return {"run_id": run_id(), "config_digest": cfg.digest(), "semantics": cfg.semantics(), "world_size": cfg.world_size,
            "dp": cfg.dp, "global_batch_size": cfg.global_batch_size, "micro_batch_size": cfg.micro_batch_size,
            "grad_accum": cfg.grad_accum, "strategy": cfg.strategy, "torch_version": str(torch.__version__),
            "ddpkit_version": ddpkit.__version__}


# --------------------------------------------------------------------------- RNG states as data

def rng_state(device: torch.device | None = None) -> dict:
    """This process's RNG states in a form ``weights_only`` loading accepts (CUDA: this rank's device only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = [torch.cuda.get_rng_state(device)] if device is not None and device.type == "cuda" else []
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(_as_tuple(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"][0], device)


def gather_rng_states(device: torch.device) -> list[dict]:
    """Every rank's RNG states, on every rank (collective)."""
    mine = rng_state(device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=dist.group.WORLD)
    return everyone


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


# --------------------------------------------------------------------------- resume validation

def check_compatible(saved: dict, cfg: TrainConfig) -> None:
    """Refuse a resume that would silently change training; say what differs and how to fix it."""
    if saved["global_batch_size"] != cfg.global_batch_size:
        raise CheckpointError(
            f"checkpoint was trained with global batch {saved['global_batch_size']} "
            f"(micro {saved['micro_batch_size']} x accum {saved['grad_accum']} x world {saved.get('dp', saved['world_size'])}); "
            f"this run has {cfg.global_batch_size} (micro {cfg.micro_batch_size} x accum {cfg.grad_accum} "
            f"x world {cfg.dp}): keep micro x accum x world = {saved['global_batch_size']}"
        )
    if saved["config_digest"] != cfg.digest():
        ours = cfg.semantics()
        diffs = [f"{k}: {v!r} -> {ours.get(k)!r}" for k, v in sorted(saved["semantics"].items())
                 if ours.get(k) != v]
        raise CheckpointError(
            "resuming would change training (" + "; ".join(diffs) + "): use the checkpoint's values "
            "or start a new --checkpoint-dir"
        )


def torch_version_note(saved: dict) -> str | None:
    """A one-line warning when the checkpoint was written by another torch (same bits are not promised)."""
    theirs, ours = saved.get("torch_version"), str(torch.__version__)
    if theirs and theirs != ours:
        return (f"checkpoint written by torch {theirs}, resuming under torch {ours}: training continues "
                f"correctly, but not bitwise like an uninterrupted run")
    return None


REQUIRED = {"model": dict, "optimizer": dict, "sampler": dict, "rng": list, "meta": dict, "train": dict}
REQUIRED_TRAIN = ("step", "consumed_samples", "data_sha256")


def check_structure(saved: dict) -> None:
    """Refuse a checkpoint that lacks a part an exact resume reads (one line naming it, not a KeyError)."""
    missing = [k for k, kind in REQUIRED.items() if not isinstance(saved.get(k), kind)]
    missing += [f"train.{k}" for k in REQUIRED_TRAIN if isinstance(saved.get("train"), dict) and k not in saved["train"]]
    if missing:
        raise CheckpointError(f"this checkpoint lacks {', '.join(missing)}, which a resume needs: it was not written "
                              f"by this trainer; start from another checkpoint or a new --checkpoint-dir")


def check_saved(saved: dict, cfg: TrainConfig, expected_lr: float, saved_at_step: int | None = None,
                model_keys: set[str] | None = None, with_optimizer: bool = True) -> None:
    """Before a restore, refuse a state that would not continue the run it came from.

    Step (the folder's step is the state's), sampler progress (``consumed = step x global batch``),
    the model's parameters (the same names), optimizer state (present for every parameter, and as many
    optimizer steps as the run applied: ``train.applied_steps``, which the loss guard's skipped and
    rolled-back steps keep below the step count), scaler state (fp16), and the learning rate (the
    schedule's value at that step). ``with_optimizer=False`` skips the optimizer checks (a deliberate
    weights-only restore). Loss continuity is checked after loading: :func:`check_probe`.
    """
    train = saved["train"]
    step, consumed = train["step"], train["consumed_samples"]
    applied = train.get("applied_steps", step)  # written since the guard could skip steps; before, every step applied
    if saved_at_step is not None and step != saved_at_step:
        raise CheckpointError(f"checkpoint folder says step {saved_at_step} but its state is at step {step}: "
                              f"the files were mixed up; start from another checkpoint")
    if consumed != step * cfg.global_batch_size:
        raise CheckpointError(f"sampler position {consumed} != step {step} x global batch {cfg.global_batch_size}")
    if not 0 <= applied <= step:
        raise CheckpointError(f"checkpoint says {applied} of its {step} steps were applied: it is not a state this "
                              f"trainer wrote; start from another checkpoint")
    saved_keys = set(saved.get("model_names", saved["model"]))  # a dcp load fills only what this rank holds
    if model_keys is not None and saved_keys != model_keys:
        missing, extra = sorted(model_keys - saved_keys), sorted(saved_keys - model_keys)
        raise CheckpointError(f"checkpoint holds another model's parameters (missing {missing[:3]}, unexpected "
                              f"{extra[:3]}): resume with the config it was trained with")
    if cfg.amp == "fp16" and not saved.get("scaler"):
        raise CheckpointError("amp fp16 needs the GradScaler state, and the checkpoint has none")
    if not with_optimizer or applied == 0:
        return
    optimizer = saved["optimizer"]
    names = [name for group in optimizer["param_groups"] for name in group["params"]]
    if not all(isinstance(name, str) for name in names):
        raise CheckpointError(f"this checkpoint keys its optimizer state by parameter index (written by ddpkit "
                              f"{saved['meta'].get('ddpkit_version', '0.1')}); this version keys it by parameter "
                              f"name: start a new --checkpoint-dir")
    missing = [name for name in names if "step" not in optimizer["state"].get(name, {})]
    if missing or not names:
        raise CheckpointError(f"optimizer state is missing for {len(missing)} of {len(names)} parameters at step "
                              f"{step} (e.g. {missing[:2]}): these are not the saved moments")
    counts = {int(optimizer["state"][name]["step"]) for name in names}
    # fp16 may skip steps on overflow, so fewer optimizer steps than applied steps is legal there
    if max(counts) > applied or (cfg.amp != "fp16" and counts != {applied}):
        raise CheckpointError(f"optimizer state has taken {sorted(counts)} steps but the checkpoint applied {applied} "
                              f"of its {step} steps: it is not this run's optimizer state")
    saved_lr = optimizer["param_groups"][0]["lr"]
    if abs(saved_lr - expected_lr) > 1e-12 * max(1.0, expected_lr):
        raise CheckpointError(f"learning rate jumps: checkpoint's last lr {saved_lr} != schedule's {expected_lr}")


def check_probe(saved: dict, probe_loss: float) -> None:
    """After loading, the weights in memory must reproduce the probe batch's loss recorded at save:
    a manifest proves the bytes were not damaged; this proves they are the bytes that were trained."""
    saved_probe = saved["train"].get("probe_loss")
    if saved_probe is not None and abs(probe_loss - saved_probe) > PROBE_RTOL * max(1.0, abs(saved_probe)):
        raise CheckpointError(f"loss is not continuous: the probe batch's loss was {saved_probe:.6f} at save and "
                              f"is {probe_loss:.6f} after restore: these are not the saved weights")


def foreign_checkpoints_message(folder: str) -> str:
    """Why a run that does not resume refuses a folder that already holds checkpoints, and the fixes."""
    names = [p.name for p in list_checkpoints(folder)]
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (f"--checkpoint-dir {folder} already holds checkpoints ({shown}) of an earlier run: add --resume to "
            f"continue it, --overwrite-checkpoints to delete them, or choose an empty folder")
