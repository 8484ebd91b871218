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
