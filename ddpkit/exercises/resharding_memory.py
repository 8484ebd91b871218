"""Check for notebook 10b's exercise: the parameter bytes FSDP2 holds between forward and backward.

The contract: ``held_between(shapes, world, rank, reshard_after_forward) -> int``. ``shapes`` lists the
fp32 parameters' shapes of a model whose every parameter belongs to a unit wrapped by ``fully_shard``
(the root module holds none of its own). FSDP2 shards each parameter along dim 0 the way ``torch.chunk``
cuts it into ``world`` pieces (so the last ranks may hold fewer rows, or none). Return the bytes of
parameters rank ``rank`` holds after forward and before backward: with ``reshard_after_forward=True``
(ZeRO-3 behaviour) each unit frees its gathered parameters after its forward; with ``False`` (ZeRO-2
behaviour for parameters) they stay gathered until backward, on top of the shards, which stay
allocated throughout (the optimizer owns them).

The check trains the model with FSDP2 on 3 and on 2 real gloo ranks, one step with each setting
(:func:`ddpkit.parallel.fsdp_depth.run_fsdp`, whose ``held_between`` is measured from the live
parameters), and compares every rank's measured bytes with the learner's answer. The model's width and
depth are drawn when it runs, so the rows torch.chunk gives each rank differ from run to run.
"""

from __future__ import annotations

from ddpkit.exercises import Result, graded, run_on_ranks

WORLDS = (3, 2)
WIDTHS, DEPTHS = (7, 10, 11, 13), (2, 3)  # 10 rows on 3 ranks: torch.chunk gives 4, 4 and 2; 7 gives 3, 3, 1


def _measure(ctx, width: int, depth: int) -> dict:
    from ddpkit.parallel.fsdp_depth import make_model, run_fsdp

    shapes = [tuple(p.shape) for p in make_model(width, depth).parameters()]
    return {"shapes": shapes, **{str(flag): run_fsdp(ctx, reshard_after_forward=flag, steps=1, width=width,
                                                     depth=depth)["held_between"] for flag in (True, False)}}


@graded("10b_reshard_after_forward", "held_between")
def check_held_between(fn) -> Result:
    from ddpkit.parallel import fsdp_depth

    try:
        fsdp_depth.check_supported()
    except Exception as exc:  # noqa: BLE001 - an older torch: say so instead of failing the learner
        return Result(False, f"this torch cannot run FSDP2 on the CPU, so the check cannot measure it: {str(exc)[:100]}")
    import random

    from ddpkit.exercises import learner, not_implemented

    rng = random.SystemRandom()
    width, depth = rng.choice(WIDTHS), rng.choice(DEPTHS)
    measured = {}
    for world in WORLDS:
        runs = run_on_ranks("held_between", _measure, width, depth, world_size=world)
        if isinstance(runs, Result):
            return runs
        measured[world] = runs
    calls = [([tuple(s) for s in runs[rank]["shapes"]], world, rank, flag)
             for world, runs in measured.items() for rank in range(world) for flag in (True, False)]
    try:
        answers = dict(zip([(c[1], c[2], c[3]) for c in calls], learner.many(fn, calls)))
    except NotImplementedError:
        return not_implemented(getattr(fn, "__name__", "held_between"))
    except learner.Raised as exc:
        return Result(False, exc.sentence("held_between"))
    for world, runs in measured.items():
        for rank, run in enumerate(runs):
            for flag in (True, False):
                got, want = answers[(world, rank, flag)], run[str(flag)]
                if got == want:
                    continue
                if not isinstance(got, int):
                    return Result(False, f"held_between returned {type(got).__name__}: return the bytes as an int")
                where = f"on {world} ranks with reshard_after_forward={flag}, rank {rank}'s answer ({got:,} bytes) is"
                if answers[(world, rank, not flag)] == want:
                    return Result(False, f"{where} what FSDP2 holds with the other setting: which one frees the gathered "
                                         f"parameters after forward?")
                if not flag and got < want:
                    return Result(False, f"{where} short of what FSDP2 holds: what stays allocated besides the gathered "
                                         f"parameters?")
                return Result(False, f"{where} {'more' if got > want else 'less'} than FSDP2 holds: how many rows of "
                                     f"each parameter does rank {rank} keep, with torch.chunk's cut?")
    return Result(True, f"every rank's bytes between forward and backward, as measured on FSDP2 with 3 and 2 ranks "
                        f"(width {width}, depth {depth}), resharded after forward or not")
