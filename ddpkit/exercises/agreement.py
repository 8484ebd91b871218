"""Check for notebook 14's exercise: the decision to save and stop, taken by every rank together.

The contract: ``should_stop(noticed: bool) -> bool``, called by every rank at the same step boundary;
``noticed`` is True on the ranks that got a preemption notice. Every rank must return the same answer:
True as soon as any rank noticed. A rank that decides alone enters a collective save that its peers
skip, and the job hangs. The check runs it on 3 real ranks with the notice on no rank, on each rank
alone, and on all.
"""

from __future__ import annotations

from ddpkit.exercises import Result, graded, run_on_ranks

WORLD = 3


def _on_rank(ctx, fn) -> list[bool]:
    cases = [set(), *({r} for r in range(WORLD)), set(range(WORLD))]
    return [bool(fn(ctx.rank in noticed)) for noticed in cases]


@graded("14_should_stop", "should_stop")
def check_should_stop(fn) -> Result:
    runs = run_on_ranks(getattr(fn, "__name__", "should_stop"), _on_rank, fn, world_size=WORLD)
    if isinstance(runs, Result):
        return runs
    cases = ["no rank", *(f"only rank {r}" for r in range(WORLD)), "every rank"]
    for k, case in enumerate(cases):
        answers = [run[k] for run in runs]
        if len(set(answers)) > 1:
            yes = [r for r, a in enumerate(answers) if a]
            return Result(False, f"with the notice on {case}, rank{'s' if len(yes) > 1 else ''} {', '.join(map(str, yes))} "
                                 f"decided to stop and the others did not: all-reduce the flag (MAX) so every rank "
                                 f"takes the same decision")
        if answers[0] != (k > 0):
            return Result(False, f"with the notice on {case}, every rank answered {answers[0]}: stop as soon as any rank "
                                 f"noticed, and only then")
    return Result(True, f"every rank takes the same decision on {WORLD} ranks, stopping as soon as any one noticed")
