"""Check for notebook 14's exercise: the decision to save and stop, taken by every rank together.

The contract: ``should_stop(noticed: bool) -> bool``, called by every rank at the same step boundary;
``noticed`` is True on the ranks that got a preemption notice. Every rank must return the same answer:
True as soon as any rank noticed. A rank that decides alone enters a collective save that its peers
skip, and the job hangs. The check runs it on 2, 3 and 4 real ranks with the notice on no rank, on each
rank alone, and on all.
"""

from __future__ import annotations

from ddpkit.exercises import Result, graded, run_on_ranks



def _on_rank(ctx, fn) -> list[bool]:
    world = ctx.world_size
    cases = [set(), *({r} for r in range(world)), set(range(world))]
    return [bool(fn(ctx.rank in noticed)) for noticed in cases]


@graded("14_should_stop", "should_stop")
def check_should_stop(fn) -> Result:
    for world in (2, 3, 4):
        runs = run_on_ranks(getattr(fn, "__name__", "should_stop"), _on_rank, fn, world_size=world)
        if isinstance(runs, Result):
            return runs
        cases = ["no rank", *(f"only rank {r}" for r in range(world)), "every rank"]
        for k, case in enumerate(cases):
            answers = [run[k] for run in runs]
            if len(set(answers)) > 1:
                yes = [r for r, a in enumerate(answers) if a]
                return Result(False, f"on {world} ranks with the notice on {case}, rank{'s' if len(yes) > 1 else ''} "
                                     f"{', '.join(map(str, yes))} decided to stop and the others did not: a rank cannot "
                                     f"know its peers' flags without a collective")
            if answers[0] != (k > 0):
                return Result(False, f"on {world} ranks with the notice on {case}, every rank answered {answers[0]}: "
                                     f"stop as soon as any rank noticed, and only then")
    return Result(True, "every rank takes the same decision on 2, 3 and 4 ranks, stopping as soon as any one noticed")
