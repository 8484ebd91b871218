"""Check for notebook 13's second exercise: one rank's order in an interleaved 1F1B schedule.

The contract: ``interleaved_order(rank, p, v, m)`` returns the actions of ``rank`` in order, as tuples
``("F", chunk, micro)`` or ``("B", chunk, micro)``, for ``p`` ranks that each hold ``v`` virtual stages
(chunks: rank r holds chunks r, r + p, ..., r + (v - 1) p of the model's p v) and ``m`` micro-batches.

The check asks it for every rank of several (p, v, m) shapes, some fixed and some drawn when it runs (so
no table of answers can pass), and requires for each shape:

1. each rank runs the forward and the backward of each of its chunks for every micro-batch, once;
2. the ranks' orders run to the end on the clock of
   :func:`ddpkit.parallel.pipeline_schedules.simulate` (a forward needs the previous chunk's forward of
   its micro-batch, a backward its own forward and the next chunk's backward; a deadlock is refused);
3. the bubble is Narayanan et al.'s (p - 1) / (v m) of the ideal compute time (their section 2.2.2);
4. the order is the one torch's own ``ScheduleInterleaved1F1B`` gives that rank (read from the class's
   per-rank generator, :func:`ddpkit.parallel.pipeline_schedules.torch_order`); an order with the same
   bubble that holds more activations (a warm-up longer than needed) is told so.

Before the clock, the orders of the 2-rank shapes are run for real on 2 gloo ranks
(:mod:`ddpkit.exercises.schedule_run`): every forward and backward a real chunk, every activation and
gradient a tagged message. An order that deadlocks hangs there (both ranks idle: given up on within
seconds) and the clock's reading of it names why; an order that runs must give every chunk the whole
model's gradients.

A wrong order gets one sentence that names what went wrong, not the order to write: a warm-up too short
for the micro-batch to come back, backwards that leave the rank's chunks in the wrong order, or the idle
time the order costs.
"""

from __future__ import annotations

import random

from ddpkit.exercises import Result, graded, learner, not_implemented, run_on_ranks, schedule_run
from ddpkit.parallel import pipeline_schedules as schedules
from ddpkit.parallel.pipeline import Action

FIXED = ((2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 3, 10))  # m = 10 on 4 ranks: two rounds of 5, not of p
DRAWN = 3


def shapes(rng: random.Random | None = None) -> list[tuple[int, int, int]]:
    """The fixed shapes, then ``DRAWN`` more drawn now: p ranks, v chunks each, m >= p micro-batches that
    split into rounds as torch's schedule requires (m a multiple of max(1, m // p))."""
    rng = rng or random.SystemRandom()
    drawn: list[tuple[int, int, int]] = []
    while len(drawn) < DRAWN:
        p, v = rng.randint(2, 5), rng.randint(2, 4)
        m = rng.randint(p, 3 * p)
        if m % max(1, m // p) == 0 and (p, v, m) not in FIXED + tuple(drawn):
            drawn.append((p, v, m))
    return [*FIXED, *drawn]


def _shape(p: int, v: int, m: int) -> str:
    return f"with p={p}, v={v}, m={m}"


def _orders(fn, shapes: list[tuple[int, int, int]]) -> list:
    """Every rank's order for every shape, as plain tuples (one call, in the learner's process)."""
    return [[[(str(kind), int(chunk), int(micro)) for kind, chunk, micro in fn(r, p, v, m)] for r in range(p)]
            for p, v, m in shapes]


def _for_real(cases: list, found: list) -> tuple[tuple, str] | None:
    """Run the 2-rank shapes' orders on 2 gloo ranks; the shape and what went wrong, or None."""
    import secrets

    import torch

    picked = [(shape, orders) for shape, orders in zip(cases, found) if shape[0] == 2]
    if not picked:
        return None
    seed = secrets.randbits(31)
    shapes = [shape for shape, _ in picked]
    runs = run_on_ranks("interleaved_order", schedule_run.run, shapes, [orders for _, orders in picked], seed,
                        world_size=2, idle_after=1.5)
    if isinstance(runs, Result):
        return shapes[0], runs.message
    for k, (p, v, m) in enumerate(shapes):
        want = schedule_run.expected_grads(p, v, m, seed)
        for rank, run in enumerate(runs):
            for chunk, grads in run[k].items():
                if any(g is None or not torch.allclose(g, w, atol=1e-5) for g, w in zip(grads, want[chunk])):
                    return (p, v, m), f"run for real on 2 ranks, chunk {chunk}'s gradient differs from the whole model's"
    return None


def _complete(order: list[tuple[str, int, int]], rank: int, p: int, v: int, m: int) -> str | None:
    chunks = [rank + j * p for j in range(v)]
    wanted = sorted((kind, c, i) for kind in "FB" for c in chunks for i in range(m))
    if sorted(order) == wanted:
        return None
    ran = sorted({c for _, c, _ in order})
    if set(ran) != set(chunks):
        return (f"{_shape(p, v, m)} rank {rank} runs chunks {ran}, but it holds {chunks}: every one of them runs each "
                f"micro-batch's forward and backward")
    counts: dict[tuple[str, int, int], int] = {}
    for action in order:
        counts[action] = counts.get(action, 0) + 1
    for kind, chunk, micro in sorted(set(order) | set(wanted), key=lambda a: (a[2], a[0] == "B", a[1])):
        got, want = counts.get((kind, chunk, micro), 0), int((kind, chunk, micro) in wanted)
        if got != want:
            return (f"{_shape(p, v, m)} rank {rank} runs the {'forward' if kind == 'F' else 'backward'} of micro-batch "
                    f"{micro} on chunk {chunk} {got} time(s), not {want}: each of its chunks runs each micro-batch once")
    return f"{_shape(p, v, m)} rank {rank} does not run each forward and backward of its chunks exactly once"


def _deadlock(orders: list[list[tuple[str, int, int]]], p: int, v: int, m: int) -> str:
    """What a deadlocked order shows: a first backward on the wrong chunk, or too few forwards before it."""
    last = {r: r + (v - 1) * p for r in range(p)}
    for r, order in enumerate(orders):
        first_b = next(k for k, a in enumerate(order) if a[0] == "B")
        kind, chunk, micro = order[first_b]
        if chunk != last[r]:
            return (f"{_shape(p, v, m)} the ranks deadlock: rank {r}'s first backward is on chunk {chunk}, whose gradient "
                    f"needs that of chunk {chunk + p}, which runs later")
    for r, order in enumerate(orders):
        first_b = next(k for k, a in enumerate(order) if a[0] == "B")
        needed = _forwards_before_first_backward(r, p, v, m)
        if first_b < needed:
            return (f"{_shape(p, v, m)} the ranks deadlock after rank {r}'s {first_b} forwards before its first "
                    f"backward: can every later chunk stay busy until micro-batch 0's gradient comes back?")
    return f"{_shape(p, v, m)} the ranks deadlock: each waits for work that another rank's order puts later"


def _forwards_before_first_backward(rank: int, p: int, v: int, m: int) -> int:
    """How many forwards torch's order runs on ``rank`` before its first backward (for the diagnosis only)."""
    order = schedules.torch_order("interleaved", p, m, v)[rank]
    return next(k for k, a in enumerate(order) if a.kind == "B")


@graded("13b_interleaved_order", "interleaved_order")
def check_interleaved_order(fn) -> Result:
    cases = shapes()
    try:
        found = learner.call(_orders, fn, cases) if isinstance(fn, learner.LearnerRef) else _orders(fn, cases)
    except NotImplementedError:
        return not_implemented(getattr(fn, "__name__", "interleaved_order"))
    except learner.Raised as exc:
        return Result(False, exc.sentence("interleaved_order"))
    except Exception as exc:  # noqa: BLE001 - called here, outside the sandbox
        return Result(False, f"interleaved_order raised {type(exc).__name__}: {learner.short(str(exc))}")
    for (p, v, m), orders in zip(cases, found):
        for r, order in enumerate(orders):
            wrong = _complete([tuple(a) for a in order], r, p, v, m)
            if wrong:
                return Result(False, wrong)
    failed = _for_real(cases, found)
    if failed is not None:
        (p, v, m), why = failed
        orders = [[tuple(a) for a in order] for order in found[cases.index((p, v, m))]]
        try:
            schedules.simulate([[Action(*a) for a in order] for order in orders])
        except ValueError:
            return Result(False, _deadlock(orders, p, v, m))  # the clock says why it hung
        return Result(False, f"{_shape(p, v, m)} {why}")
    for (p, v, m), orders in zip(cases, found):
        orders = [[tuple(a) for a in order] for order in orders]
        try:
            timeline = schedules.simulate([[Action(*a) for a in order] for order in orders])
        except ValueError:
            return Result(False, _deadlock(orders, p, v, m))
        bubble, predicted = schedules.bubble_over_ideal(timeline), schedules.megatron_bubble(p, m, v)
        if abs(bubble - predicted) > 1e-9:
            return Result(False, f"{_shape(p, v, m)} the ranks idle {bubble:.3f} of the ideal compute time, not "
                                 f"(p-1)/(v m) = {predicted:.3f}: some rank waits for input its order could have had sooner")
        torch_orders = schedules.torch_order("interleaved", p, m, v)
        for r, order in enumerate(orders):
            theirs = [(a.kind, a.stage, a.micro) for a in torch_orders[r]]
            if order != theirs:
                k = next(k for k, (a, b) in enumerate(zip(order, theirs)) if a != b)
                kind, chunk, micro = order[k]
                mine, torchs = schedules.held(timeline, r, v), schedules.held(schedules.simulate(torch_orders), r, v)
                if mine > torchs:
                    return Result(False, f"{_shape(p, v, m)} rank {r} holds {mine:g} micro-batches' activations at once, "
                                         f"ScheduleInterleaved1F1B's order {torchs:g}: same bubble, more memory")
                return Result(False, f"{_shape(p, v, m)} rank {r}'s step {k} ({kind} of micro-batch {micro} on chunk "
                                     f"{chunk}) is not ScheduleInterleaved1F1B's: same bubble, another order")
    return Result(True, f"torch's ScheduleInterleaved1F1B order on every rank and the bubble (p-1)/(v m), for "
                        f"{len(cases)} (p, v, m) shapes, {DRAWN} of them drawn now")
