"""Timing lessons on a busy machine: repeat a paired measurement until its sign is sure, or say it is not.

A single timing on a shared 2-core machine can go either way: another process takes the core for a
time slice and one measurement doubles. Comparing medians of a few runs still flips now and then. The
honest test is a **sign test** on paired, interleaved measurements (each pair taken back to back, so
the load hits both alike): under "no effect" each pair is as likely to land above the threshold as
below it, so k of n pairs above has probability P(Binomial(n, 1/2) >= k). :func:`until_sure` keeps
sampling pairs until that probability (or its mirror) is below ``1 - confidence``: the verdict is then
``"above"`` or ``"below"``; if ``max_n`` pairs are not enough it is ``"unclear"``, and a lesson says
plainly that the effect is not visible on this machine at this load instead of failing at random.
"""

from __future__ import annotations

import math
from typing import Callable


def _tail(n: int, k: int) -> float:
    """P(Binomial(n, 1/2) >= k)."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n


def verdict(values: list[float], threshold: float, confidence: float = 0.99) -> str:
    """``"above"`` if the values are above ``threshold`` more often than chance allows at ``confidence``,
    ``"below"`` if below, else ``"unclear"`` (a one-sided sign test each way; ties count against both)."""
    n = len(values)
    above = sum(v > threshold for v in values)
    below = sum(v < threshold for v in values)
    if n and _tail(n, above) < 1 - confidence:
        return "above"
    if n and _tail(n, below) < 1 - confidence:
        return "below"
    return "unclear"


def until_sure(sample: Callable[[], float], threshold: float, min_n: int = 6, max_n: int = 30,
               confidence: float = 0.99) -> tuple[str, list[float]]:
    """Call ``sample()`` (one paired measurement, e.g. a ratio of two interleaved timings) until
    :func:`verdict` is sure, at least ``min_n`` and at most ``max_n`` times. Returns the verdict and the
    values."""
    values: list[float] = []
    while len(values) < max_n:
        values.append(sample())
        if len(values) >= min_n and verdict(values, threshold, confidence) != "unclear":
            break
    return verdict(values, threshold, confidence), values


def recompute_cost(model, tokens, threshold: float = 1.10, min_n: int = 6, max_n: int = 30, show=print,
                   repeats: int = 3) -> dict:
    """Notebook 10's timing lesson: what activation checkpointing costs in compute, sure of its sign.

Pairs of forward + backward of ``model`` on ``tokens`` (labels: the tokens themselves), one with
    ``model.activation_checkpointing`` on and one with it off, each arm run ``repeats`` times alternating
    with the other and timed by its fastest run (a run that lost the core to another process for a time
    slice says nothing about the arm), which arm starts alternating from pair to pair (on a busy machine
    the first of two calls can be slower). After each pair a forward alone is timed: one more forward of
    the blocks is what recomputation should add.
    :func:`until_sure` decides whether the ratio (with / without) is above ``threshold``. Returns the
    ``verdict``, the ``ratios``, and the ``plain_s`` and ``forward_s`` times. ``show`` gets a line per
    pair, so the cell is never silent for long. The switch is the mechanism: on a model that ignores it
    (the negative control) every ratio is about 1 and the verdict "below"."""
    import time

    import torch

    from ddpkit.models import loss_fn

    plain_s: list[float] = []
    forward_s: list[float] = []

    def timed(recompute: bool, forward_only: bool = False) -> float:
        model.activation_checkpointing = recompute
        started = time.perf_counter()
        if forward_only:
            with torch.no_grad():
                model(tokens)
        else:
            loss_fn(model(tokens), tokens).backward()
        seconds = time.perf_counter() - started
        model.zero_grad(set_to_none=True)
        return seconds

    def ratio() -> float:
        order = (False, True) if len(plain_s) % 2 == 0 else (True, False)
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for recompute in order:
                runs[recompute].append(timed(recompute))
        pair = {recompute: min(times) for recompute, times in runs.items()}
        forward_s.append(timed(False, forward_only=True))
        plain_s.append(pair[False])
        show(f"pair {len(plain_s)}: with recomputation {pair[True] / pair[False]:.2f}x the time")
        return pair[True] / pair[False]

    seen, ratios = until_sure(ratio, threshold, min_n=min_n, max_n=max_n)
    model.activation_checkpointing = False
    return {"verdict": seen, "ratios": ratios, "plain_s": plain_s, "forward_s": forward_s}
