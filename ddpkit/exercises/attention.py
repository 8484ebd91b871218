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
(Milakov and Gimelshein, 2018, arXiv 1805.02867). The tensors are drawn when it runs; a rank holds its
queries and its own key/value block, and the comparison is made by the grader, outside the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

WORLDS = (2, 3, 4)
B, H, C, D = 1, 2, 4, 8  # c positions per rank: the sequence is c x world long
TOL = 1e-4


def _tensors(world: int, scale: float):
    import secrets

    gen = torch.Generator().manual_seed(secrets.randbits(62))
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


def _on_rank(ctx, fn, q_mine: torch.Tensor, kv: torch.Tensor) -> dict:
    """``q_mine``: this rank's two query sets (2, B, H, c, D); ``kv``: its own key/value block (2, B, H, c, D)."""
    world = ctx.world_size
    state = [(None, None), (None, None)]
    alone = (None, None)  # query set 0 again, merged with nothing in between
    for step in range(world):
        for s in (0, 1):
            got = fn(q_mine[s].clone(), kv[0].clone(), kv[1].clone(), *state[s])
            if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
                raise Wrong(f"attend_block returned {type(got).__name__}: return the pair (out, lse) as tensors")
            state[s] = tuple(t.detach().clone() for t in got)
        alone = tuple(t.detach().clone() for t in fn(q_mine[0].clone(), kv[0].clone(), kv[1].clone(), *alone))
        if step < world - 1:
            kv = _hop(kv)
    return {"out": [state[s][0] for s in (0, 1)], "lse": [state[s][1] for s in (0, 1)], "alone": alone[0]}


def _errors(runs: list[dict], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """The worst differences from full attention over every rank and query set, and whether all is finite."""
    out_err = lse_err = alone_err = 0.0
    finite = True
    for rank, run in enumerate(runs):
        mine = slice(rank * C, (rank + 1) * C)
        for s in (0, 1):
            want_out, want_lse = _full(q[s][..., mine, :], k, v)
            out, lse = run["out"][s], run["lse"][s]
            if not (isinstance(out, torch.Tensor) and out.shape == want_out.shape and isinstance(lse, torch.Tensor)
                    and lse.numel() == want_lse.numel()):
                return {"out": float("inf"), "lse": float("inf"), "alone": 0.0, "finite": True}
            finite = finite and bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
            out_err = max(out_err, float((out.double() - want_out).abs().max()))
            lse_err = max(lse_err, float((lse.double().reshape(want_lse.shape) - want_lse).abs().max()))
        alone = run["alone"]
        alone_err = max(alone_err, float((alone - run["out"][0]).abs().max()) if isinstance(alone, torch.Tensor)
                        and alone.shape == run["out"][0].shape else float("inf"))
    return {"out": out_err, "lse": lse_err, "alone": alone_err, "finite": finite}


def _run(name: str, fn, world: int, scale: float) -> dict | Result:
    q, k, v = _tensors(world, scale)
    blocks = [slice(r * C, (r + 1) * C) for r in range(world)]
    runs = run_on_ranks(name, _on_rank, fn, world_size=world,
                        rank_args=[(q[..., blocks[r], :].clone(), torch.stack([k[..., blocks[r], :], v[..., blocks[r], :]]).contiguous())
                                   for r in range(world)])
    return runs if isinstance(runs, Result) else _errors(runs, q, k, v)


@graded("17_ring_attention_step", "attend_block")
def check_attend_block(fn) -> Result:
    name = getattr(fn, "__name__", "attend_block")
    for world in WORLDS:
        worst = _run(name, fn, world, 1.0)
        if isinstance(worst, Result):
            return worst
        if not worst["finite"]:
            return Result(False, f"on {world} ranks with ordinary scores the output holds inf or NaN: look at what is "
                                 f"exponentiated, and at the first block (out and lse are None)")
        if worst["alone"] > TOL:
            return Result(False, f"on {world} ranks one query set's result changed when another set's blocks were merged "
                                 f"in between: keep the state in out and lse only")
        if worst["out"] > TOL:
            return Result(False, f"on {world} ranks the output differs from full attention by {worst['out']:.2e} after "
                                 f"{world} blocks: each block's output was normalised by its own denominator; how much "
                                 f"of the total is each?")
        if worst["lse"] > TOL:
            return Result(False, f"on {world} ranks the output is right but lse differs from the log-sum-exp over every "
                                 f"key by {worst['lse']:.2e}: the next block's merge depends on it")
    worst = _run(name, fn, 2, 40.0)
    if isinstance(worst, Result):
        return worst
    if not worst["finite"]:
        return Result(False, "with scores near 100 the output holds inf or NaN: exp() of a float32 score overflows past "
                             "88.7; what can be factored out of every exponent?")
    if worst["out"] > 1e-3:
        return Result(False, f"with scores near 100 the output differs from full attention by "
                             f"{worst['out']:.2e}: look for precision lost in the exponentials")
    return Result(True, "full attention's output and log-sum-exp on 2, 3 and 4 ranks, two query sets kept apart, finite "
                        "with scores near 100")
