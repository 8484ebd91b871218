"""Check for notebook 06's exercise: a checkpoint that a crash can never tear.

The contract: ``save_fn(state, root, step)`` writes checkpoint ``step`` of ``state`` (a dict of tensors
with an ``rng`` entry) under the folder ``root``; ``load_fn(root)`` returns ``(step, state)`` for the
newest checkpoint it trusts, or ``None`` when there is none. The check starts a writer process that
saves step after step and SIGKILLs it at random instants (a crash, the OOM killer, a preempted node),
then runs ``load_fn`` in a fresh process with a time limit. Each time, the loaded checkpoint must be the
last one whose save returned, or the one being written if it was complete; its tensors must be exactly
that step's; and its ``rng`` entry must have survived the round trip. The tensors' values come from a
seed drawn when the check runs and given to the writer alone: the loader can find them only on disk. The
writer reports each completed save to the grader on its own pipe (:mod:`ddpkit.exercises.channel`),
and the loader sends back the hash of what it loaded, compared by the grader.

What the writer really does to the disk is recorded too: every rename (from the ``os.rename`` audit
event, which every way of renaming raises) and every ``fsync`` (:func:`ddpkit.exercises.witness.watch_files`).
Every file renamed into place must have been forced to disk (``os.fsync`` of it, or ``os.sync``) before
the rename, or a power cut can leave the final name pointing at a file with no bytes.
"""

from __future__ import annotations

import hashlib
import os
import random
import secrets
import tempfile
import time

import torch

from ddpkit.exercises import Result, graded, learner

KILLS, NUMEL, LOAD_TIMEOUT_S = 12, 1 << 18, 20.0


def _state(step: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + step)
    return {"weights": torch.rand(NUMEL, generator=gen) + step, "moments": torch.rand(NUMEL // 2, generator=gen) - step,
            "rng": torch.randint(0, 2**31, (8,), generator=gen)}


def _digests(state: dict) -> dict:
    out = {}
    for key in ("weights", "moments", "rng"):
        value = state.get(key) if isinstance(state, dict) else None
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            out[key] = hashlib.sha256(str(t.dtype).encode() + bytes(t.view(torch.uint8).reshape(-1).numpy())).hexdigest()
        else:
            out[key] = None
    return out


def _save_one(save_fn, root: str, step: int, seed: int) -> bool:
    save_fn(_state(step, seed), root, step)
    return True


def _writer(save_fn, root: str, first: int, seed: int, progress) -> None:
    """Save step after step; after each save returns, tell the grader through ``progress`` (a closure the
    learner's code cannot reach). The process is killed: it never returns."""
    step = first
    while True:
        save_fn(_state(step, seed), root, step)
        progress(step)
        step += 1


def _loader(load_fn, root: str) -> dict:
    loaded = load_fn(root)
    if loaded is None:
        return {"none": True}
    step, state = loaded
    return {"step": int(step), "keys": sorted(str(k) for k in state)[:8] if isinstance(state, dict) else [],
            "digests": _digests(state)}


@graded("06_checkpoint", "checkpoint")
def check_checkpoint(save_fn, load_fn, kills: int = KILLS, seed: int | None = None) -> Result:
    """Kill the writer ``kills`` times at random instants; load after each (see the module docstring)."""
    from ddpkit.exercises import ranks, timing

    rng = random.Random(seed)
    secret = secrets.randbits(40)  # the tensors' seed: the writer's alone
    with tempfile.TemporaryDirectory(prefix="ddpkit-check-ckpt-") as work:
        root = os.path.join(work, "ckpt")
        try:
            learner.run(_save_one, save_fn, root, 1, secret) if not isinstance(save_fn, learner.LearnerRef) else \
                learner.call(_save_one, save_fn, root, 1, secret, watch_files=True)
        except NotImplementedError:
            return Result(False, "not implemented yet: write save_fn and load_fn between the markers")
        except learner.Raised as exc:
            return Result(False, exc.sentence("save_fn", 90) + " (on the first save)")
        last = 1
        for kill in range(kills):
            writer = ranks.spawn([learner.task(_writer, (save_fn, root, last + 1, secret), watch_files=True, progress=True)])
            deadline = time.monotonic() + rng.uniform(0.005, 0.15)
            while time.monotonic() < deadline:
                ranks.pump(writer, max(0.0, deadline - time.monotonic()))
            ranks.close(writer)  # SIGKILL, at that instant
            saved = [s for kind, s in writer[0].inbox.messages if kind == "progress"]
            if writer[0].error:
                if writer[0].error.get("type") == "NotImplementedError":
                    return Result(False, "not implemented yet: write save_fn and load_fn between the markers")
                return Result(False, f"save_fn raised {writer[0].error.get('type')} while saving step {last + 1}: "
                                     f"{learner.short(str(writer[0].error.get('message')), 80)}")
            last = max([last, *saved])
            try:
                report = learner.call(_loader, load_fn, root, timeout=LOAD_TIMEOUT_S * max(1.0, timing.collective_timeout() / timing.FLOOR_S))
            except NotImplementedError:
                return Result(False, "not implemented yet: write save_fn and load_fn between the markers")
            except learner.Raised as exc:
                if exc.type_name in ("hung", "too slow"):
                    return Result(False, f"after kill {kill + 1}, load_fn did not return in time: {learner.short(str(exc), 80)}")
                if exc.type_name == "died":
                    return Result(False, f"after kill {kill + 1}, the process running load_fn {learner.short(str(exc), 80)}")
                return Result(False, f"after a kill while step {last + 1} was being saved, load_fn raised "
                                     f"{exc.type_name}: a torn file under a final name? what does a reader see mid-write?")
            if report.get("none"):
                return Result(False, f"after a kill, load_fn found no checkpoint although step {last} had been saved")
            step = report.get("step")
            if step not in (last, last + 1):
                return Result(False, f"load_fn returned step {step!r:.12}, but step {last} was the last complete save: "
                                     f"return the newest complete checkpoint")
            want = _digests(_state(step, secret))
            got = report.get("digests") or {}
            if got.get("rng") != want["rng"]:
                return Result(False, f"checkpoint {step} loaded without its 'rng' entry intact: save the RNG state "
                                     f"with the checkpoint (the keys loaded: {', '.join(report.get('keys', []))[:60]})")
            if got.get("weights") != want["weights"] or got.get("moments") != want["moments"]:
                return Result(False, f"load_fn returned step {step} with tensors that are not that step's: a torn or "
                                     f"mixed checkpoint was loaded")
    session = learner.SESSION
    if session is not None:
        from ddpkit.exercises.witness import unsynced_renames

        if unsynced_renames(session.files):
            return Result(False, "a file was renamed into place before its bytes were forced to disk: after a "
                                 "power cut the final name could hold an empty file")
    return Result(True, f"{kills} kills at random instants of a save: every load returned the newest complete checkpoint, "
                        f"intact, with its rng" + (", each file forced to disk before its rename" if session else ""))
