"""Check for notebook 18's exercise: the all-to-all that sends each routed token to its expert's rank.

The contract: ``dispatch(rows, counts) -> (received, per_source)``, called by every rank of the default
group. E experts are split evenly over the N ranks (rank r holds experts ``[r E/N, (r+1) E/N)``).
``rows`` (R, C) are this rank's routed copies of its tokens, sorted by expert; ``counts`` (E,) int64 says
how many rows go to each expert. Return ``received``, the rows of this rank's experts from every rank,
ordered by source rank and, within one source, by expert (what ``all_to_all_single`` gives), and
``per_source`` (N, E/N) int64: how many of them came from each source rank for each local expert. A
receiver cannot know those counts without being told: they depend on the other ranks' routing.

The check builds expert parallelism around it on 2, 3 and 4 real gloo ranks (its own router, experts and
combine: the reverse ``all_to_all_single``) and compares every rank's output with the single-process
:class:`ddpkit.parallel.experts.MoE` on every rank's tokens (one capacity group per rank, as the kit's
``check_against_single`` does), and counts the bytes each rank received: only its experts' rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

WORLDS = (2, 3, 4)
TOKENS, D_MODEL, LOCAL, K = 24, 8, 2, 2
TOL = 1e-5


def _on_rank(ctx, fn) -> dict:
    from ddpkit.parallel.experts import Experts, MoE, route

    ep, rank = ctx.world_size, ctx.rank
    num_experts = LOCAL * ep
    torch.manual_seed(ep)
    full = MoE(D_MODEL, num_experts, K, capacity_factor=1.0, aux_coef=0.0, groups=ep)
    x_all = torch.randn(ep, TOKENS, D_MODEL, generator=torch.Generator().manual_seed(100 + ep))
    with torch.no_grad():
        want = full(x_all)[rank]
        flat = x_all[rank]
        routing = route(flat, full.router.weight, K, 1.0)
        order, counts = routing.order()
        rows = flat[routing.token[order]]
        try:
            got = fn(rows.clone(), counts.clone())
        except RuntimeError as exc:
            if not _size_mismatch(str(exc)):
                raise  # a timeout or another failure: the launcher's sentence (hung, too slow, raised) says it
            raise Wrong(f"on {ep} ranks rank {rank}'s all-to-all failed: the rows that came did not fit the sizes it "
                        f"expected; does each receiver know how many rows every peer sends it?") from None
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Wrong(f"dispatch returned {type(got).__name__}: return the pair (received, per_source)")
        received, per_source = torch.as_tensor(got[0]), torch.as_tensor(got[1]).to(torch.int64)
        if tuple(per_source.shape) != (ep, LOCAL):
            raise Wrong(f"on {ep} ranks with {LOCAL} experts each, per_source has shape {tuple(per_source.shape)}, not "
                        f"({ep}, {LOCAL}): one row per source rank, one column per local expert")
        if received.shape != (int(per_source.sum()), D_MODEL):
            raise Wrong(f"on {ep} ranks rank {rank} returned {tuple(received.shape)[0]} rows but per_source counts "
                        f"{int(per_source.sum())}: they must describe the same rows")
        first = rank * LOCAL
        sent = [route(x_all[s], full.router.weight, K, 1.0).order()[1] for s in range(ep)]  # every rank's counts
        truth = torch.stack([c[first:first + LOCAL] for c in sent])  # (source, local expert)
        if not torch.equal(per_source, truth):
            if torch.equal(per_source, counts.view(ep, LOCAL)):
                raise Wrong(f"on {ep} ranks rank {rank}'s per_source holds its own counts, not what its peers sent: does "
                            f"each receiver know how many rows every peer sends it?")
            raise Wrong(f"on {ep} ranks rank {rank}'s per_source does not count the rows that came: one row per source "
                        f"rank, one column per local expert")
        experts = Experts(LOCAL, D_MODEL, full.experts.w1.shape[-1])
        for name, p in experts.named_parameters():
            p.copy_(getattr(full.experts, name)[first:first + LOCAL])
        local_expert = torch.arange(LOCAL).repeat(ep).repeat_interleave(per_source.flatten())
        by_expert = torch.argsort(local_expert, stable=True)
        done = experts(received[by_expert], per_source.sum(0).tolist())
        back = torch.empty_like(done).index_copy(0, by_expert, done)
        send_splits = counts.view(ep, LOCAL).sum(1).tolist()
        home = rows.new_empty(rows.shape)
        dist.all_to_all_single(home, back.contiguous(), send_splits, per_source.sum(1).tolist())  # the combine
        y = torch.zeros_like(flat).index_add(0, routing.token[order], home * routing.gate[order].unsqueeze(1))
    return {"diff": float((y - want).abs().max()), "rows": int(received.shape[0]), "expected_rows": int(truth.sum())}


def _size_mismatch(text: str) -> bool:
    """gloo's own words when a rank receives another number of bytes than it posted for."""
    return "timed out" not in text.lower() and ("size" in text.lower() or "enforce fail" in text)


@graded("18_expert_dispatch", "dispatch")
def check_dispatch(fn) -> Result:
    name = getattr(fn, "__name__", "dispatch")
    for world in WORLDS:
        runs = run_on_ranks(name, _on_rank, fn, world_size=world)
        if isinstance(runs, Result):
            if "SIGABRT" in runs.message:  # gloo aborts a rank that receives more bytes than it posted for
                return Result(False, f"on {world} ranks a rank was aborted inside an all-to-all, as gloo does when more "
                                     f"bytes arrive than expected: does each receiver know how many rows every peer "
                                     f"sends it?")
            return runs
        for rank, run in enumerate(runs):
            if run["rows"] != run["expected_rows"]:
                return Result(False, f"on {world} ranks rank {rank} received {run['rows']} rows where its experts were "
                                     f"routed {run['expected_rows']}: send each row only to the rank of its expert")
        worst = max(run["diff"] for run in runs)
        if worst > TOL:
            return Result(False, f"on {world} ranks the output differs from the single-process MoE by {worst:.2e}: did "
                                 f"each row reach its expert, and does per_source say which source and expert?")
    return Result(True, "the single-process MoE's output on 2, 3 and 4 ranks, each rank receiving only its experts' rows")
