"""Check for notebook 02's exercise: a resumable distributed sampler.

The contract: ``cls(dataset_len, world_size, rank, global_batch_size, seed)``; ``set_consumed(n)`` sets the
position in global samples (a multiple of the global batch; the epoch follows from it); iterating gives
this rank's remaining indices of the current epoch; ``len()`` is how many that is. An epoch is
floor(N/G) x G samples. The check does not fix the layout (strided or blocked: each global batch is
compared as a set) nor the shuffle (the learner's, deterministic in seed and epoch).

It runs the sampler in every rank of a real job (a sampler that uses the process's global RNG, say,
shuffles differently on each rank and is caught), and checks, in order: complete and disjoint epochs,
every epoch training (not only the first), ``len``, determinism, a new order each epoch, a mid-epoch
resume, and the same global stream on another world size. The seed is drawn when it runs.
"""

from __future__ import annotations

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

N, G, EPOCHS = 100, 12, 3  # 100 samples, global batch 12: epochs of 96, 4 left out


def _epochs(cls, world_size: int, rank: int, seed: int) -> list[list[int]]:
    """This rank's indices for each epoch, asked the way a training loop asks: position, then iterate."""
    out = []
    for epoch in range(EPOCHS):
        sampler = cls(N, world_size, rank, G, seed)
        sampler.set_consumed(epoch * (N // G) * G)
        indices = [int(i) for i in iter(sampler)]
        if len(sampler) != len(indices):
            raise Wrong(f"rank {rank}: len(sampler) is {len(sampler)} but iterating gave {len(indices)} indices in epoch {epoch}")
        out.append(indices)
    return out


def _on_rank(ctx, cls, world_size: int, start: int, seed: int) -> dict:
    resumed = cls(N, world_size, ctx.rank, G, seed)
    resumed.set_consumed(start)
    return {"stream": _epochs(cls, world_size, ctx.rank, seed), "again": _epochs(cls, world_size, ctx.rank, seed),
            "other_seed": _epochs(cls, world_size, ctx.rank, seed + 1), "resumed": [int(i) for i in iter(resumed)]}


def _global_batches(per_rank: list[list[int]]) -> list[set[int]]:
    """Global batch k = every rank's k-th slice of G / world indices, as a set."""
    b = G // len(per_rank)
    return [set().union(*(r[k * b:(k + 1) * b] for r in per_rank)) for k in range(len(per_rank[0]) // b)]


def _check_world(runs: list[dict], world: int) -> list[list[set[int]]]:
    per_epoch = (N // G) * G
    batches = []
    for epoch in range(EPOCHS):
        seen: dict[int, int] = {}
        for rank, run in enumerate(runs):
            indices = run["stream"][epoch]
            for i in indices:
                if not 0 <= i < N:
                    raise Wrong(f"rank {rank} gave index {i} in epoch {epoch}, outside the dataset's 0..{N - 1}")
                if i in seen:
                    who = "twice" if seen[i] == rank else f"as rank {seen[i]} did"
                    raise Wrong(f"rank {rank} saw sample {i} {who} in epoch {epoch}: the ranks' shares must not overlap")
                seen[i] = rank
        if not seen:
            raise Wrong(f"epoch {epoch} trained 0 samples: only the first epoch trains (is the position taken modulo the epoch?)")
        if len(seen) != per_epoch:
            raise Wrong(f"epoch {epoch} covered {len(seen)} samples on {world} ranks, not {per_epoch} = floor({N}/{G}) x {G}")
        batches.append(_global_batches([run["stream"][epoch] for run in runs]))
    if any(run["again"] != run["stream"] for run in runs):
        raise Wrong("a second sampler with the same seed gave another order: the shuffle must not use the process's "
                    "global random state")
    if all(run["other_seed"][0] == run["stream"][0] for run in runs):
        raise Wrong("another seed gave the same order: the shuffle must depend on the seed it is given")
    if all(batches[e] == batches[0] for e in range(1, EPOCHS)):
        raise Wrong("every epoch has the same global batches: each epoch needs its own order")
    return batches


@graded("02_sampler", "sampler")
def check_sampler(cls) -> Result:
    """Check a ``ResumableDistributedSampler``-like class on 2 and 3 ranks (see the module docstring)."""
    import random

    start = G * 3  # resume after 3 global batches of epoch 0
    seed = random.SystemRandom().randrange(1, 2**20)
    streams = {}
    for world in (2, 3, 4):
        if G % world:
            continue
        runs = run_on_ranks(getattr(cls, "__name__", "the sampler"), _on_rank, cls, world, start, seed, world_size=world)
        if isinstance(runs, Result):
            return runs
        try:
            streams[world] = _check_world(runs, world)
            resumed = _global_batches([run["resumed"] for run in runs])
            if resumed != streams[world][0][3:]:
                raise Wrong(f"resumed at {start} samples (3 global batches) on {world} ranks, the rest of epoch 0 differs from "
                            f"the uninterrupted run's: iterate from the position set by set_consumed")
        except Wrong as exc:
            return Result(False, str(exc))
    if streams[3] != streams[2] or streams[4] != streams[2]:
        return Result(False, "3 or 4 ranks see other global batches than 2 ranks for the same seed: the order must not "
                             "depend on the number of ranks, only each rank's part of it")
    return Result(True, f"complete, disjoint and reshuffled epochs, resumable mid-epoch, the same global "
                        f"stream on 2, 3 and 4 ranks, another order for another seed ({EPOCHS} epochs of {(N // G) * G} samples)")
