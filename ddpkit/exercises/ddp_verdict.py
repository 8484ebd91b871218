"""Which mistake a wrong DDP-from-scratch result shows, in one sentence (:func:`diagnose`).

The ranks report their parameters right after the wrapper was built, after each step, and the bytes
their all-reduces carried; the grader has computed what one process averaging the ranks' gradients
gets after each step. Those tell the usual mistakes apart:

* replicas that differ right after construction never took rank 0's weights (a missing broadcast);
* replicas equal after construction that part after a step stepped on different gradients: fewer
  bytes all-reduced than the gradients hold (a bucket waiting for a gradient that never comes, a
  frozen parameter's), or none at all (a wrapper that never all-reduces);
* replicas equal to each other whose first wrong step moved them along the right direction by another
  length: by the number of ranks, a sum where a mean belongs; by another factor, a divisor that is not
  the world size (a hard-coded 2 is right on 2 ranks only);
* right parameters for more bytes than the gradients hold: a gradient sent twice (a weight two layers
  share is one parameter) or one that no backward made.

:func:`finish_or_say` runs the wrapper's ``finish()`` in the rank and turns the error of reducing a
gradient that is ``None`` (the frozen parameter's) into a sentence.
"""

from __future__ import annotations

import torch

TOLERANCE = 1e-6


def finish_or_say(wrapped, model) -> None:
    """``wrapped.finish()``; a reduction of a ``None`` gradient raises the check's sentence instead of torch's."""
    from ddpkit.exercises import Wrong

    try:
        wrapped.finish()
    except (TypeError, AttributeError) as exc:
        text = str(exc)
        if any(p.grad is None for p in model.parameters()) and ("NoneType" in text or "of type torch.Tensor" in text):
            raise Wrong(f"finish() raised {type(exc).__name__} on a gradient that is None: which parameters have no "
                        f"gradient after backward?") from None
        raise


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.flatten() for p in params])


def diagnose(name: str, world: int, runs: list[dict], expected: list[list[torch.Tensor]], initial: list[torch.Tensor],
             gradient_bytes: int) -> str | None:
    """The sentence for the first mistake the runs show (see the module docstring), or None when right.
    ``expected[k]`` are the parameters after step k+1 from rank 0's ``initial`` weights."""
    first = runs[0]
    moved_bytes = [sum(step["bytes"]) for step in first["steps"]]
    apart = next((r for r, run in enumerate(runs[1:], 1) if _max_diff(run["params"], first["params"]) > TOLERANCE), None)
    if apart is not None:
        if _max_diff(runs[apart]["start"], first["start"]) > TOLERANCE:
            return (f"on {world} ranks, right after {name}(model) returned, rank {apart} held other parameters than "
                    f"rank 0: do all replicas start from rank 0's weights?")
        if 0 < min(moved_bytes) < gradient_bytes:
            return (f"on {world} ranks a step all-reduced {min(moved_bytes):,} of the {gradient_bytes:,} gradient bytes: "
                    f"is a bucket waiting for a gradient that never comes?")
        step = next(k for k in range(len(first["after"]))
                    if _max_diff(runs[apart]["after"][k], first["after"][k]) > TOLERANCE)
        return (f"on {world} ranks rank {apart} started with rank 0's parameters but differed from them after step "
                f"{step + 1}: do the ranks step on the same gradient? what do they exchange after backward?")
    wrong_at = next((k for k in range(len(expected)) if _max_diff(first["after"][k], expected[k]) > TOLERANCE), None)
    if wrong_at is not None:
        before = first["after"][wrong_at - 1] if wrong_at else first["start"]
        wanted_before = expected[wrong_at - 1] if wrong_at else initial
        got = _flat(first["after"][wrong_at]) - _flat(before)
        want = _flat(expected[wrong_at]) - _flat(wanted_before)
        ratio = float(got.norm() / want.norm()) if float(want.norm()) > 0 else float("inf")
        if float((_flat(before) - _flat(wanted_before)).abs().max()) <= TOLERANCE and \
                torch.allclose(got, ratio * want, rtol=1e-3, atol=1e-6) and abs(ratio - 1) > 0.05:
            if abs(ratio - world) < 0.01 * world:
                return (f"on {world} ranks the parameters moved {world}x as far as averaging the ranks' gradients "
                        f"would: a sum over the ranks where a mean belongs")
            return (f"on {world} ranks the parameters moved {ratio:.2f}x as far as averaging would: is the gradient "
                    f"divided by the number of ranks, whatever it is?")
        diff = _max_diff(first["params"], expected[-1])
        return (f"on {world} ranks, after {len(expected)} steps the parameters differ from averaging the ranks' "
                f"gradients by {diff:.1e}: is every gradient (the shared weight's too) averaged once?")
    if max(moved_bytes) > gradient_bytes:
        return (f"on {world} ranks one step all-reduced {max(moved_bytes):,} bytes, but the gradients hold "
                f"{gradient_bytes:,}: is some gradient sent twice, or one that no backward made?")
    return None
