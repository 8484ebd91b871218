"""The comparisons the lessons assert, written once so that their negative controls run the same code.

A lesson proves a mechanism by a comparison that would fail without it: DDP against one process,
a resumed run against an uninterrupted one, a split model against the whole. Each comparison here
takes the runs' summaries (what :func:`ddpkit.train.run` returns) and gives back what it found and an
``ok`` verdict; a notebook asserts ``ok`` and prints the rest. ``tests/test_negative_controls_advanced.py``
calls the same function on a run with the mechanism taken out (no averaging, a sampler over the
wrong ranks, a per-rank data position, a restore without the optimizer, ...) and shows ``ok`` false.
A check that also passes without its mechanism teaches nothing (CS336's DDP tests compare against a
reference in the same spirit).
"""

from __future__ import annotations

import math


def _loss_gap(reference: dict, run: dict) -> tuple[float, int]:
    """Largest |loss difference| over the steps both runs logged (a NaN counts as infinitely far), and
    how many steps that was. Steps are matched by number, so a resumed run is compared on the steps it ran."""
    by_step = {entry["step"]: entry["loss"] for entry in reference["losses"]}
    pairs = [(by_step[entry["step"]], entry["loss"]) for entry in run["losses"] if entry["step"] in by_step]
    gaps = [abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf for a, b in pairs]
    return max(gaps, default=math.inf), len(pairs)


def same_training(reference: dict, run: dict, tol: float, bitwise: bool = False) -> dict:
    """Did ``run`` train what ``reference`` trained? The same global samples (``data_sha256``: every step's
    sorted sample ids), the same global loss at every step both logged within ``tol`` (sums in another
    order differ in the last bits), and, with ``bitwise``, the same final weights bit for bit
    (``param_sha256``). Returns ``same_data``, ``max_loss_gap``, ``steps_compared``, ``same_weights`` and ``ok``."""
    gap, compared = _loss_gap(reference, run)
    same_data = run["data_sha256"] == reference["data_sha256"]
    same_weights = run["param_sha256"] == reference["param_sha256"]
    ok = compared > 0 and same_data and gap <= tol and (same_weights or not bitwise)
    return {"same_data": same_data, "max_loss_gap": gap, "steps_compared": compared, "same_weights": same_weights,
            "ok": bool(ok)}


def same_state(reference: dict, run: dict, keys: tuple[str, ...] = ("param_sha256", "optimizer_sha256", "data_sha256")) -> dict:
    """An exact resume: ``run`` (resumed) ends with ``reference``'s (uninterrupted) weights, optimizer state
    and sample stream, hash for hash, and logged the very same losses on the steps it ran. Returns each
    key's equality, ``same_losses`` and ``ok``."""
    by_step = {entry["step"]: entry["loss"] for entry in reference["losses"]}
    same_losses = bool(run["losses"]) and all(by_step.get(entry["step"]) == entry["loss"] for entry in run["losses"])
    equal = {key: run[key] == reference[key] for key in keys}
    return {**equal, "same_losses": same_losses, "ok": all(equal.values()) and same_losses}
