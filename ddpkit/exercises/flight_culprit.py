"""Check for notebook 20's exercise: read the Flight Recorder's dumps of a failed run and name the culprit.

The contract: ``culprit(dumps) -> (rank, seq)``. ``dumps`` maps each rank to its Flight Recorder dump, as
:func:`ddpkit.debug.flight.read_dumps` returns it (plain data: ``dumps[r]["entries"]`` lists that rank's
recent collectives, each with ``collective_seq_id``, ``profiling_name`` such as ``"gloo:all_reduce"``,
``input_sizes`` and ``input_dtypes``). Return the rank whose call differs from the other ranks' at the
first collective they do not all agree on, and that collective's sequence number.

The check makes the dumps from real runs of mismatched collectives (every rank all-reduces twice,
except one rank whose second call differs, as in :func:`ddpkit.debug.mismatch.mismatched_collective`;
each rank dumps its ring as soon as it has issued the second call) on 3 ranks with rank 1 or 2 (drawn)
calling ``broadcast`` instead, and on 4 ranks with rank 0 doing so, after a number of agreeing
all-reduces drawn when it runs. The second run is the one torch's analyzer gets wrong: it compares every
rank with the first and so blames the three that agree.
"""

from __future__ import annotations

import os
import tempfile
import time

from ddpkit.exercises import Result, graded

RUNS = ((3, (1, 2), "broadcast"), (4, (0,), "broadcast"))  # (world, odd rank drawn from, what it calls instead)
TIMEOUT_S = 10.0  # no rank waits on the mismatch: the limit only bounds a surprise


class _Dumped(Exception):
    """Raised by every rank once its ring is on disk: the run ends there, as the failed run would."""


def _mismatched(ctx, odd: int, case: str, folder: str, lead: int = 1) -> None:
    """Every rank all-reduces 4 float32 twice, except ``odd``, whose second call is a broadcast. The second
    call is issued without waiting (the recorder logs a call when it is issued) and every rank dumps its ring
    at once, so no rank waits for a timeout. (A call of another dtype or shape can bring a rank down inside
    gloo before it has dumped: the broadcast's messages are never matched, so nothing moves.)"""
    import torch
    import torch.distributed as dist

    from ddpkit.debug import flight

    for _ in range(lead):
        dist.all_reduce(torch.ones(4))
    if ctx.rank == odd:
        dist.broadcast(torch.ones(4), src=odd, async_op=True)  # the mismatch: the others all-reduce here
    else:
        dist.all_reduce(torch.ones(4), async_op=True)
    flight.dump(folder, ctx.rank)
    deadline = time.monotonic() + TIMEOUT_S  # the first rank to fail ends the run: not before every ring is written
    while time.monotonic() < deadline and len([n for n in os.listdir(folder) if n.startswith(flight.DUMP_PREFIX)]) < ctx.world_size:
        time.sleep(0.05)
    raise _Dumped("dumped")


def _dumps(world: int, odd: int, case: str, lead: int = 1) -> dict | Result:
    from ddpkit.debug import flight
    from ddpkit.failures import LaunchError
    from ddpkit.launch import launch

    folder = tempfile.mkdtemp(prefix="ddpkit-check-flight-")
    with flight.recording(entries=16):
        try:
            launch(_mismatched, odd, case, folder, lead, world_size=world, backend="gloo", timeout=TIMEOUT_S,
                   output="none", progress="off")
        except LaunchError:
            pass  # every rank raises once it has dumped
    try:
        dumps = flight.read_dumps(folder)
    except FileNotFoundError:
        dumps = {}
    if sorted(dumps) != list(range(world)):
        return Result(False, f"only ranks {sorted(dumps)} of {world} left a dump on this machine: a grader problem, retry")
    return dumps


@graded("20_flight_culprit", "culprit")
def check_culprit(fn) -> Result:
    from ddpkit.debug import flight

    try:
        flight.require()
    except RuntimeError as exc:
        return Result(False, f"this torch cannot dump the Flight Recorder on gloo, so the check cannot run: {str(exc)[:90]}")
    import random

    from ddpkit.exercises import learner, not_implemented

    rng = random.SystemRandom()
    for world, odds, case in RUNS:
        odd = rng.choice(odds)
        dumps = _dumps(world, odd, case, lead=rng.randint(1, 3))
        if isinstance(dumps, Result):
            return dumps
        try:
            got = fn({r: d for r, d in dumps.items()})
        except NotImplementedError:
            return not_implemented(getattr(fn, "__name__", "culprit"))
        except learner.Raised as exc:
            return Result(False, exc.sentence("culprit"))
        except Exception as exc:  # noqa: BLE001 - called here, outside the sandbox
            return Result(False, f"culprit raised {type(exc).__name__}: {learner.short(str(exc))}")
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return Result(False, f"culprit returned {type(got).__name__}: return the pair (rank, seq)")
        rank, seq = got
        if rank != odd:
            agree = "the first rank" if odd == 0 else "the others"
            return Result(False, f"on {world} ranks you named rank {rank}, whose calls match most ranks': at the first "
                                 f"disagreement, which rank is the odd one out? (it can be {agree})")
        want = dumps[odd]["entries"][-1]["collective_seq_id"]  # the odd rank's differing call was its last
        if seq != want:
            return Result(False, f"on {world} ranks the rank is right but collective #{seq} is not where the ranks first "
                                 f"disagree: compare the entries with the same collective_seq_id")
    return Result(True, "the odd rank and the first collective the ranks disagree on, from real dumps on 3 and 4 ranks "
                        "(rank 0 the culprit in one)")
