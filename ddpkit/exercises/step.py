"""Check for notebook 05's exercise: one training step with gradient accumulation, DDP and a grad scaler.

The contract: ``fn(ddp_model, optimizer, scaler, micro_batches, loss_fn, grad_clip) -> float``, where
``micro_batches`` is a list of ``(inputs, targets)`` and the return value is this rank's mean loss. The
check runs it on 2 real ranks around a DDP-wrapped MLP and compares the parameter update with one
process taking one big batch of all the ranks' samples (plain SGD, so the update is -lr x gradient):

1. 4 micro-batches, no loss scaling, a clip above the true norm: the update must be the big batch's,
   with exactly **one** all-reduce (counted by a DDP comm hook);
   each case runs two steps in a row and compares the second, so a step that leaves its gradients
   behind (no ``zero_grad``) is caught;
2. a grad scaler (loss scaled by 2^16) and a clip that binds: the update's norm must be lr x the clip.

It accepts ``zero_grad`` first or last, and any order of operations that computes the same update. The
samples are drawn when it runs; each rank is given only its own, and the big batch's update is computed
by the grader.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddpkit.exercises import Result, Wrong, graded, run_on_ranks

WORLD, ACCUM, MICRO, LR, STEPS = 2, 4, 4, 0.1, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _draw() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's global batch, drawn now."""
    import secrets

    gen = torch.Generator().manual_seed(secrets.randbits(62))
    return [(torch.randn(WORLD * ACCUM * MICRO, 8, generator=gen), torch.randint(0, 4, (WORLD * ACCUM * MICRO,), generator=gen))
            for _ in range(STEPS)]


def _rank_slice(rank: int) -> slice:
    per_rank = ACCUM * MICRO
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _reference(data: list, grad_clip: float, step: int = 0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, one big batch: the SGD update of step ``step`` (after the earlier steps), and each rank's
    mean loss."""
    model = _model()
    for earlier in range(step):
        x, y = data[earlier]
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        scale = min(1.0, grad_clip / float(norm))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad * scale
        model.zero_grad()
    x, y = data[step]
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    scale = min(1.0, grad_clip / float(norm))
    update = {n: -LR * p.grad * scale for n, p in model.named_parameters()}
    with torch.no_grad():
        losses = [float(nn.functional.cross_entropy(model(x[_rank_slice(r)]), y[_rank_slice(r)])) for r in range(WORLD)]
    return update, losses


def _on_rank(ctx, fn, grad_clip: float, scaled: bool, mine: list) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpkit.metrics import CommTimer

    model = _model()
    ddp = DDP(model)
    timer = CommTimer(torch.device("cpu")).register(ddp)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=scaled)
    for step in range(STEPS):  # the last step is compared: earlier ones must leave nothing behind
        xs, ys = mine[step]
        batches = [(xs[i * MICRO:(i + 1) * MICRO], ys[i * MICRO:(i + 1) * MICRO]) for i in range(ACCUM)]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():  # the mean loss this rank must report, from its own parameters before the step
            own_loss = sum(float(nn.functional.cross_entropy(model(bx), by)) for bx, by in batches) / len(batches)
        timer.reset()
        loss = fn(ddp, optimizer, scaler, batches, nn.functional.cross_entropy, grad_clip)
    if loss is None:
        raise Wrong("the step returned None: return this rank's mean loss over its micro-batches (a float)")
    return {"update": {n: p.detach() - before[n] for n, p in model.named_parameters()}, "before": before, "loss": float(loss),
            "own_loss": own_loss, "all_reduces": timer.calls}


def _big_batch_update(before: dict, batch: tuple, grad_clip: float) -> dict:
    """The big batch's SGD update from the parameters ``before`` (the rank's own, before the compared step)."""
    model = _model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    x, y = batch
    nn.functional.cross_entropy(model(x), y).backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    scale = min(1.0, grad_clip / float(norm))
    return {n: -LR * p.grad * scale for n, p in model.named_parameters()}


def _compare(runs: list[dict], expected: dict, losses: list[float], clip_binds: bool, grad_clip: float,
             batch: tuple) -> None:
    for rank, run in enumerate(runs):
        if run["all_reduces"] != 1:
            if run["all_reduces"] == 0:
                raise Wrong("no all-reduce ran in the step: the last micro-batch's forward and backward must run outside no_sync")
            raise Wrong(f"{run['all_reduces']} all-reduces in one step with grad_accum {ACCUM}: is the forward inside no_sync "
                        f"for all but the last micro-batch?")
        if abs(run["loss"] - run["own_loss"]) > 1e-5:
            raise Wrong(f"rank {rank} returned a loss that is not its mean loss over its micro-batches: look at what the "
                        f"step returns")
    for rank, run in enumerate(runs[1:], 1):
        if any(not torch.equal(run["update"][n], runs[0]["update"][n]) for n in expected):
            raise Wrong(f"rank {rank}'s parameters differ from rank 0's after the step: every rank must step on the averaged gradient")
    got = torch.cat([runs[0]["update"][n].flatten() for n in expected])
    want = torch.cat([expected[n].flatten() for n in expected])
    if torch.allclose(got, want, rtol=1e-4, atol=1e-7):
        return
    ratio = float(got.norm() / want.norm()) if want.norm() > 0 else float("inf")
    if float(got.norm()) == 0:
        raise Wrong("the parameters did not change: call optimizer.step() (through scaler.step(optimizer))")
    from_own = _big_batch_update(runs[0]["before"], batch, grad_clip)  # from where this rank's step started
    own = torch.cat([from_own[n].flatten() for n in expected])
    if torch.allclose(got, ACCUM * own, rtol=1e-3, atol=1e-6) or abs(ratio - ACCUM) < 0.05 * ACCUM:
        raise Wrong(f"the update is {ACCUM}x the big-batch one: the {ACCUM} micro-batches' gradients add up where a mean "
                    f"belongs")
    if clip_binds and ratio < 1e-3:
        raise Wrong(f"the update's norm is 1/{1 / ratio:,.0f} of lr x grad_clip: the clip saw the loss-scaled gradient, "
                    f"not the true one")
    if clip_binds and abs(float(got.norm()) - LR * grad_clip) > 1e-3 * LR * grad_clip:
        raise Wrong("with a clip that binds, the update's norm is not lr x grad_clip: is the total gradient norm clipped, "
                    "after unscaling?")
    raise Wrong(f"step {STEPS}'s update differs from one big batch's (norm ratio {ratio:.3f}): the gradient must be the "
                f"mean over all ranks' samples of this step only (is anything left from the step before?)")


@graded("05_train_step", "train_step")
def check_train_step(fn) -> Result:
    """Check a train step on 2 ranks (see the module docstring)."""
    data = _draw()
    unclipped, losses = _reference(data, 1e9, STEPS - 1)
    true_norm = float(torch.cat([g.flatten() for g in unclipped.values()]).norm()) / LR
    tight = 0.1 * true_norm  # a clip that binds
    clipped, clipped_losses = _reference(data, tight, STEPS - 1)  # the first step was clipped too: other losses
    given = [([(x[_rank_slice(r)].clone(), y[_rank_slice(r)].clone()) for x, y in data],) for r in range(WORLD)]
    for scaled, grad_clip, expected, losses in ((False, 1e9, unclipped, losses), (True, tight, clipped, clipped_losses)):
        runs = run_on_ranks(getattr(fn, "__name__", "train_step"), _on_rank, fn, grad_clip, scaled, world_size=WORLD,
                            rank_args=given)
        if isinstance(runs, Result):
            return runs
        try:
            _compare(runs, expected, losses, grad_clip < 1e9, grad_clip, data[STEPS - 1])
        except Wrong as exc:
            return Result(False, str(exc))
    return Result(True, f"one all-reduce per step, the big batch's update with {ACCUM} micro-batches on {WORLD} ranks, and a "
                        f"clip that binds applied to the unscaled gradient")
