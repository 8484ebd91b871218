"""Check for notebook 13's exercise: a 1F1B schedule generator.

The contract: ``one_f_one_b(p, m)`` returns, for each of ``p`` stages, its actions in order: tuples
``("F", micro)`` or ``("B", micro)`` for ``m`` micro-batches. The check runs each schedule on the clock of
``ddpkit.parallel.pipeline.simulate`` (a forward needs the previous stage's forward of that micro-batch, a
backward the next stage's backward and its own forward; it raises on a deadlock), and requires: every
micro-batch forward and backward exactly once per stage, no deadlock, the bubble (p-1)/(m+p-1), and at
most p - s micro-batches' activations held on stage s (what makes 1F1B better than GPipe). Some (p, m)
are fixed, some drawn when it runs, so no table of answers passes.
"""

from __future__ import annotations

import random

from ddpkit.exercises import Result, graded, learner, not_implemented
from ddpkit.parallel import pipeline

FIXED = ((2, 2), (2, 5), (3, 3), (4, 8), (4, 3), (5, 12))
DRAWN = 3


def cases(rng: random.Random | None = None) -> list[tuple[int, int]]:
    rng = rng or random.SystemRandom()
    drawn: list[tuple[int, int]] = []
    while len(drawn) < DRAWN:
        shape = (rng.randint(2, 6), rng.randint(1, 14))
        if shape not in FIXED and shape not in drawn:
            drawn.append(shape)
    return [*FIXED, *drawn]


def _orders(fn, shapes: list[tuple[int, int]]) -> list:
    """Every shape's orders as plain lists, computed in one call (in the learner's process)."""
    return [[[(str(kind), int(micro)) for kind, micro in stage] for stage in fn(p, m)] for p, m in shapes]


@graded("13_one_f_one_b", "one_f_one_b")
def check_one_f_one_b(fn) -> Result:
    shapes = cases()
    try:
        found = learner.call(_orders, fn, shapes) if isinstance(fn, learner.LearnerRef) else _orders(fn, shapes)
    except NotImplementedError:
        return not_implemented(getattr(fn, "__name__", "one_f_one_b"))
    except learner.Raised as exc:
        return Result(False, exc.sentence("one_f_one_b"))
    except Exception as exc:  # noqa: BLE001 - called here, outside the sandbox
        return Result(False, f"one_f_one_b raised {type(exc).__name__}: {learner.short(str(exc))}")
    for (p, m), orders in zip(shapes, found):
        if len(orders) != p:
            return Result(False, f"one_f_one_b({p}, {m}) gave {len(orders)} stages, not {p}")
        for s, order in enumerate(orders):
            wanted = sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            if sorted(tuple(a) for a in order) != wanted:
                return Result(False, f"with p={p}, m={m}, stage {s} does not run each micro-batch's forward and backward "
                                     f"exactly once")
        actions = [[pipeline.Action(kind, s, micro) for kind, micro in order] for s, order in enumerate(orders)]
        try:
            timeline = pipeline.simulate(actions)
        except ValueError as exc:
            return Result(False, f"with p={p}, m={m}: {learner.short(str(exc), 80)}: a stage waits for work that comes "
                                 f"after its own next action")
        bubble, predicted = pipeline.bubble(timeline), pipeline.predicted_bubble(p, m)
        if abs(bubble - predicted) > 1e-9:
            return Result(False, f"with p={p}, m={m} the bubble is {bubble:.3f}, not (p-1)/(m+p-1) = {predicted:.3f}: "
                                 f"a stage idles between its actions")
        for s in range(p):
            held = pipeline.in_flight(timeline, s)
            if held > p - s:
                return Result(False, f"with p={p}, m={m}, stage {s} holds {held} micro-batches' activations at once; 1F1B "
                                     f"holds at most p - s = {p - s}: how many forwards does stage {s} run before its "
                                     f"first backward?")
    return Result(True, f"dependencies respected, bubble (p-1)/(m+p-1) and at most p - s activations held, for "
                        f"{len(shapes)} (p, m), {DRAWN} of them drawn now")
