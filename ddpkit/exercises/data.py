"""Check for notebook 02's exercise: a resumable distributed sampler.

The contract: ``cls(dataset_len, world_size, rank, global_batch_size, seed)``; ``set_consumed(n)`` sets the
position in global samples (a multiple of the global batch; the epoch follows from it); iterating gives
this rank's remaining indices of the current epoch; ``len()`` is how many that is. An epoch is
floor(N/G) x G samples: the N mod G left out are the shuffle's choice, so they change with the epoch and
no sample is left out for ever. The check does not fix the layout (strided or blocked: each global
batch is compared as a set) nor the shuffle (the learner's, deterministic in seed and epoch).

It runs the sampler in every rank of a real job (a sampler that uses the process's global RNG, say,
shuffles differently on each rank and is caught), on 2, 3 and 4 ranks, with the dataset's length N, the
global batch G, the seed and the resume point drawn when it runs, and checks, in order: complete and
disjoint epochs, every epoch training (not only the first), ``len``, determinism, another order for
another seed, a new order each epoch, every sample trained at least once in ``EPOCHS`` epochs, a
resume mid-epoch, and the same global stream on every world size. A shuffle of all N samples misses a
given sample in every one of those epochs with probability (N mod G / N) ** EPOCHS: N and G are drawn
so that this stays below 1e-8 for the whole dataset (N mod G <= G/3, N > 4G).
"""

from __future__ import annotations

import random

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

EPOCHS = 10  # over this many epochs every sample must have been trained at least once
WORLDS = (2, 3, 4)  # every one divides every global batch drawn


def draw(rng: random.Random) -> dict:
    """The sizes, the seed and the resume point for one check: G in {12, 24}, 4 to 7 global batches per epoch,
    1 to G/3 samples left out of each epoch; the resume point one to k-1 batches into a drawn epoch."""
    batch = rng.choice((12, 24))
    per_epoch_batches = rng.randint(4, 7)
    n = batch * per_epoch_batches + rng.randint(1, batch // 3)
    return {"n": n, "batch": batch, "seed": rng.randrange(1, 2**20),
            "resume_epoch": rng.randrange(EPOCHS), "resume_batches": rng.randint(1, per_epoch_batches - 1)}


def _epochs(cls, sizes: dict, world_size: int, rank: int, seed: int, epochs: int) -> list[list[int]]:
    """This rank's indices for each epoch, asked the way a training loop asks: position, then iterate."""
    n, batch = sizes["n"], sizes["batch"]
    out = []
    for epoch in range(epochs):
        sampler = cls(n, world_size, rank, batch, seed)
        sampler.set_consumed(epoch * (n // batch) * batch)
        indices = [int(i) for i in iter(sampler)]
        if len(sampler) != len(indices):
            raise Wrong(f"rank {rank}: len(sampler) is {len(sampler)} but iterating gave {len(indices)} indices in epoch {epoch}")
        out.append(indices)
    return out


def _on_rank(ctx, cls, sizes: dict, world_size: int) -> dict:
    seed = sizes["seed"]
    resumed = cls(sizes["n"], world_size, ctx.rank, sizes["batch"], seed)
    resumed.set_consumed(_start(sizes))
    return {"stream": _epochs(cls, sizes, world_size, ctx.rank, seed, EPOCHS),
            "again": _epochs(cls, sizes, world_size, ctx.rank, seed, 2),
            "other_seed": _epochs(cls, sizes, world_size, ctx.rank, seed + 1, 1),
            "resumed": [int(i) for i in iter(resumed)]}


def _start(sizes: dict) -> int:
    per_epoch = (sizes["n"] // sizes["batch"]) * sizes["batch"]
    return sizes["resume_epoch"] * per_epoch + sizes["resume_batches"] * sizes["batch"]


def _global_batches(per_rank: list[list[int]], batch: int) -> list[set[int]]:
    """Global batch k = every rank's k-th slice of G / world indices, as a set."""
    b = batch // len(per_rank)
    return [set().union(*(r[k * b:(k + 1) * b] for r in per_rank)) for k in range(len(per_rank[0]) // b)]


def _check_world(runs: list[dict], world: int, sizes: dict) -> list[list[set[int]]]:
    n, batch = sizes["n"], sizes["batch"]
    per_epoch = (n // batch) * batch
    batches, trained = [], set()
    for epoch in range(EPOCHS):
        seen: dict[int, int] = {}
        for rank, run in enumerate(runs):
            indices = run["stream"][epoch]
            for i in indices:
                if not 0 <= i < n:
                    raise Wrong(f"rank {rank} gave index {i} in epoch {epoch}, outside the dataset's 0..{n - 1}")
                if i in seen:
                    who = "twice" if seen[i] == rank else f"as rank {seen[i]} did"
                    raise Wrong(f"rank {rank} saw sample {i} {who} in epoch {epoch}: the ranks' shares must not overlap")
                seen[i] = rank
        if not seen:
            raise Wrong(f"epoch {epoch} trained 0 samples: only the first epoch trains (is the position taken modulo the epoch?)")
        if len(seen) != per_epoch:
            raise Wrong(f"epoch {epoch} covered {len(seen)} samples on {world} ranks, not {per_epoch} = floor({n}/{batch}) x {batch}")
        trained |= set(seen)
        batches.append(_global_batches([run["stream"][epoch] for run in runs], batch))
    if any(run["again"] != run["stream"][:2] for run in runs):
        raise Wrong("a second sampler with the same seed gave another order: the shuffle must not use the process's "
                    "global random state")
    if all(run["other_seed"][0] == run["stream"][0] for run in runs):
        raise Wrong("another seed gave the same order: the shuffle must depend on the seed it is given")
    if all(batches[e] == batches[0] for e in range(1, EPOCHS)):
        raise Wrong("every epoch has the same global batches: each epoch needs its own order")
    never = sorted(set(range(n)) - trained)
    if never:
        raise Wrong(f"over {EPOCHS} epochs of {per_epoch} of the {n} samples, {len(never)} (e.g. sample {never[-1]}) were "
                    f"never trained: which samples may an epoch leave out, and does that change with the epoch?")
    return batches


@graded("02_sampler", "sampler")
def check_sampler(cls) -> Result:
    """Check a ``ResumableDistributedSampler``-like class on 2, 3 and 4 ranks (see the module docstring)."""
    sizes = draw(random.SystemRandom())
    n, batch = sizes["n"], sizes["batch"]
    streams = {}
    for world in WORLDS:
        runs = run_on_ranks(getattr(cls, "__name__", "the sampler"), _on_rank, cls, sizes, world, world_size=world)
        if isinstance(runs, Result):
            return runs
        try:
            streams[world] = _check_world(runs, world, sizes)
            resumed = _global_batches([run["resumed"] for run in runs], batch)
            epoch, done = sizes["resume_epoch"], sizes["resume_batches"]
            if resumed != streams[world][epoch][done:]:
                batches_done = f"{done} global batch{'es' if done > 1 else ''}"
                raise Wrong(f"resumed at {_start(sizes)} samples ({batches_done} into epoch {epoch}) on {world} "
                            f"ranks, the rest of the epoch differs from the uninterrupted run's: iterate from the "
                            f"position set by set_consumed")
        except Wrong as exc:
            return Result(False, str(exc))
    if any(streams[w] != streams[WORLDS[0]] for w in WORLDS[1:]):
        return Result(False, "3 or 4 ranks see other global batches than 2 ranks for the same seed: the order must not "
                             "depend on the number of ranks, only each rank's part of it")
    return Result(True, f"complete, disjoint and reshuffled epochs, every sample trained in {EPOCHS} epochs, resumable "
                        f"mid-epoch, the same stream on 2, 3 and 4 ranks, another order for another seed (N={n}, G={batch})")
