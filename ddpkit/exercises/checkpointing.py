"""Check for notebook 06's exercise: a checkpoint that a crash can never tear.

The contract: ``save_fn(state, root, step)`` writes checkpoint ``step`` of ``state`` (a dict of tensors
with an ``rng`` entry) under the folder ``root``; ``load_fn(root)`` returns ``(step, state)`` for the
newest checkpoint it trusts, or ``None`` when there is none. The check starts a writer process that
saves step after step and SIGKILLs it at random instants (a crash, the OOM killer, a preempted node),
then runs ``load_fn`` in a fresh child process with a time limit. Each time, the loaded checkpoint must
be the last one whose save returned, or the one being written if it was complete; its tensors must be
exactly that step's; and its ``rng`` entry must have survived the round trip. Inside the grader's
sandbox, what the writer really does to the disk is recorded too
(:func:`ddpkit.exercises.witness.install_file_witness`): every file renamed into place must have been
forced to disk (``os.fsync`` of it, or ``os.sync``) before the rename, or a power cut can leave the
final name pointing at a file with no bytes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import tempfile
import time

import torch

from ddpkit.exercises import Result, graded, in_sandbox

IN_SANDBOX = in_sandbox()

KILLS, NUMEL, LOAD_TIMEOUT_S = 12, 1 << 18, 20.0


def _state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"weights": torch.full((NUMEL,), float(step)), "moments": torch.full((NUMEL // 2,), -float(step)),
            "rng": torch.randint(0, 2**31, (8,), generator=gen)}


def _writer(save_fn, root: str, done_file: str, first: int, file_log: str) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (it would hang)
    from ddpkit.exercises.witness import FILE_LOG_ENV

    os.environ[FILE_LOG_ENV] = file_log
    step = first
    while True:
        save_fn(_state(step), root, step)
        with open(done_file, "a") as handle:  # appended after save_fn returned: "step is complete"
            handle.write(f"{step}\n")
            handle.flush()
        step += 1


def _loader(load_fn, root: str, out_file: str) -> None:
    torch.set_num_threads(1)
    try:
        loaded = load_fn(root)
        if loaded is None:
            report = {"none": True}
        else:
            step, state = loaded
            step = int(step)
            want = _state(step)
            report = {"step": step, "keys": sorted(state),
                      "intact": all(k in state and torch.equal(torch.as_tensor(state[k]), want[k]) for k in ("weights", "moments")),
                      "rng": "rng" in state and torch.equal(torch.as_tensor(state["rng"]), want["rng"])}
    except BaseException as exc:  # noqa: BLE001 - reported to the check as a sentence
        report = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
    with open(out_file, "w") as handle:
        json.dump(report, handle)


def _run(context, target, args, timeout: float) -> int | None:
    proc = context.Process(target=target, args=args)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return None
    return proc.exitcode


@graded("06_checkpoint", "checkpoint")
def check_checkpoint(save_fn, load_fn, kills: int = KILLS, seed: int = 0) -> Result:
    """Kill the writer ``kills`` times at random instants; load after each (see the module docstring)."""
    context = multiprocessing.get_context("fork")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="ddpkit-check-ckpt-") as work:
        root, done_file, out_file = os.path.join(work, "ckpt"), os.path.join(work, "done"), os.path.join(work, "loaded.json")
        file_log = os.path.join(work, "file-ops.log")
        open(done_file, "w").close()
        try:
            save_fn(_state(1), root, 1)
        except NotImplementedError:
            return Result(False, "not implemented yet: write save_fn and load_fn between the markers")
        except Exception as exc:  # noqa: BLE001
            return Result(False, f"save_fn raised {type(exc).__name__} on the first save: {_first_line(exc)}")
        with open(done_file, "a") as handle:
            handle.write("1\n")
        for kill in range(kills):
            completed = [int(x) for x in open(done_file).read().split()]
            writer = context.Process(target=_writer, args=(save_fn, root, done_file, completed[-1] + 1, file_log))
            writer.start()
            time.sleep(rng.uniform(0.005, 0.15))
            os.kill(writer.pid, signal.SIGKILL)
            writer.join()
            completed = [int(x) for x in open(done_file).read().split()]
            last = completed[-1]
            if os.path.exists(out_file):
                os.remove(out_file)
            code = _run(context, _loader, (load_fn, root, out_file), LOAD_TIMEOUT_S)
            if code is None:
                return Result(False, f"after kill {kill + 1}, load_fn did not return within {LOAD_TIMEOUT_S:g} s")
            if not os.path.exists(out_file):
                return Result(False, f"after kill {kill + 1}, the process running load_fn died (exit code {code})")
            report = json.load(open(out_file))
            if "error" in report:
                if report["error"].startswith("NotImplementedError"):
                    return Result(False, "not implemented yet: write save_fn and load_fn between the markers")
                return Result(False, f"after a kill while step {last + 1} was being saved, load_fn raised "
                                     f"{report['error'].split(':')[0]}: a torn file under a final name? what does a "
                                     f"reader see mid-write?")
            if report.get("none"):
                return Result(False, f"after a kill, load_fn found no checkpoint although step {last} had been saved")
            if not report["rng"]:
                return Result(False, f"checkpoint {report['step']} loaded without its 'rng' entry intact: save the RNG state "
                                     f"with the checkpoint (the keys loaded: {', '.join(report['keys'])})")
            if not report["intact"]:
                return Result(False, f"load_fn returned step {report['step']} with tensors that are not that step's: a torn or "
                                     f"mixed checkpoint was loaded")
            if report["step"] not in (last, last + 1):
                return Result(False, f"load_fn returned step {report['step']}, but step {last} was the last complete save: "
                                     f"return the newest complete checkpoint")
        if IN_SANDBOX and os.path.exists(file_log):
            from ddpkit.exercises.witness import unsynced_renames

            if unsynced_renames(file_log):
                return Result(False, "a file was renamed into place before its bytes were forced to disk: after a "
                                     "power cut the final name could hold an empty file")
    return Result(True, f"{kills} kills at random instants of a save: every load returned the newest complete checkpoint, "
                        f"intact, with its rng" + (", each file forced to disk before its rename" if IN_SANDBOX else ""))


def _first_line(exc: BaseException, limit: int = 100) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."
