"""Check for notebook 17's exercise: one step of ring attention, the online-softmax merge of a key block.

The contract: ``attend_block(q, k, v, out, lse) -> (out, lse)``. ``q`` is this rank's queries (B, H, c, D);
``k`` and ``v`` are one block of keys and values (B, H, c, D) that the ring brought; ``out`` (B, H, c, D)
and ``lse`` (B, H, c) are the attention output and the log of the softmax denominator over the keys
merged so far, both None before the first block. Return them over the keys seen so far, this block
included (no causal mask: every query sees every key). ``out`` and ``lse`` are all the state there is.

The check runs a real ring on 2, 3 and 4 gloo ranks (its own ``batch_isend_irecv`` passes each K/V block
to the next rank) and calls the learner's step once per hop. It compares each rank's output and
log-sum-exp with full attention over the whole sequence (``torch.softmax`` of every score, in float64),
merges two query sets in turns (a step that keeps state of its own mixes them up), and feeds scores
near 100, where ``exp`` overflows float32 (past about 88.7): online softmax must stay finite there
(Milakov and Gimelshein, 2018, arXiv 1805.02867).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

WORLDS = (2, 3, 4)
B, H, C, D = 1, 2, 4, 8  # c positions per rank: the sequence is c x world long
TOL = 1e-4


def _tensors(world: int, scale: float):
    gen = torch.Generator().manual_seed(world)
    q = torch.randn(2, B, H, C * world, D, generator=gen) * scale  # two query sets: merged in turns
    k = torch.randn(B, H, C * world, D, generator=gen)
    v = torch.randn(B, H, C * world, D, generator=gen)
    return q, k, v


def _full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


def _hop(kv: torch.Tensor) -> torch.Tensor:
    """Send ``kv`` to the next rank and receive the previous rank's, paired in one batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    received = torch.empty_like(kv)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % world),
                                        dist.P2POp(dist.irecv, received, (rank - 1) % world)]):
        work.wait()
    return received


def _on_rank(ctx, fn, scale: float) -> dict:
    world, rank = ctx.world_size, ctx.rank
    q, k, v = _tensors(world, scale)
    mine = slice(rank * C, (rank + 1) * C)
    kv = torch.stack([k[..., mine, :], v[..., mine, :]]).contiguous()
    state = [(None, None), (None, None)]
    alone = (None, None)  # query set 0 again, merged with nothing in between
    for step in range(world):
        for s in (0, 1):
            got = fn(q[s][..., mine, :].clone(), kv[0].clone(), kv[1].clone(), *state[s])
            if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
                raise Wrong(f"attend_block returned {type(got).__name__}: return the pair (out, lse) as tensors")
            state[s] = tuple(t.detach().clone() for t in got)
        alone = tuple(t.detach().clone() for t in fn(q[0][..., mine, :].clone(), kv[0].clone(), kv[1].clone(), *alone))
        if step < world - 1:
            kv = _hop(kv)
    want = [_full(q[s][..., mine, :], k, v) for s in (0, 1)]
    out_err = max(float((state[s][0].double() - want[s][0]).abs().max()) for s in (0, 1))
    lse_err = max(float((state[s][1].double().reshape(want[s][1].shape) - want[s][1]).abs().max()) for s in (0, 1))
    return {"out": out_err, "lse": lse_err, "finite": all(bool(torch.isfinite(t).all()) for pair in state for t in pair),
            "alone": float((alone[0] - state[0][0]).abs().max())}


@graded("17_ring_attention_step", "attend_block")
def check_attend_block(fn) -> Result:
    name = getattr(fn, "__name__", "attend_block")
    for world in WORLDS:
        runs = run_on_ranks(name, _on_rank, fn, 1.0, world_size=world)
        if isinstance(runs, Result):
            return runs
        worst = max(runs, key=lambda r: (r["out"], r["lse"]))
        if not worst["finite"]:
            return Result(False, f"on {world} ranks with ordinary scores the output holds inf or NaN: look at what is "
                                 f"exponentiated, and at the first block (out and lse are None)")
        if max(r["alone"] for r in runs) > TOL:
            return Result(False, f"on {world} ranks one query set's result changed when another set's blocks were merged "
                                 f"in between: keep the state in out and lse only")
        if worst["out"] > TOL:
            return Result(False, f"on {world} ranks the output differs from full attention by {worst['out']:.2e} after "
                                 f"{world} blocks: each block's output was normalised by its own denominator; how much "
                                 f"of the total is each?")
        if worst["lse"] > TOL:
            return Result(False, f"on {world} ranks the output is right but lse differs from the log-sum-exp over every "
                                 f"key by {worst['lse']:.2e}: the next block's merge depends on it")
    runs = run_on_ranks(name, _on_rank, fn, 40.0, world_size=2)
    if isinstance(runs, Result):
        return runs
    if not all(r["finite"] for r in runs):
        return Result(False, "with scores near 100 the output holds inf or NaN: exp() of a float32 score overflows past "
                             "88.7; what can be factored out of every exponent?")
    if max(r["out"] for r in runs) > 1e-3:
        return Result(False, f"with scores near 100 the output differs from full attention by "
                             f"{max(r['out'] for r in runs):.2e}: look for precision lost in the exponentials")
    return Result(True, "full attention's output and log-sum-exp on 2, 3 and 4 ranks, two query sets kept apart, finite "
                        "with scores near 100")
