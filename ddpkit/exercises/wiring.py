"""Check for notebook 08's exercise: wire a process to its rank and device from the launcher's environment.

The contract: ``rank_wiring(env: dict, gpus_on_node: int) -> dict`` with ``rank``, ``local_rank``,
``world_size`` (ints) and ``device`` (a string): read from the variables torchrun and the ddpkit launcher
set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``); the device is ``cuda:<local rank>``
when the node has a GPU for each of its ranks, else ``cpu``. The check calls it in every rank of real
jobs of 2 and 3 ranks with that rank's own environment, then with the environments of a multi-node job
whose shape (nodes, ranks and GPUs per node) is drawn when it runs.
"""

from __future__ import annotations

import os

from ddpkit.exercises import Result, graded, learner, run_on_ranks


def _nodes(rng) -> list[tuple[dict, int]]:
    """Every rank's environment in a job of 2 or 3 nodes of 2 to 4 ranks, a GPU per rank; then one rank of a
    node with fewer GPUs than ranks."""
    nodes, per_node = rng.randint(2, 3), rng.randint(2, 4)
    world = nodes * per_node
    out = [({"RANK": str(r), "LOCAL_RANK": str(r % per_node), "WORLD_SIZE": str(world),
             "LOCAL_WORLD_SIZE": str(per_node)}, per_node) for r in range(world)]
    local = rng.randrange(per_node)
    return out + [({"RANK": str(per_node + local), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(per_node)}, rng.randint(1, per_node - 1))]


def _on_rank(ctx, fn) -> dict:
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    return {"ctx": (ctx.rank, ctx.local_rank, ctx.world_size), "got": fn(dict(env), 0)}


def _expected(env: dict, gpus: int) -> dict:
    local = int(env["LOCAL_RANK"])
    return {"rank": int(env["RANK"]), "local_rank": local, "world_size": int(env["WORLD_SIZE"]),
            "device": f"cuda:{local}" if gpus >= int(env["LOCAL_WORLD_SIZE"]) else "cpu"}


@graded("08_rank_wiring", "rank_wiring")
def check_rank_wiring(fn) -> Result:
    runs = []
    for world in (2, 3):
        found = run_on_ranks(getattr(fn, "__name__", "rank_wiring"), _on_rank, fn, world_size=world)
        if isinstance(found, Result):
            return found
        runs += found
    for run in runs:
        got, (rank, local, world) = run["got"], run["ctx"]
        if not isinstance(got, dict):
            return Result(False, f"rank_wiring returned {type(got).__name__}: return a dict (rank, local_rank, world_size, device)")
        if (got.get("rank"), got.get("local_rank"), got.get("world_size")) != (rank, local, world):
            return Result(False, f"rank {rank} of {world} read rank {got.get('rank')!r}, local rank {got.get('local_rank')!r}, "
                                 f"world {got.get('world_size')!r}: read RANK, LOCAL_RANK and WORLD_SIZE (as ints)")
        if got.get("device") != "cpu":
            return Result(False, f"with no GPU, rank {rank} chose {got.get('device')!r}: use the CPU (and gloo)")
    import random

    cases = _nodes(random.SystemRandom())
    try:
        answers = learner.many(fn, [(dict(env), gpus) for env, gpus in cases])
    except learner.Raised as exc:
        return Result(False, exc.sentence("rank_wiring"))
    for (env, gpus), got in zip(cases, answers):
        want = _expected(env, gpus)
        if not isinstance(got, dict):
            return Result(False, f"rank_wiring returned {type(got).__name__}: return a dict (rank, local_rank, world_size, device)")
        if got.get("device") != want["device"]:
            where = f"global rank {env['RANK']} (local rank {env['LOCAL_RANK']} of {env['LOCAL_WORLD_SIZE']} on its node, {gpus} GPU(s))"
            if want["device"] == "cpu":
                return Result(False, f"{where} chose {got.get('device')!r}: with fewer GPUs than ranks on the node, NCCL "
                                     f"cannot give each rank its own GPU: use the CPU")
            return Result(False, f"{where} chose {got.get('device')!r}, not {want['device']!r}: a node numbers its GPUs "
                                 f"from 0, so index them by LOCAL_RANK, not RANK")
        if any(got.get(k) != want[k] for k in want):
            wrong = next(k for k in want if got.get(k) != want[k])
            return Result(False, f"for global rank {env['RANK']} of a multi-node job its {wrong} is {got.get(wrong)!r:.30}: "
                                 f"which variable holds it, and as what type?")
    return Result(True, "the right rank, world and device on 2 and 3 real ranks and on every rank of a simulated "
                        "multi-node job")
