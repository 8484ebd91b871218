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
``check_against_single`` does), and counts the rows each rank received: only its experts' rows. The
tokens and the weights are drawn when it runs; a rank holds its own tokens and its own experts, and the
comparisons are made by the grader, outside the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

WORLDS = (2, 3, 4)
TOKENS, D_MODEL, LOCAL, K = 24, 8, 2, 2
TOL = 1e-5


def _on_rank(ctx, fn, router: torch.Tensor, x_mine: torch.Tensor, experts_mine: dict) -> dict:
    from ddpkit.parallel.experts import Experts, route

    ep, rank = ctx.world_size, ctx.rank
    with torch.no_grad():
        routing = route(x_mine, router, K, 1.0)
        order, counts = routing.order()
        rows = x_mine[routing.token[order]]
        truth = torch.empty(ep * LOCAL, dtype=torch.int64)  # what each source routes to this rank's experts
        dist.all_to_all_single(truth, counts.clone())
        truth = truth.view(ep, LOCAL)
        try:
            got = fn(rows.clone(), counts.clone())
        except RuntimeError as exc:
            if not _size_mismatch(str(exc)):
                raise  # a timeout or another failure: the sentence (hung, too slow, raised) says it
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
        report = {"per_source": per_source.clone(), "counts": counts.clone(), "rows": int(received.shape[0])}
        wrong = torch.full((ep,), int(not torch.equal(per_source, truth)), dtype=torch.int64)
        anywhere = torch.empty_like(wrong)
        dist.all_to_all_single(anywhere, wrong)  # every rank learns whether any rank's counts are off
        if bool(anywhere.any()):
            return report  # the combine would not fit on every rank: the grader names what per_source holds
        experts = Experts(LOCAL, D_MODEL, experts_mine["w1"].shape[-1])
        for name, p in experts.named_parameters():
            p.copy_(experts_mine[name])
        local_expert = torch.arange(LOCAL).repeat(ep).repeat_interleave(per_source.flatten())
        by_expert = torch.argsort(local_expert, stable=True)
        done = experts(received[by_expert], per_source.sum(0).tolist())
        back = torch.empty_like(done).index_copy(0, by_expert, done)
        send_splits = counts.view(ep, LOCAL).sum(1).tolist()
        home = rows.new_empty(rows.shape)
        dist.all_to_all_single(home, back.contiguous(), send_splits, per_source.sum(1).tolist())  # the combine
        report["y"] = torch.zeros_like(x_mine).index_add(0, routing.token[order], home * routing.gate[order].unsqueeze(1))
    return report


def _setup(ep: int) -> tuple:
    """The MoE, every rank's tokens (drawn now), what each rank is given, and what each must end with."""
    import secrets

    from ddpkit.parallel.experts import MoE, route

    torch.manual_seed(secrets.randbits(62))
    full = MoE(D_MODEL, LOCAL * ep, K, capacity_factor=1.0, aux_coef=0.0, groups=ep)
    x_all = torch.randn(ep, TOKENS, D_MODEL)
    with torch.no_grad():
        want = full(x_all)
        sent = [route(x_all[s], full.router.weight, K, 1.0).order()[1] for s in range(ep)]
    router = full.router.weight.detach().clone()
    given = []
    for rank in range(ep):
        first = rank * LOCAL
        mine = {name: getattr(full.experts, name).detach()[first:first + LOCAL].clone()
                for name, _ in full.experts.named_parameters()}
        given.append((router, x_all[rank].clone(), mine))
    truth = [torch.stack([c[r * LOCAL:(r + 1) * LOCAL] for c in sent]) for r in range(ep)]
    return given, want, truth


def _size_mismatch(text: str) -> bool:
    """gloo's own words when a rank receives another number of bytes than it posted for."""
    return "timed out" not in text.lower() and ("size" in text.lower() or "enforce fail" in text)


@graded("18_expert_dispatch", "dispatch")
def check_dispatch(fn) -> Result:
    name = getattr(fn, "__name__", "dispatch")
    for world in WORLDS:
        given, want, truth = _setup(world)
        runs = run_on_ranks(name, _on_rank, fn, world_size=world, rank_args=given)
        if isinstance(runs, Result):
            if "SIGABRT" in runs.message:  # gloo aborts a rank that receives more bytes than it posted for
                return Result(False, f"on {world} ranks a rank was aborted inside an all-to-all, as gloo does when more "
                                     f"bytes arrive than expected: does each receiver know how many rows every peer "
                                     f"sends it?")
            return runs
        for rank, run in enumerate(runs):
            if not torch.equal(run["per_source"], truth[rank]):
                if torch.equal(run["per_source"], run["counts"].view(world, LOCAL)):
                    return Result(False, f"on {world} ranks rank {rank}'s per_source holds its own counts, not what its "
                                         f"peers sent: does each receiver know how many rows every peer sends it?")
                return Result(False, f"on {world} ranks rank {rank}'s per_source does not count the rows that came: one "
                                     f"row per source rank, one column per local expert")
            if run["rows"] != int(truth[rank].sum()):
                return Result(False, f"on {world} ranks rank {rank} received {run['rows']} rows where its experts were "
                                     f"routed {int(truth[rank].sum())}: send each row only to the rank of its expert")
        worst = max(_diff(run.get("y"), want[rank]) for rank, run in enumerate(runs))
        if worst > TOL:
            return Result(False, f"on {world} ranks the output differs from the single-process MoE by {worst:.2e}: did "
                                 f"each row reach its expert, and does per_source say which source and expert?")
    return Result(True, "the single-process MoE's output on 2, 3 and 4 ranks, each rank receiving only its experts' rows")


def _diff(got, want: torch.Tensor) -> float:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max())
