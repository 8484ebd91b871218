"""Run a pipeline order for real: each rank executes its list of actions on gloo, sending activations
forward and gradients back, so that an order is judged by what runs and not only by a model of it.

The model is ``p v`` chunks (a linear layer and a tanh each); rank r holds chunks r, r + p, ... as in
interleaved 1F1B. ``F(c, i)`` receives micro-batch i's activation from the rank holding chunk c - 1 (a
blocking receive), runs the chunk and sends the output on; ``B(c, i)`` receives the gradient of chunk
c's output from the rank holding c + 1, runs backward and sends the input's gradient back. Every
message is tagged with its chunk and micro-batch, so only the order of the actions decides whether the
ranks finish: an order in which every rank waits for a message that another rank's order puts later
hangs here as it would on a cluster. The gradients every rank ends with are compared by the grader with
those of the whole model on the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH, BATCH = 8, 3


def _layers(p: int, v: int, seed: int) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(WIDTH, WIDTH) for _ in range(p * v)]


def _inputs(m: int, seed: int) -> torch.Tensor:
    return torch.randn(m, BATCH, WIDTH, generator=torch.Generator().manual_seed(seed + 1))


def expected_grads(p: int, v: int, m: int, seed: int) -> list[list[torch.Tensor]]:
    """Each chunk's parameter gradients for the whole model on every micro-batch (loss: sum of outputs)."""
    layers = _layers(p, v, seed)
    for x in _inputs(m, seed):
        for layer in layers:
            x = torch.tanh(layer(x))
        x.sum().backward()
    return [[q.grad.clone() for q in layer.parameters()] for layer in layers]


def run(ctx, shapes: list[tuple[int, int, int]], orders: list[list[list[tuple[str, int, int]]]], seed: int) -> list:
    """For each shape, this rank's order executed for real; each chunk it holds with its gradients."""
    import torch.distributed as dist

    out = []
    for (p, v, m), order in zip(shapes, orders):
        layers, x, last = _layers(p, v, seed), _inputs(m, seed), p * v - 1
        inputs, outputs, sends = {}, {}, []

        def tag(c: int, i: int, backward: bool) -> int:
            return 2 * (c + p * v * i) + int(backward)

        for kind, c, i in order[ctx.rank]:
            if kind == "F":
                if c == 0:
                    act = x[i].clone()
                else:
                    act = torch.empty(BATCH, WIDTH)
                    dist.recv(act, src=(c - 1) % p, tag=tag(c, i, False))
                    act.requires_grad_(True)
                y = torch.tanh(layers[c](act))
                inputs[(c, i)], outputs[(c, i)] = act, y
                if c < last:
                    sends.append(dist.isend(y.detach().contiguous(), dst=(c + 1) % p, tag=tag(c + 1, i, False)))
            else:
                y, act = outputs.pop((c, i)), inputs.pop((c, i))
                if c == last:
                    grad = torch.ones_like(y)
                else:
                    grad = torch.empty(BATCH, WIDTH)
                    dist.recv(grad, src=(c + 1) % p, tag=tag(c, i, True))
                y.backward(grad)
                if c > 0:
                    sends.append(dist.isend(act.grad.contiguous(), dst=(c - 1) % p, tag=tag(c - 1, i, True)))
        for work in sends:
            work.wait()
        out.append({c: [q.grad.clone() if q.grad is not None else None for q in layers[c].parameters()]
                    for c in range(p * v) if c % p == ctx.rank})
    return out
