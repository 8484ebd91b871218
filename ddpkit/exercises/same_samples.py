"""Check for notebook 20's second exercise: the silent-bug check that catches ranks fed the same samples.

The contract: ``fed_the_same(ids) -> bool``, called on every rank at once (inside the job's default process
group), with the sample ids this rank consumed. Return, on every rank, True when some sample id reached more
than one rank, False when the ranks' ids are disjoint. Nothing crashes when a sampler is not distributed:
data parallelism then averages N copies of one gradient, the loss still falls, and only a check like this
one notices (notebook 20, ``ddpkit/debug/silent.py``). A rank alone cannot tell: the ids must be compared
across ranks, and every rank must get the same answer, since what follows (stop, or raise) is collective.

The check runs it on real ranks (2, 3 and 4), with ids from real samplers and from layouts that catch the
usual shortcuts: every rank fed the whole dataset; torch's ``DistributedSampler`` with ``drop_last=False``,
which pads the last round by repeating the first samples (a few ids on two ranks); a partition with ranks
holding different numbers of ids; two ranks that share ids when the first rank shares none.
"""

from __future__ import annotations

from ddpkit.exercises import Result, graded, run_on_ranks

DATASET = 20  # samples in each case's dataset


def _distributed(rank: int, world: int, drop_last: bool) -> list[int]:
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(DATASET), num_replicas=world, rank=rank, shuffle=True, seed=3, drop_last=drop_last)
    return list(sampler)


def _cases(world: int) -> list[tuple[str, bool, list[list[int]]]]:
    """(what, the right answer, each rank's ids) for a world of ``world`` ranks."""
    cases = [
        ("torch's DistributedSampler, drop_last=True", False, [_distributed(r, world, True) for r in range(world)]),
        ("every rank fed the whole dataset", True, [list(range(DATASET))] * world),
        ("a partition with one more id on the first ranks", False,
         [list(range(r, DATASET + world - 1, world)) for r in range(world)]),
    ]
    if DATASET % world:  # padding repeats the first ids of the shuffle on the last ranks
        cases.append(("torch's DistributedSampler, drop_last=False, which pads", True,
                      [_distributed(r, world, False) for r in range(world)]))
    if world >= 3:
        shared = [list(range(r * 5, r * 5 + 5)) for r in range(world)]
        shared[2] = shared[1][:2] + shared[2][2:]  # ranks 1 and 2 share two ids; rank 0 shares none
        cases.append(("ranks 1 and 2 sharing two ids, rank 0 none", True, shared))
    return cases


def _on_rank(ctx, fn) -> list:
    answers = []
    for _, _, ids in _cases(ctx.world_size):
        answers.append(fn(list(ids[ctx.rank])))
    return answers


@graded("20_same_samples", "fed_the_same")
def check_fed_the_same(fn) -> Result:
    for world in (2, 3, 4):
        runs = run_on_ranks(getattr(fn, "__name__", "fed_the_same"), _on_rank, fn, world_size=world)
        if isinstance(runs, Result):
            return runs
        for k, (what, right, ids) in enumerate(_cases(world)):
            answers = [run[k] for run in runs]
            if any(not isinstance(a, bool) for a in answers):
                return Result(False, f"{what}: fed_the_same returned {answers[0]!r:.40} on rank 0; return True or False")
            if len(set(answers)) > 1:
                differ = [r for r, a in enumerate(answers) if a != answers[0]]
                return Result(False, f"{what} on {world} ranks: rank 0 answered {answers[0]} and rank {differ[0]} "
                                     f"{answers[differ[0]]}: every rank must get the same answer (gather to all, not to one)")
            got = answers[0]
            if got == right:
                continue
            if what.startswith("every rank fed"):
                return Result(False, f"every rank was fed the whole dataset and you answered False on {world} ranks: a rank "
                                     "alone sees no repeat, compare its ids with the other ranks'")
            if "pads" in what:
                return Result(False, f"{what}, on {world} ranks: the padding repeats a few ids on two ranks and you "
                                     "answered False: look for any id on two ranks, not only for whole copies")
            if "rank 0 none" in what:
                return Result(False, f"{what}, on {world} ranks: you answered False; comparing each rank with rank 0 "
                                     "misses a pair of other ranks: compare every rank with every other")
            if "one more id" in what:
                return Result(False, f"{what}, on {world} ranks: no id repeats and you answered True: ranks may hold "
                                     "different numbers of ids, compare the ids, not the counts")
            return Result(False, f"{what}, on {world} ranks: the ids are disjoint and you answered True")
    return Result(True, "the same answer on every rank, right in every case on 2, 3 and 4 real ranks: a whole dataset "
                        "per rank, DistributedSampler's padding, uneven shares, a pair of ranks other than rank 0")
