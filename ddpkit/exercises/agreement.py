"""Check for notebook 14's exercise: the decision to save and stop, taken by every rank together.

The contract: ``should_stop(noticed: bool) -> bool``, called by every rank at the same step boundary;
``noticed`` is True on the ranks that got a preemption notice. Every rank must return the same answer:
True as soon as any rank noticed. A rank that decides alone enters a collective save that its peers
skip, and the job hangs. The check runs it on 2, 3 and 4 real ranks with the notice on no rank, on each
rank alone, and on all, in an order drawn when it runs; each rank is told only its own flag.
"""

from __future__ import annotations

import random

from ddpkit.exercises import Result, graded, run_on_ranks


def _on_rank(ctx, fn, flags: list[bool]) -> list[bool]:
    return [bool(fn(flag)) for flag in flags]


@graded("14_should_stop", "should_stop")
def check_should_stop(fn) -> Result:
    rng = random.SystemRandom()
    for world in (2, 3, 4):
        cases = [("no rank", set()), *((f"only rank {r}", {r}) for r in range(world)), ("every rank", set(range(world)))]
        rng.shuffle(cases)
        runs = run_on_ranks(getattr(fn, "__name__", "should_stop"), _on_rank, fn, world_size=world,
                            rank_args=[([rank in noticed for _, noticed in cases],) for rank in range(world)])
        if isinstance(runs, Result):
            return runs
        for k, (case, noticed) in enumerate(cases):
            answers = [run[k] for run in runs]
            if len(set(answers)) > 1:
                yes = [r for r, a in enumerate(answers) if a]
                return Result(False, f"on {world} ranks with the notice on {case}, rank{'s' if len(yes) > 1 else ''} "
                                     f"{', '.join(map(str, yes))} decided to stop and the others did not: a rank cannot "
                                     f"know its peers' flags without a collective")
            if answers[0] != bool(noticed):
                return Result(False, f"on {world} ranks with the notice on {case}, every rank answered {answers[0]}: "
                                     f"stop as soon as any rank noticed, and only then")
    return Result(True, "every rank takes the same decision on 2, 3 and 4 ranks, stopping as soon as any one noticed")
