"""Check for notebook 05's exercise: one training step with gradient accumulation, DDP and a grad scaler.

The contract: ``fn(ddp_model, optimizer, scaler, micro_batches, loss_fn, grad_clip) -> float``, where
``micro_batches`` is a list of ``(inputs, targets)`` and the return value is this rank's mean loss. The
check runs it on real ranks around a DDP-wrapped MLP and compares every step's parameter update with one
process taking one big batch of all the ranks' samples (plain SGD, so the update is -lr x gradient). It
runs twice, on 2 and on 3 ranks (in an order drawn when it runs), each time with its own number of
micro-batches drawn from {2, 3, 5} (never the same twice, so a divisor written as a number fails one):

1. no loss scaling, a clip above the true norm, two steps: each update must be the big batch's, with
   exactly **one** all-reduce per step (counted by a DDP comm hook); the second step catches a step that
   leaves its gradients behind (no ``zero_grad``);
2. a grad scaler (loss scaled by 2^16), a first step with a clip above the norm (the scaled loss must
   still give the big batch's update) and a second step with a clip that binds: the update's norm must
   be lr x the clip.

It accepts ``zero_grad`` first or last, and any order of operations that computes the same update. The
samples are drawn when it runs; each rank is given only its own, and the big batch's update is computed
by the grader.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

MICRO, LR, STEPS = 4, 0.1, 2
WORLDS, ACCUMS = (2, 3), (2, 3, 5)  # a run on each world size, each with its own grad_accum
NO_CLIP = 1e9


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _draw(world: int, accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's global batch, drawn now."""
    import secrets

    gen = torch.Generator().manual_seed(secrets.randbits(62))
    n = world * accum * MICRO
    return [(torch.randn(n, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen)) for _ in range(STEPS)]


def _rank_slice(rank: int, accum: int) -> slice:
    per_rank = accum * MICRO
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _sgd_update(model: nn.Module, batch: tuple, grad_clip: float) -> dict[str, torch.Tensor]:
    """The big batch's clipped SGD update from ``model``'s parameters (its gradients are left behind)."""
    model.zero_grad()
    x, y = batch
    nn.functional.cross_entropy(model(x), y).backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    scale = min(1.0, grad_clip / float(norm))
    return {n: -LR * p.grad * scale for n, p in model.named_parameters()}


def _reference(data: list, clips: list[float]) -> list[dict[str, torch.Tensor]]:
    """One process, one big batch per step: every step's SGD update, each step clipped at ``clips[step]``."""
    model = _model()
    updates = []
    for batch, clip in zip(data, clips):
        update = _sgd_update(model, batch, clip)
        updates.append(update)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p += update[n]
    return updates


def _big_batch_update(before: dict, batch: tuple, grad_clip: float) -> dict:
    """The big batch's SGD update from the parameters ``before`` (the rank's own, before the compared step)."""
    model = _model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    return _sgd_update(model, batch, grad_clip)


def _on_rank(ctx, fn, clips: list[float], scaled: bool, accum: int, mine: list) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpkit.metrics import CommTimer

    model = _model()
    ddp = DDP(model)
    timer = CommTimer(torch.device("cpu")).register(ddp)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=scaled)
    steps = []
    for step, grad_clip in enumerate(clips):
        xs, ys = mine[step]
        batches = [(xs[i * MICRO:(i + 1) * MICRO], ys[i * MICRO:(i + 1) * MICRO]) for i in range(accum)]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():  # the mean loss this rank must report, from its own parameters before the step
            own_loss = sum(float(nn.functional.cross_entropy(model(bx), by)) for bx, by in batches) / len(batches)
        timer.reset()
        loss = fn(ddp, optimizer, scaler, batches, nn.functional.cross_entropy, grad_clip)
        if loss is None:
            raise Wrong("the step returned None: return this rank's mean loss over its micro-batches (a float)")
        steps.append({"update": {n: p.detach() - before[n] for n, p in model.named_parameters()}, "before": before,
                      "loss": float(loss), "own_loss": own_loss, "all_reduces": timer.calls})
    return {"steps": steps}


def _compare(runs: list[dict], step: int, expected: dict, grad_clip: float, batch: tuple, accum: int) -> None:
    """Step ``step`` of every rank against the big batch's update ``expected``; raise the first thing wrong."""
    world = len(runs)
    for rank, run in enumerate(runs):
        this = run["steps"][step]
        if this["all_reduces"] != 1:
            if this["all_reduces"] == 0:
                raise Wrong("no all-reduce ran in the step: the last micro-batch's forward and backward must run outside no_sync")
            raise Wrong(f"{this['all_reduces']} all-reduces in one step with grad_accum {accum}: is the forward inside "
                        f"no_sync for all but the last micro-batch?")
        if abs(this["loss"] - this["own_loss"]) > 1e-5:
            raise Wrong(f"rank {rank} returned a loss that is not its mean loss over its micro-batches: look at what the "
                        f"step returns")
    first = runs[0]["steps"][step]
    for rank, run in enumerate(runs[1:], 1):
        if any(not torch.equal(run["steps"][step]["update"][n], first["update"][n]) for n in expected):
            raise Wrong(f"rank {rank}'s parameters differ from rank 0's after the step: every rank must step on the averaged gradient")
    got = torch.cat([first["update"][n].flatten() for n in expected])
    want = torch.cat([expected[n].flatten() for n in expected])
    if torch.allclose(got, want, rtol=1e-4, atol=1e-7):
        return
    ratio = float(got.norm() / want.norm()) if want.norm() > 0 else float("inf")
    if float(got.norm()) == 0:
        raise Wrong("the parameters did not change: call optimizer.step() (through scaler.step(optimizer))")
    from_own = _big_batch_update(first["before"], batch, grad_clip)  # from where this rank's step started
    own = torch.cat([from_own[n].flatten() for n in expected])
    clip_binds = grad_clip < NO_CLIP
    if not clip_binds and torch.allclose(got, ratio * own, rtol=1e-3, atol=1e-6):  # the right direction, scaled
        if abs(ratio - accum) < 0.02 * accum:
            raise Wrong(f"the update is {accum}x the big-batch one: the {accum} micro-batches' gradients add up where a "
                        f"mean belongs")
        if abs(ratio - 1) > 0.01:
            raise Wrong(f"on {world} ranks with grad_accum {accum} the update is {ratio:.2f}x the big-batch one: does the "
                        f"loss's divisor follow the number of micro-batches the step is given?")
    if clip_binds and ratio < 1e-3:
        raise Wrong(f"the update's norm is 1/{1 / ratio:,.0f} of lr x grad_clip: the clip saw the loss-scaled gradient, "
                    f"not the true one")
    if clip_binds and abs(float(got.norm()) - LR * grad_clip) > 1e-3 * LR * grad_clip:
        raise Wrong("with a clip that binds, the update's norm is not lr x grad_clip: is the total gradient norm clipped, "
                    "after unscaling?")
    raise Wrong(f"step {step + 1}'s update differs from one big batch's (norm ratio {ratio:.3f}): the gradient must be the "
                f"mean over all ranks' samples of this step only (is anything left from the step before?)")


def plan() -> list[tuple[int, int, bool]]:
    """The runs, drawn now: (world size, grad_accum, scaled) for each, every world once, no grad_accum twice."""
    import random

    draw = random.SystemRandom()
    worlds, accums = list(WORLDS), draw.sample(ACCUMS, len(WORLDS))
    draw.shuffle(worlds)
    return [(world, accum, scaled) for world, accum, scaled in zip(worlds, accums, (False, True))]


@graded("05_train_step", "train_step")
def check_train_step(fn) -> Result:
    """Check a train step on 2 and 3 ranks with drawn numbers of micro-batches (see the module docstring)."""
    done = []
    for world, accum, scaled in plan():
        data = _draw(world, accum)
        clips = [NO_CLIP] * STEPS
        if scaled:  # the last step's clip binds: a tenth of the true gradient norm there
            unclipped = _reference(data, clips)[-1]
            clips[-1] = 0.1 * float(torch.cat([g.flatten() for g in unclipped.values()]).norm()) / LR
        expected = _reference(data, clips)
        given = [([(x[_rank_slice(r, accum)].clone(), y[_rank_slice(r, accum)].clone()) for x, y in data],)
                 for r in range(world)]
        runs = run_on_ranks(getattr(fn, "__name__", "train_step"), _on_rank, fn, clips, scaled, accum, world_size=world,
                            rank_args=given)
        if isinstance(runs, Result):
            return runs
        try:
            for step in range(STEPS):
                _compare(runs, step, expected[step], clips[step], data[step], accum)
        except Wrong as exc:
            return Result(False, str(exc))
        done.append(f"{accum} micro-batches on {world} ranks")
    return Result(True, f"one all-reduce per step, the big batch's update with {' and '.join(done)}, and a clip that "
                        f"binds applied to the unscaled gradient")
