"""The exercise checks: each solution (taken from its solution notebook) passes, each untouched stub gets
"not implemented yet", and each known mistake gets its own sentence; a rank that raises is named.

Every case is graded the way a check cell grades it (its objects back to code, run in the sandbox), but
all of them in two sandboxes at once (:func:`ddpkit.exercises.sandbox.run_many`): Python, torch and the
machine's baseline are paid once per sandbox, and each case still runs in its own forked process. The
cases are registered next to their tests (:func:`grade`) and graded once, by the module's fixture."""

import contextlib
import dataclasses
import functools
import importlib.util
import linecache
import re
import time
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

from ddpkit.exercises.checkpointing import check_checkpoint
from ddpkit.exercises.collectives import check_ring_all_reduce
from ddpkit.exercises.data import check_sampler
from ddpkit.exercises.sharding import check_zero1
from ddpkit.exercises.step import check_train_step

EXERCISES = Path(__file__).resolve().parents[1] / "exercises"
CASES: dict[tuple, tuple] = {}  # (check name, objects) -> (exercise, check, objects): graded once, by `verdicts`


def grade(check, *cases) -> None:
    """Register ``check`` on each case (an object, or a tuple of objects for a check of several names)."""
    for case in cases:
        objects = case if isinstance(case, tuple) else (case,)
        CASES[(check.__name__, objects)] = (check.exercise, check.check, objects)


def grade_code(check, name: str, code: str) -> None:
    """Register ``check`` on ``code`` (a learner's cells, as text), looked up as ``verdicts(check, name)``."""
    CASES[(check.__name__, (name,))] = (check.exercise, check.check, code)


class Verdicts:
    def __init__(self, found: dict) -> None:
        self.found = found

    def __call__(self, check, *objects):
        return self.found[(check.__name__, objects)]


@pytest.fixture(scope="module")
def verdicts():
    """Every registered case, and every master and stub, graded in two sandboxes side by side."""
    from concurrent.futures import ThreadPoolExecutor

    from ddpkit.exercises import Result, catalog, sandbox
    from ddpkit.exercises.sources import code_of, learner_code

    keys, cases = [], []
    for key, (exercise, check, objects) in CASES.items():
        if isinstance(objects, str):
            code, refs = objects, {}
        else:
            code, refs = code_of(objects, catalog.exercise(exercise).checks[check][1])
        keys.append(key)
        cases.append({"exercise": exercise, "code": code, "checks": [check], "objects": refs})
    for e in catalog.EXERCISES:
        for path in (EXERCISES / "solutions" / f"{e.id}.ipynb", EXERCISES / f"{e.id}.ipynb"):
            keys.append(("notebook", path.parent.name, e.id))
            cases.append({"exercise": e.id, "code": learner_code(nbformat.read(path, as_version=4), e.names)})
    cost = [catalog.exercise(c["exercise"]).budget_units for c in cases]
    halves: list[list[int]] = [[], []]
    for i in sorted(range(len(cases)), key=lambda i: -cost[i]):  # balance the two sandboxes by budget
        min(halves, key=lambda h: sum(cost[j] for j in h)).append(i)
    with ThreadPoolExecutor(2) as pool:
        graded = list(pool.map(lambda half: sandbox.run_many([cases[i] for i in half], preload=[__name__]), halves))
    found = {}
    for half, rows in zip(halves, graded):
        for i, case_rows in zip(half, rows):
            found[keys[i]] = case_rows if keys[i][0] == "notebook" else \
                Result(case_rows[0]["passed"], case_rows[0]["message"])
    return Verdicts(found)


def code_between_markers(path: Path) -> str:
    nb = nbformat.read(path, as_version=4)  # every cell the learner writes, in order (00 has eight)
    return "\n\n".join(c.source for c in nb.cells if c.cell_type == "code" and "### begin" in c.source)


def load(notebook: str, *names: str, solved: bool = True):
    namespace = {"__name__": "__main__"}  # as in a notebook cell: ranks get it by fork
    code, filename = code_between_markers(EXERCISES / ("solutions" if solved else "") / notebook), f"<cell of {'solutions/' if solved else ''}{notebook}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # as IPython keeps cells: for getsource
    exec(compile(code, filename, "exec"), namespace)
    found = [namespace[n] for n in names]
    return found[0] if len(found) == 1 else found


# --------------------------------------------------------------------------- the sampler

Sampler = load("02_sampler.ipynb", "ResumableDistributedSampler")


class OnlyTheFirstEpoch(Sampler):  # the handbook's bug: the position is never taken modulo the epoch
    def _mine(self):
        epoch = self.consumed // self.per_epoch
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        return order[self.consumed + self.rank:self.per_epoch:self.world]


class NeverReshuffles(Sampler):
    def _mine(self):
        offset = self.consumed % self.per_epoch
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed)).tolist()
        return order[offset + self.rank:self.per_epoch:self.world]


class GlobalRandom(Sampler):  # the process's RNG: another order every time it is asked
    def _mine(self):
        offset = self.consumed % self.per_epoch
        return torch.randperm(self.n).tolist()[offset + self.rank:self.per_epoch:self.world]


class Blocked(Sampler):  # another valid layout: each rank a contiguous block of every global batch
    def _mine(self):
        epoch, offset = divmod(self.consumed, self.per_epoch)
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        share = self.batch // self.world
        return [i for start in range(offset, self.per_epoch, self.batch)
                for i in order[start + self.rank * share:start + (self.rank + 1) * share]]


class IgnoresTheSeed(Sampler):  # a fixed seed of its own: reshuffled each epoch, the same for every seed
    def _mine(self):
        epoch, offset = divmod(self.consumed, self.per_epoch)
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(1234 + epoch)).tolist()
        return order[offset + self.rank:self.per_epoch:self.world]


class ShufflesOnlyTheKept(Sampler):  # randperm of the epoch's floor(N/G) x G: the last N mod G never train
    def _mine(self):
        epoch, offset = divmod(self.consumed, self.per_epoch)
        order = torch.randperm(self.per_epoch, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        return order[offset + self.rank:self.per_epoch:self.world]


SamplerStub = load("02_sampler.ipynb", "ResumableDistributedSampler", solved=False)
grade(check_sampler, Sampler, Blocked, SamplerStub, OnlyTheFirstEpoch, NeverReshuffles, GlobalRandom, IgnoresTheSeed,
      ShufflesOnlyTheKept)


def test_sampler_check(verdicts):
    v = verdicts
    assert v(check_sampler, Sampler).passed and v(check_sampler, Blocked).passed
    assert v(check_sampler, SamplerStub).message == \
        "not implemented yet: write ResumableDistributedSampler between the markers"
    assert "epoch 1 trained 0 samples: only the first epoch trains" in v(check_sampler, OnlyTheFirstEpoch).message
    assert "every epoch has the same global batches" in v(check_sampler, NeverReshuffles).message
    assert "another order" in v(check_sampler, GlobalRandom).message
    assert "another seed gave the same order: the shuffle must depend on the seed" in v(check_sampler, IgnoresTheSeed).message
    kept = v(check_sampler, ShufflesOnlyTheKept).message
    assert re.search(r"over 10 epochs of \d+ of the \d+ samples, \d+ \(e\.g\. sample \d+\) were never trained: which "
                     r"samples may an epoch leave out", kept) and len(kept) < 200, kept


def test_the_sampler_checks_sizes_and_resume_points_are_drawn_and_leave_no_right_sampler_out():
    """N, G and the resume point vary from draw to draw within the bounds the contract states, and for each
    drawn size a shuffle of all N samples (the solution's) trains every sample within the check's epochs:
    the rule that catches ShufflesOnlyTheKept above never rejects it."""
    import random

    from ddpkit.exercises.data import EPOCHS, draw

    drawn = [draw(random.Random(seed)) for seed in range(40)]
    assert len({(d["n"], d["batch"]) for d in drawn}) > 10 and len({d["resume_epoch"] for d in drawn}) > 3
    assert len({d["resume_batches"] for d in drawn}) > 2
    for d in drawn:
        n, g = d["n"], d["batch"]
        assert g % 12 == 0 and 1 <= n % g <= g // 3 and n // g >= 4 and 1 <= d["resume_batches"] < n // g
        assert n * (n % g / n) ** EPOCHS < 1e-8  # a right shuffle misses a sample in every epoch this rarely
        trained = set()
        for epoch in range(EPOCHS):
            order = torch.randperm(n, generator=torch.Generator().manual_seed(d["seed"] + epoch)).tolist()
            trained |= set(order[:n // g * g])
        assert trained == set(range(n)), d


# --------------------------------------------------------------------------- the train step

train_step = load("05_train_step.ipynb", "train_step")


def mistaken_step(ddp_model, optimizer, scaler, micro_batches, loss_fn, grad_clip, *, forward_in_no_sync=True,
                  divide=True, unscale_first=True, divisor=None):
    """The solution's step with one of its rules broken (each variant below breaks one)."""
    optimizer.zero_grad()
    n, losses = divisor or len(micro_batches), []  # a divisor written as a number: right for one grad_accum only
    for k, (x, y) in enumerate(micro_batches):
        sync = contextlib.nullcontext() if k == len(micro_batches) - 1 else ddp_model.no_sync()
        if forward_in_no_sync:
            with sync:
                loss = loss_fn(ddp_model(x), y) / (n if divide else 1)
                scaler.scale(loss).backward()
        else:
            loss = loss_fn(ddp_model(x), y) / n  # forward outside no_sync: DDP will all-reduce
            with sync:
                scaler.scale(loss).backward()
        losses.append(loss.item() * (n if divide else 1))
    if unscale_first:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), grad_clip)
    if not unscale_first:  # the clip acted on the scaled gradient
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return sum(losses) / len(losses)


backward_only_in_no_sync = functools.partial(mistaken_step, forward_in_no_sync=False)
not_divided = functools.partial(mistaken_step, divide=False)
clip_before_unscale = functools.partial(mistaken_step, unscale_first=False)
divides_by_4 = functools.partial(mistaken_step, divisor=4)  # the old check's grad_accum, hard-coded


def zero_grad_last(ddp_model, optimizer, scaler, micro_batches, loss_fn, grad_clip):
    loss = train_step(ddp_model, optimizer, scaler, micro_batches, loss_fn, grad_clip)
    optimizer.zero_grad()
    return loss


def never_zero_grad(ddp_model, optimizer, scaler, micro_batches, loss_fn, grad_clip):
    real = optimizer.zero_grad
    optimizer.zero_grad = lambda *args, **kwargs: None  # the step's own call does nothing: gradients pile up
    try:
        return train_step(ddp_model, optimizer, scaler, micro_batches, loss_fn, grad_clip)
    finally:
        optimizer.zero_grad = real


train_step_stub = load("05_train_step.ipynb", "train_step", solved=False)
grade(check_train_step, train_step, zero_grad_last, train_step_stub, backward_only_in_no_sync, not_divided,
      clip_before_unscale, never_zero_grad, divides_by_4)


def test_train_step_check(verdicts):
    v = verdicts
    assert v(check_train_step, train_step).passed and v(check_train_step, zero_grad_last).passed
    assert re.search(r"with [235] micro-batches on [23] ranks and [235] micro-batches on [23] ranks",
                     v(check_train_step, train_step).message), v(check_train_step, train_step).message
    assert v(check_train_step, train_step_stub).message.startswith("not implemented yet")
    assert re.match(r"([235]) all-reduces in one step with grad_accum \1: is the forward inside no_sync",
                    v(check_train_step, backward_only_in_no_sync).message)
    assert re.match(r"the update is ([235])x the big-batch one: the \1 micro-batches'", v(check_train_step, not_divided).message)
    assert "the clip saw the loss-scaled gradient" in v(check_train_step, clip_before_unscale).message
    assert "is anything left from the step before?" in v(check_train_step, never_zero_grad).message
    by_4 = v(check_train_step, divides_by_4).message  # grad_accum is never 4 now: a written 4 fails every run
    assert re.match(r"on [23] ranks with grad_accum ([235]) the update is \d\.\d\dx the big-batch one: does the loss's "
                    r"divisor follow the number of micro-batches", by_4) and len(by_4) < 200, by_4


def test_the_train_steps_runs_are_drawn_so_that_no_written_divisor_passes():
    """Every draw runs on 2 and on 3 ranks, each with its own grad_accum from {2, 3, 5}: a divisor written as
    a number equals at most one of them, so it fails the other (the unscaled run, or the scaled run's
    first step, whose clip does not bind: a binding clip would hide a wrong scale)."""
    from ddpkit.exercises.step import ACCUMS, plan

    plans = [plan() for _ in range(30)]
    for runs in plans:
        assert sorted(w for w, _, _ in runs) == [2, 3] and len({a for _, a, _ in runs}) == 2
        assert all(a in ACCUMS for _, a, _ in runs) and [s for _, _, s in runs] == [False, True]
    assert len({tuple(runs) for runs in plans}) > 3


# --------------------------------------------------------------------------- the ring

ring_all_reduce = load("09_ring_all_reduce.ipynb", "ring_all_reduce")


def gather_on_rank_0(tensor):  # the right sum, the wrong traffic
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        for peer in range(1, world):
            incoming = torch.empty_like(tensor)
            dist.recv(incoming, src=peer)
            tensor += incoming
        for peer in range(1, world):
            dist.send(tensor, dst=peer)
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)


def with_a_collective(tensor):
    dist.all_reduce(tensor)


def raises_on_rank_1(tensor):
    if dist.get_rank() == 1:
        raise ValueError("an off-by-one on rank 1")
    ring_all_reduce(tensor)


def with_autograds_all_reduce(tensor):  # torch's collective with autograd, from torch.distributed.nn
    from torch.distributed.nn.functional import all_reduce

    tensor.copy_(all_reduce(tensor))


def _float32_ring(tensor, carry):
    """The solution's ring with float32 buffers (``carry=False``: received in float32, whatever the tensor) or
    with float32 messages too (``carry=True``: sent as float32 and added back in the tensor's dtype)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = list(torch.tensor_split(tensor, world))
    right, left = (rank + 1) % world, (rank - 1) % world

    def exchange(send_index, recv_index):
        incoming = torch.empty(chunks[recv_index].numel())  # float32: the default dtype
        out = chunks[send_index].float() if carry else chunks[send_index].contiguous()
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, right), dist.P2POp(dist.irecv, incoming, left)]):
            work.wait()
        return incoming.to(tensor.dtype) if carry else incoming

    for step in range(world - 1):
        i = (rank - step - 1) % world
        chunks[i] += exchange((rank - step) % world, i)
    for step in range(world - 1):
        i = (rank - step) % world
        chunks[i].copy_(exchange((rank - step + 1) % world, i))


def float32_buffers(tensor):
    _float32_ring(tensor, carry=False)


def float32_messages(tensor):
    _float32_ring(tensor, carry=True)


def every_rank_sends_first(tensor):  # blocking send, then receive, on every rank: gloo's send waits for its receive
    world, rank = dist.get_world_size(), dist.get_rank()
    incoming = torch.empty_like(tensor)
    dist.send(tensor.contiguous(), (rank + 1) % world)
    dist.recv(incoming, (rank - 1) % world)
    tensor += incoming


ring_stub = load("09_ring_all_reduce.ipynb", "ring_all_reduce", solved=False)
grade(check_ring_all_reduce, ring_all_reduce, ring_stub, gather_on_rank_0, with_a_collective, raises_on_rank_1,
      with_autograds_all_reduce, float32_buffers, float32_messages, every_rank_sends_first)


def test_ring_check(verdicts):  # a rank that hangs inside the ring: tests/test_grading.py's room (eve)
    v = verdicts
    assert v(check_ring_all_reduce, ring_all_reduce).passed
    assert "and for float64 and int64 tensors" in v(check_ring_all_reduce, ring_all_reduce).message
    assert v(check_ring_all_reduce, ring_stub).message.startswith("not implemented yet")
    assert "does one rank collect or send the whole tensor?" in v(check_ring_all_reduce, gather_on_rank_0).message
    assert "calls dist.all_reduce, a collective" in v(check_ring_all_reduce, with_a_collective).message
    assert v(check_ring_all_reduce, raises_on_rank_1).message.startswith("rank 1 raised ValueError: an off-by-one on rank 1")
    assert v(check_ring_all_reduce, with_autograds_all_reduce).message.startswith(
        "ring_all_reduce calls torch.distributed.nn.functional.all_reduce, a collective with autograd: build the sum")


def test_ring_check_tries_the_dtypes_the_contract_names(verdicts):
    """float32 passes in both variants; float64 (values near 2^40) shows buffers and messages kept in float32."""
    v = verdicts
    buffers, messages = v(check_ring_all_reduce, float32_buffers).message, v(check_ring_all_reduce, float32_messages).message
    assert buffers.startswith("with float64 tensors on 3 ranks (float32 ones sum right): ") and \
        buffers.endswith("are the receive buffers of the tensor's dtype?"), buffers
    assert re.match(r"on 3 ranks a float64 tensor of length \d+: rank \d's result differs from the sum, where float32 ones "
                    r"sum right: is every value carried in the tensor's own dtype\?", messages), messages
    assert len(buffers) <= 200 and len(messages) <= 200


def test_a_deadlocking_ring_is_told_as_a_deadlock_not_in_gloos_words(verdicts):
    """Every rank's blocking send waits for a receive no rank posts: gloo's timeouts ("unbound_buffer.cc:129
    Timed out waiting 5000ms for send op") reach the learner as one sentence about sends and receives."""
    said = verdicts(check_ring_all_reduce, every_rank_sends_first).message
    assert re.match(r"deadlock: ranks? [\d, and]+ waited \d+ s in a send that no peer received", said), said
    assert "a send waits" in said and "matching receive" in said and ".cc" not in said and len(said) <= 200, said


def _ring_with(exchange):
    """A ring all-reduce whose every step's message goes through ``exchange(out, into, right, left, rank)``."""
    def ring(tensor):
        world, rank = dist.get_world_size(), dist.get_rank()
        chunks = list(torch.tensor_split(tensor, world))
        right, left = (rank + 1) % world, (rank - 1) % world
        for step in range(world - 1):
            i = (rank - step - 1) % world
            incoming = torch.empty_like(chunks[i])
            exchange(chunks[(rank - step) % world].contiguous(), incoming, right, left, rank)
            chunks[i] += incoming
        for step in range(world - 1):
            i = (rank - step) % world
            incoming = torch.empty_like(chunks[i])
            exchange(chunks[(rank - step + 1) % world].contiguous(), incoming, right, left, rank)
            chunks[i].copy_(incoming)
    return ring


def _by_parity(out, into, right, left, rank):  # the hint's second way: even ranks send first, odd ranks receive first
    if rank % 2 == 0:
        dist.send(out, right)
        dist.recv(into, left)
    else:
        dist.recv(into, left)
        dist.send(out, right)


def _isend_then_recv(out, into, right, left, rank):  # every rank sends first: gloo buffers it, NCCL need not
    work = dist.isend(out, right)
    dist.recv(into, left)
    work.wait()


def _ring_replayed(ctx, ring):
    from ddpkit.parallel.rendezvous import recorded

    t = torch.arange(10.0) + ctx.rank
    run = recorded(ctx, lambda ctx: ring(t))
    return {"ops": run["ops"], "sum": t}


def test_the_rings_hint_holds_under_nccls_rendezvous_rule():
    """The hint's two ways (one batch per step, or sends and receives ordered by parity) complete when a
    send waits for its receive (NCCL's rule, replayed by ddpkit.parallel.rendezvous); every rank sending
    first deadlocks there, though gloo, which buffers sends, runs it."""
    from ddpkit.launch import launch
    from ddpkit.parallel.rendezvous import Deadlock, check

    want = sum(torch.arange(10.0) + r for r in range(3))
    for ring in (ring_all_reduce, _ring_with(_by_parity)):
        runs = launch(_ring_replayed, ring, world_size=3, backend="gloo", output="none", progress="off")
        assert all(torch.equal(r["sum"], want) for r in runs) and check(runs) > 0
    runs = launch(_ring_replayed, _ring_with(_isend_then_recv), world_size=3, backend="gloo", output="none", progress="off")
    assert all(torch.equal(r["sum"], want) for r in runs)  # right on gloo
    with pytest.raises(Deadlock):
        check(runs)


# --------------------------------------------------------------------------- ZeRO-1

ZeroAdamW = load("10_zero1.ipynb", "ZeroAdamW")


class NoAllGather(ZeroAdamW):  # each rank updates its shard, and the others never hear of it
    def step(self):
        grads = torch.cat([p.grad.reshape(-1) for p in self.params])
        padded = torch.zeros(self.shard * self.world)
        padded[:grads.numel()] = grads
        shard = torch.empty(self.shard)
        dist.reduce_scatter_tensor(shard, padded)
        self.master.grad = shard / self.world
        self.inner.step()
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in self.params])
            flat[self.lo:self.lo + self.shard] = self.master.detach()[:max(0, min(self.shard, flat.numel() - self.lo))]
            offset = 0
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


class SumNotMean(ZeroAdamW):
    def step(self):
        for p in self.params:
            p.grad.mul_(self.world)  # as if the reduce-scatter's sum were used without dividing
        super().step()


class WholeState:  # correct parameters, but every rank keeps AdamW's whole state
    def __init__(self, params, lr, betas, eps, weight_decay):
        self.params = list(params)
        self.inner = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.inner.step()

    def zero_grad(self):
        self.inner.zero_grad()


SHADOW = {}  # a module global: where a cheat hides AdamW's whole state


class HiddenWholeState(ZeroAdamW):  # correct updates from the shards, and a full AdamW kept aside
    def step(self):
        if "adam" not in SHADOW:
            SHADOW["params"] = [p.detach().clone().requires_grad_(True) for p in self.params]
            SHADOW["adam"] = torch.optim.AdamW(SHADOW["params"])
        for shadow, p in zip(SHADOW["params"], self.params):
            shadow.grad = p.grad.clone()
        SHADOW["adam"].step()
        super().step()


class KeepsItsBuffers(ZeroAdamW):  # keeps the padded gradients and the all-gather output between steps
    def step(self):
        grads = torch.cat([p.grad.reshape(-1) for p in self.params])
        self.padded = torch.zeros(self.shard * self.world)
        self.padded[:grads.numel()] = grads
        super().step()
        self.everything = torch.cat([p.detach().reshape(-1) for p in self.params])


class WholeParameters:  # CS336's design: each rank owns whole parameters, round robin, and their AdamW
    def __init__(self, params, lr, betas, eps, weight_decay):
        self.params, self.world, self.rank = list(params), dist.get_world_size(), dist.get_rank()
        self.owner = [i % self.world for i in range(len(self.params))]
        mine = [p for p, o in zip(self.params, self.owner) if o == self.rank]
        self.inner = torch.optim.AdamW(mine, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= self.world
        self.inner.step()
        for p, owner in zip(self.params, self.owner):
            dist.broadcast(p.data, src=owner)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class TorchsZeroRedundancy:  # torch's ZeRO-1, the feature the exercise rebuilds, behind the contract's name
    def __init__(self, params, lr, betas, eps, weight_decay):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.params = list(params)
        self.inner = ZeroRedundancyOptimizer(self.params, optimizer_class=torch.optim.AdamW, lr=lr, betas=betas,
                                             eps=eps, weight_decay=weight_decay)

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.inner.step()

    def zero_grad(self):
        self.inner.zero_grad()


ZeroStub = load("10_zero1.ipynb", "ZeroAdamW", solved=False)
grade(check_zero1, TorchsZeroRedundancy)
grade(check_zero1, ZeroAdamW, ZeroStub, NoAllGather, SumNotMean, WholeState, HiddenWholeState, KeepsItsBuffers,
      WholeParameters)  # a whole AdamW kept in a closure: tests/test_grading.py's BYPASSES


def test_zero1_check(verdicts):
    v = verdicts
    assert v(check_zero1, ZeroAdamW).passed
    assert v(check_zero1, ZeroStub).message.startswith("not implemented yet")
    assert "must all-gather the updated shards" in v(check_zero1, NoAllGather).message
    assert "differ from DDP + AdamW" in v(check_zero1, SumNotMean).message
    assert "on 4 ranks a rank keeps 1.0" in v(check_zero1, WholeState).message
    assert "on 4 ranks a rank keeps" in v(check_zero1, HiddenWholeState).message
    assert v(check_zero1, KeepsItsBuffers).passed, "a kept all-gather buffer is a layout, not optimizer state"
    assert v(check_zero1, WholeParameters).passed, "CS336's parameter-granular ZeRO-1 is right too"
    assert v(check_zero1, TorchsZeroRedundancy).message == "ZeroAdamW uses torch's ZeroRedundancyOptimizer, the feature " \
        "this exercise rebuilds: shard the state yourself", v(check_zero1, TorchsZeroRedundancy).message


# --------------------------------------------------------------------------- the checkpoint

save_fn, load_fn = load("06_checkpoint.ipynb", "save_fn", "load_fn")


def save_in_place(state, root, step):
    import os

    os.makedirs(root, exist_ok=True)
    torch.save(state, os.path.join(root, f"step-{step:08d}.pt"))  # straight to the final name


def save_without_fsync(state, root, step):
    import os

    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step-{step:08d}.pt")
    torch.save(state, final + ".tmp")
    os.replace(final + ".tmp", final)  # atomic, but the bytes may still be in the page cache


def save_without_rng(state, root, step):
    save_fn({k: v for k, v in state.items() if k != "rng"}, root, step)


stub_save, stub_load = load("06_checkpoint.ipynb", "save_fn", "load_fn", solved=False)
grade(check_checkpoint, (save_fn, load_fn), (stub_save, stub_load), (save_in_place, load_fn),
      (save_without_fsync, load_fn), (save_without_rng, load_fn))


def test_checkpoint_check(verdicts):
    v = verdicts
    assert v(check_checkpoint, save_fn, load_fn).passed
    assert v(check_checkpoint, stub_save, stub_load).message.startswith("not implemented yet")
    torn = v(check_checkpoint, save_in_place, load_fn)
    assert "a torn file under a final name?" in torn.message, torn.message
    assert "renamed into place before its bytes were forced to disk" in v(check_checkpoint, save_without_fsync, load_fn).message
    assert "without its 'rng' entry intact" in v(check_checkpoint, save_without_rng, load_fn).message


# --------------------------------------------------------------------------- the smaller ones


SALTED = """import json


def config_digest(config):
    return str(hash(json.dumps(config, sort_keys=True)))
"""
KEY_ORDER = """import hashlib
import json


def config_digest(config):
    return hashlib.sha256(json.dumps(config).encode()).hexdigest()
"""
KEYS_ONLY = """import hashlib


def config_digest(config):
    return hashlib.sha256(",".join(sorted(config)).encode()).hexdigest()
"""
WITH_A_HELPER = """import hashlib
import json as js  # an alias, and a helper the function needs: the fresh process must run this module


def _canonical(config):
    return js.dumps(config, sort_keys=True, separators=(",", ":"))


def config_digest(config):
    return hashlib.sha256(_canonical(config).encode()).hexdigest()
"""
from ddpkit.exercises.config import check_config_digest  # noqa: E402

config_digest = load("01_config_digest.ipynb", "config_digest")
grade(check_config_digest, config_digest)
for _name, _code in (("salted", SALTED), ("key_order", KEY_ORDER), ("keys_only", KEYS_ONLY), ("with_a_helper", WITH_A_HELPER)):
    grade_code(check_config_digest, _name, _code)


def test_config_digest_check(verdicts):  # the second process runs the module the grader ran, helpers included
    v = verdicts
    assert v(check_config_digest, config_digest).passed
    assert v(check_config_digest, "with_a_helper").passed, v(check_config_digest, "with_a_helper")
    assert "hash() is salted per process" in v(check_config_digest, "salted").message
    assert "another key order got another digest" in v(check_config_digest, "key_order").message
    assert "changing lr from 0.001 to 0.002 did not change the digest" in v(check_config_digest, "keys_only").message


def no_broadcast(model):
    pass


def broadcast_from_1(model):
    for p in model.parameters():
        dist.broadcast(p.data, src=1)


from ddpkit.exercises.init import check_broadcast_parameters  # noqa: E402

broadcast_parameters = load("04_broadcast_parameters.ipynb", "broadcast_parameters")
grade(check_broadcast_parameters, broadcast_parameters, no_broadcast, broadcast_from_1)


def test_broadcast_parameters_check(verdicts):
    v = verdicts
    assert v(check_broadcast_parameters, broadcast_parameters).passed
    assert "rank 1 kept its own parameters" in v(check_broadcast_parameters, no_broadcast).message
    assert "rank 0 ended with rank 1's parameters, not rank 0's" in v(check_broadcast_parameters, broadcast_from_1).message


def mean_of_means(loss_sum, count):
    mean = torch.tensor([loss_sum / count], dtype=torch.float64)
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def local_only(loss_sum, count):
    return loss_sum / count


def a_constant(loss_sum, count):  # the value the old check printed
    return 0.8


from ddpkit.exercises.metrics import check_global_mean_loss  # noqa: E402

global_mean_loss = load("07_global_mean_loss.ipynb", "global_mean_loss")
grade(check_global_mean_loss, global_mean_loss, mean_of_means, local_only, a_constant)


def test_global_mean_loss_check(verdicts):
    v = verdicts
    assert v(check_global_mean_loss, global_mean_loss).passed
    assert "the mean of the ranks' means" in v(check_global_mean_loss, mean_of_means).message
    assert "the ranks report different losses" in v(check_global_mean_loss, local_only).message
    assert "is not the mean over all samples" in v(check_global_mean_loss, a_constant).message


f_solution, g_solution = load("12_f_and_g.ipynb", "copy_to_parallel", "reduce_from_parallel")


def identity(x):
    return x


from ddpkit.exercises.tensor import check_f_and_g  # noqa: E402

grade(check_f_and_g, (f_solution, g_solution), (identity, g_solution), (f_solution, identity))


def test_f_and_g_check(verdicts):
    v = verdicts
    assert v(check_f_and_g, f_solution, g_solution).passed
    assert "the input's gradient differs from the whole MLP's" in v(check_f_and_g, identity, g_solution).message
    assert "what does backward do at f?" in v(check_f_and_g, identity, g_solution).message
    assert "where do the partial sums meet?" in v(check_f_and_g, f_solution, identity).message


def gpipe(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


def backward_first(p, m):
    return [[("B", i) for i in range(m)] + [("F", i) for i in range(m)] for _ in range(p)]


from ddpkit.exercises.pipeline import check_one_f_one_b  # noqa: E402

one_f_one_b = load("13_one_f_one_b.ipynb", "one_f_one_b")
class _RecordingStage:  # what torch's Schedule1F1B drives: here it only writes down the order asked of it
    def __init__(self, stage, p, order):
        self.stage_index, self.num_stages, self.order = stage, p, order
        self.is_first, self.is_last = stage == 0, stage == p - 1

    def forward_one_chunk(self, micro, *args, **kwargs):
        self.order.append(("F", micro))

    def backward_one_chunk(self, micro, **kwargs):
        self.order.append(("B", micro))

    def __getattr__(self, name):  # the sends, receives, losses and reductions: nothing to do
        return lambda *args, **kwargs: []


def torchs_schedule(p, m):  # the order read off torch's Schedule1F1B, run on stages that only record it
    from torch.distributed.pipelining.schedules import Schedule1F1B

    orders = []
    for s in range(p):
        order = []
        Schedule1F1B(_RecordingStage(s, p, order), max(m, p))._step_microbatches([()] * m, [{}] * m)
        orders.append(order)
    return orders


grade(check_one_f_one_b, one_f_one_b, gpipe, backward_first, torchs_schedule)


def test_one_f_one_b_check(verdicts):
    v = verdicts
    assert v(check_one_f_one_b, one_f_one_b).passed
    assert "holds at most p - s" in v(check_one_f_one_b, gpipe).message
    assert "deadlocks" in v(check_one_f_one_b, backward_first).message
    assert v(check_one_f_one_b, torchs_schedule).message == "one_f_one_b uses torch's Schedule1F1B, the schedule this " \
        "exercise asks for: order the actions yourself", v(check_one_f_one_b, torchs_schedule).message


# --------------------------------------------------------------------------- interleaved 1F1B (lesson 13)

from ddpkit.exercises.interleaved import FIXED, check_interleaved_order  # noqa: E402

interleaved_order = load("13b_interleaved_order.ipynb", "interleaved_order")


def plain_1f1b(rank, p, v, m):  # 1F1B's warm-up, each micro-batch through the rank's chunks in turn
    chunks = [rank + j * p for j in range(v)]
    warm = min(p - 1 - rank, m)
    order = [("F", c, i) for i in range(warm) for c in chunks]
    for i in range(warm, m):
        order += [("F", c, i) for c in chunks] + [("B", c, i - warm) for c in reversed(chunks)]
    return order + [("B", c, i) for i in range(m - warm, m) for c in reversed(chunks)]


def own_chunk_only(rank, p, v, m):  # 1F1B on chunk `rank`, as if v were 1
    warm = min(p - 1 - rank, m)
    order = [("F", rank, i) for i in range(warm)]
    for i in range(warm, m):
        order += [("F", rank, i), ("B", rank, i - warm)]
    return order + [("B", rank, i) for i in range(m - warm, m)]


def backwards_first_to_last(rank, p, v, m):  # the backwards visit the chunks in the forwards' order
    order, seen, k = [], {}, 0
    per_round = m // max(1, m // p)
    for kind, chunk, micro in interleaved_order(rank, p, v, m):
        if kind == "B":
            chunk, k = ((k // per_round) % v) * p + rank, k + 1
            seen[chunk] = seen.get(chunk, 0) + 1
            micro = seen[chunk] - 1
        order.append((kind, chunk, micro))
    return order


def micro_batch_first(rank, p, v, m):  # each micro-batch through every chunk of the rank before the next one
    forwards = iter([(rank + j * p, i) for i in range(m) for j in range(v)])
    return [("F", *next(forwards)) if kind == "F" else (kind, c, i) for kind, c, i in interleaved_order(rank, p, v, m)]


def one_more_warmup_forward(rank, p, v, m):  # the same bubble, one more micro-batch's activations held
    order = interleaved_order(rank, p, v, m)
    first_backward = next(k for k, action in enumerate(order) if action[0] == "B")
    if first_backward + 1 < len(order) and order[first_backward + 1][0] == "F":  # the next forward moves before it
        order[first_backward], order[first_backward + 1] = order[first_backward + 1], order[first_backward]
    return order


def a_table_of_the_fixed_shapes(rank, p, v, m):  # right where the shapes can be read in the check, wrong elsewhere
    return interleaved_order(rank, p, v, m) if (p, v, m) in FIXED else own_chunk_only(rank, p, v, m)


def torchs_own(rank, p, v, m):  # the answer read off torch's class, the schedule the exercise asks for
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    rounds = max(1, m // p)
    state = SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m, microbatches_per_round=m // rounds,
                            number_of_rounds=rounds, num_stages=p * v)
    ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(state, rank)
    return [(str(a.computation_type.value), a.stage_index, a.microbatch_index) for a in ops if a is not None]


grade(check_interleaved_order, interleaved_order, plain_1f1b, own_chunk_only, backwards_first_to_last, micro_batch_first,
      one_more_warmup_forward, a_table_of_the_fixed_shapes, torchs_own)


def test_interleaved_order_check(verdicts):
    v = verdicts
    assert v(check_interleaved_order, interleaved_order).passed
    assert "the ranks deadlock after rank 0's 4 forwards before its first backward" in v(check_interleaved_order, plain_1f1b).message
    assert "rank 0 runs chunks [0], but it holds [0, 2]" in v(check_interleaved_order, own_chunk_only).message
    assert "rank 0's first backward is on chunk 0, whose gradient needs that of chunk 2" in \
        v(check_interleaved_order, backwards_first_to_last).message
    assert "of the ideal compute time, not (p-1)/(v m)" in v(check_interleaved_order, micro_batch_first).message
    assert "holds 3 micro-batches' activations at once, ScheduleInterleaved1F1B's order 2.5: same bubble, more memory" in \
        v(check_interleaved_order, one_more_warmup_forward).message  # the bubble alone would pass it: torch's order does not
    table = v(check_interleaved_order, a_table_of_the_fixed_shapes).message
    assert "but it holds" in table and not any(f"p={p}, v={w}, m={m} " in table for p, w, m in FIXED), table
    assert "uses torch's ScheduleInterleaved1F1B" in v(check_interleaved_order, torchs_own).message
    wrong = (plain_1f1b, own_chunk_only, backwards_first_to_last, micro_batch_first, one_more_warmup_forward,
             a_table_of_the_fixed_shapes)
    assert all(len(v(check_interleaved_order, fn).message) < 200 for fn in wrong)


def test_an_order_runs_for_real_on_two_ranks_and_a_deadlocking_one_hangs_there():
    """What the 13b check runs before its clock: torch's order gives the whole model's gradients on 2 gloo
    ranks; plain 1F1B's order (the negative control) leaves both ranks waiting, given up on within seconds."""
    from ddpkit.exercises import Result, run_on_ranks, schedule_run
    from ddpkit.parallel import pipeline_schedules as schedules

    p, v, m = 2, 2, 4
    right = [[(a.kind, a.stage, a.micro) for a in order] for order in schedules.torch_order("interleaved", p, m, v)]
    runs = run_on_ranks("order", schedule_run.run, [(p, v, m)], [right], 7, world_size=2, idle_after=1.5)
    want = schedule_run.expected_grads(p, v, m, 7)
    assert all(torch.allclose(g, w, atol=1e-5) for run in runs for c, grads in run[0].items() for g, w in zip(grads, want[c]))
    started = time.monotonic()
    hung = run_on_ranks("order", schedule_run.run, [(p, v, m)], [[plain_1f1b(r, p, v, m) for r in range(p)]], 7,
                        world_size=2, idle_after=1.5)
    assert isinstance(hung, Result) and "hung" in hung.message, hung
    assert time.monotonic() - started < 15


def test_the_drawn_shapes_are_torchs_and_the_paper_bubble_holds_on_each():
    """The shapes the check draws are ones torch's schedule accepts, and on each the order torch gives meets
    (p-1)/(v m) exactly on the simulator, so the check never asks for the impossible."""
    import random

    from ddpkit.exercises.interleaved import shapes
    from ddpkit.parallel import pipeline_schedules as schedules

    for seed in range(5):
        for p, v, m in shapes(random.Random(seed))[len(FIXED):]:
            timeline = schedules.simulate(schedules.torch_order("interleaved", p, m, v))
            assert abs(schedules.bubble_over_ideal(timeline) - schedules.megatron_bubble(p, m, v)) < 1e-9, (p, v, m)


def decides_alone(noticed):
    return noticed


from ddpkit.exercises.agreement import check_should_stop  # noqa: E402

should_stop = load("14_should_stop.ipynb", "should_stop")
grade(check_should_stop, should_stop, decides_alone)


def test_should_stop_check(verdicts):
    assert verdicts(check_should_stop, should_stop).passed
    assert "decided to stop and the others did not" in verdicts(check_should_stop, decides_alone).message


state_bytes = load("03_state_bytes.ipynb", "state_bytes")


def floor_shards(params, strategy, world):
    import math

    return {k: v if v == state_bytes(params, "ddp", world)[k] else v // math.ceil(params / world) * (params // world)
            for k, v in state_bytes(params, strategy, world).items()}


def stage1_shards_gradients(params, strategy, world):
    out = state_bytes(params, strategy, world)
    return {**out, "grads": state_bytes(params, "zero2", world)["grads"]} if strategy == "zero1" else out


from ddpkit.exercises.memory import check_state_bytes  # noqa: E402

grade(check_state_bytes, state_bytes, stage1_shards_gradients, floor_shards)


def test_state_bytes_check(verdicts):
    v = verdicts
    assert v(check_state_bytes, state_bytes).passed
    assert "zero1 with 1,000 parameters on 4 ranks: the gradients per rank are wrong" in \
        v(check_state_bytes, stage1_shards_gradients).message
    assert "1,001 parameters on 4 ranks" in v(check_state_bytes, floor_shards).message


def unpadded_split(files, rank, world, numel):
    whole = torch.cat([torch.load(f, weights_only=True) for f in files])[:numel]
    return torch.tensor_split(whole, world)[rank]  # shards of unequal length, the last one unpadded


def old_shard_per_rank(files, rank, world, numel):
    return torch.load(files[rank], weights_only=True)


from ddpkit.exercises.resharding import check_load_shard  # noqa: E402

load_shard = load("11_load_shard.ipynb", "load_shard")
grade(check_load_shard, load_shard, unpadded_split, old_shard_per_rank)


def test_load_shard_check(verdicts):
    v = verdicts
    assert v(check_load_shard, load_shard).passed
    assert "rank 1's shard has 500 elements, not ceil(1001/2) = 501: how long is every new shard" in v(check_load_shard, unpadded_split).message
    assert "rank 0's shard has 251 elements, not ceil(1001/2) = 501" in v(check_load_shard, old_shard_per_rank).message


def norms_agree(model):
    norm = torch.sqrt(sum(p.detach().pow(2).sum() for p in model.parameters())).reshape(1)
    low, high = norm.clone(), norm.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(low == high)


from ddpkit.exercises.invariants import check_same_everywhere  # noqa: E402

same_everywhere = load("15_same_everywhere.ipynb", "same_everywhere")
grade(check_same_everywhere, same_everywhere, norms_agree)


def test_same_everywhere_check(verdicts):
    assert verdicts(check_same_everywhere, same_everywhere).passed
    assert "a norm or a sum cannot see it" in verdicts(check_same_everywhere, norms_agree).message


NaiveDDP, OverlapDDP, BucketedDDP = load("05_ddp_from_scratch.ipynb", "NaiveDDP", "OverlapDDP", "BucketedDDP")


class AllReduceAtTheEnd(BucketedDDP):  # correct gradients, no overlap
    def _gradient_ready(self, p):
        pass

    def finish(self):
        for i, bucket in enumerate(self.buckets):
            flat = torch.cat([q.grad.reshape(-1) for q in bucket]).div_(self.world)
            self.pending.append((i, flat, dist.all_reduce(flat, async_op=True)))
        super().finish()


class NoBroadcast(BucketedDDP):
    def __init__(self, module, bucket_bytes):
        real = dist.broadcast
        dist.broadcast = lambda *args, **kwargs: None
        try:
            super().__init__(module, bucket_bytes)
        finally:
            dist.broadcast = real


class BlockingBuckets(BucketedDDP):
    def _gradient_ready(self, p):
        i = self.bucket_of[id(p)]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]]).div_(self.world)
            dist.all_reduce(flat)  # blocks backward until it is done
            self.pending.append((i, flat, type("Done", (), {"wait": lambda self: None})()))


class WaitsAtOnce(OverlapDDP):  # async_op=True, then waited for inside the hook: nothing overlaps
    def _gradient_ready(self, p):
        super()._gradient_ready(p)
        self.pending[-1].wait()


class WaitsOnTheFuture(OverlapDDP):  # the same wait, through the work's future
    def _gradient_ready(self, p):
        super()._gradient_ready(p)
        self.pending[-1].get_future().wait()


class PollsUntilDone(OverlapDDP):  # the same wait again, by polling
    def _gradient_ready(self, p):
        super()._gradient_ready(p)
        while not self.pending[-1].is_completed():
            time.sleep(0.0005)


class IgnoresBucketBytes(OverlapDDP):  # one all-reduce per parameter, whatever bucket_bytes says
    def __init__(self, module, bucket_bytes):
        super().__init__(module)


class DividesByTwo(NaiveDDP):  # right on 2 ranks only
    def finish(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad.div_(2)


class TorchInside(torch.nn.Module):  # torch's DDP, with a comm hook, behind the contract's name
    def __init__(self, module):
        super().__init__()
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.inner = torch.nn.parallel.DistributedDataParallel(module)
        self.inner.register_comm_hook(None, allreduce_hook)

    def forward(self, *args):
        return self.inner(*args)

    def finish(self):
        pass


class NeverAllReduces(NaiveDDP):  # broadcasts, then each rank steps on its own gradient
    def finish(self):
        pass


class SumsNotAverages(NaiveDDP):
    def finish(self):
        for p in self.params:
            dist.all_reduce(p.grad)


class NaiveNoBroadcast(NaiveDDP):  # the same final symptom as NeverAllReduces, another cause
    def __init__(self, module):
        real = dist.broadcast
        dist.broadcast = lambda *args, **kwargs: None
        try:
            super().__init__(module)
        finally:
            dist.broadcast = real


class TiedWeightTwice(NaiveDDP):  # each module's own parameters: the weight two layers share is listed twice
    def __init__(self, module):
        super().__init__(module)
        self.params = [p for m in module.modules() for p in m.parameters(recurse=False) if p.requires_grad]


class FrozenToo(NaiveDDP):  # every parameter, the frozen one (no gradient) included
    def __init__(self, module):
        super().__init__(module)
        self.params = list(module.parameters())


class FrozenInABucket(BucketedDDP):  # the frozen parameter's bucket waits for a gradient that never comes
    def __init__(self, module, bucket_bytes):
        frozen = [p for p in module.parameters() if not p.requires_grad]
        for p in frozen:
            p.requires_grad_(True)  # as if the wrapper bucketed module.parameters() whatever they require
        try:
            super().__init__(module, bucket_bytes)
        finally:
            for p in frozen:
                p.requires_grad_(False)


class PlainTorchDDP(torch.nn.Module):  # torch's DDP, no comm hook: its reducer does everything
    def __init__(self, module, bucket_bytes=None):
        super().__init__()
        self.inner = torch.nn.parallel.DistributedDataParallel(module)

    def forward(self, *args):
        return self.inner(*args)

    def finish(self):
        pass


class TorchReplicate(torch.nn.Module):  # torch's composable replicate (DDP underneath)
    def __init__(self, module, bucket_bytes=None):
        super().__init__()
        from torch.distributed._composable.replicate import replicate

        self.inner = replicate(module)

    def forward(self, *args):
        return self.inner(*args)

    def finish(self):
        pass


from ddpkit.exercises.ddp import check_bucketed_ddp, check_naive_ddp, check_overlap_ddp  # noqa: E402

HAS_REPLICATE = importlib.util.find_spec("torch.distributed._composable.replicate") is not None
TORCHS_OWN = (PlainTorchDDP, TorchReplicate) if HAS_REPLICATE else (PlainTorchDDP,)
grade(check_naive_ddp, NaiveDDP, DividesByTwo, TorchInside, NeverAllReduces, SumsNotAverages, NaiveNoBroadcast,
      TiedWeightTwice, FrozenToo, *TORCHS_OWN)
grade(check_overlap_ddp, OverlapDDP, WaitsAtOnce, WaitsOnTheFuture, PollsUntilDone, *TORCHS_OWN)
grade(check_bucketed_ddp, BucketedDDP, IgnoresBucketBytes, AllReduceAtTheEnd, NoBroadcast, BlockingBuckets,
      FrozenInABucket, *TORCHS_OWN)


def test_ddp_from_scratch_checks(verdicts):
    v = verdicts
    assert v(check_naive_ddp, NaiveDDP).passed
    assert v(check_overlap_ddp, OverlapDDP).passed
    assert v(check_bucketed_ddp, BucketedDDP).passed
    assert "divided by the number of ranks, whatever it is" in v(check_naive_ddp, DividesByTwo).message
    assert "runs torch's DistributedDataParallel" in v(check_naive_ddp, TorchInside).message
    assert "waited on while backward ran" in v(check_overlap_ddp, WaitsAtOnce).message
    assert "waited on while backward ran" in v(check_overlap_ddp, WaitsOnTheFuture).message
    assert "waited on while backward ran" in v(check_overlap_ddp, PollsUntilDone).message
    assert "fill each bucket to bucket_bytes" in v(check_bucketed_ddp, IgnoresBucketBytes).message


def test_ddp_from_scratch_bucketed_mistakes(verdicts):
    v = verdicts
    assert "were launched while backward ran" in v(check_bucketed_ddp, AllReduceAtTheEnd).message
    assert "start from rank 0's weights" in v(check_bucketed_ddp, NoBroadcast).message
    assert "waited on while backward ran" in v(check_bucketed_ddp, BlockingBuckets).message


def test_ddp_from_scratch_tells_a_missing_broadcast_from_a_missing_all_reduce(verdicts):
    """Both end with replicas that differ; the parameters right after construction tell them apart, and
    a sum shows as a step of world-times the length along the averaged gradient's direction."""
    v = verdicts
    no_broadcast = v(check_naive_ddp, NaiveNoBroadcast).message
    never = v(check_naive_ddp, NeverAllReduces).message
    summed = v(check_naive_ddp, SumsNotAverages).message
    assert no_broadcast == "on 2 ranks, right after NaiveDDP(model) returned, rank 1 held other parameters than rank 0: " \
                           "do all replicas start from rank 0's weights?", no_broadcast
    assert never.startswith("on 2 ranks rank 1 started with rank 0's parameters but differed from them after step 1: "
                            "do the ranks step on the same gradient?"), never
    assert summed == "on 2 ranks the parameters moved 2x as far as averaging the ranks' gradients would: a sum over " \
                     "the ranks where a mean belongs", summed
    assert all(len(m) < 200 for m in (no_broadcast, never, summed))


def test_ddp_from_scratch_catches_a_mishandled_frozen_or_tied_parameter(verdicts):
    """The model has a frozen bias (no gradient) and a weight two layers share: listing the shared weight
    twice sends its gradient twice (the parameters still come out right: the bytes show it); reducing
    the frozen one's None gradient, or waiting for it in a bucket, is told as such."""
    v = verdicts
    tied = v(check_naive_ddp, TiedWeightTwice).message
    frozen = v(check_naive_ddp, FrozenToo).message
    bucket = v(check_bucketed_ddp, FrozenInABucket).message
    assert re.match(r"on 2 ranks one step all-reduced [\d,]+ bytes, but the gradients hold [\d,]+: is some gradient "
                    r"sent twice", tied), tied
    assert frozen == "finish() raised TypeError on a gradient that is None: which parameters have no gradient after " \
                     "backward?", frozen
    assert re.match(r"on 2 ranks a step all-reduced [\d,]+ of the [\d,]+ gradient bytes: is a bucket waiting for a "
                    r"gradient that never comes\?", bucket), bucket


@pytest.mark.parametrize("check", [check_naive_ddp, check_overlap_ddp, check_bucketed_ddp], ids=lambda c: c.check)
def test_ddp_from_scratch_refuses_torchs_ddp_and_replicate_in_every_stage(verdicts, check):
    """Torch's DDP without a comm hook, and torch's replicate where this torch has it, behind each stage's
    class name: refused when they run (the classes are passed by reference, no source text is read)."""
    name = {"naive": "NaiveDDP", "overlap": "OverlapDDP", "buckets": "BucketedDDP"}[check.check]
    assert verdicts(check, PlainTorchDDP).message == \
        f"{name} runs torch's DistributedDataParallel (its reducer does the work): build the hooks and buckets yourself"
    if HAS_REPLICATE:
        assert verdicts(check, TorchReplicate).message == \
            f"{name} runs torch's replicate (DDP underneath): build the hooks and buckets yourself"


MyFSDP = load("10_fsdp_from_scratch.ipynb", "MyFSDP")


class AllReduceGradients(MyFSDP):  # the right update, the wrong collective
    def finish(self):
        grads = torch.cat([p.grad.reshape(-1) for p in self.params])
        padded = torch.zeros(self.length * self.world)
        padded[:self.numel] = grads
        dist.all_reduce(padded)
        self.shard.grad = padded[self.rank * self.length:(self.rank + 1) * self.length] / self.world
        self._free()


class NeverFrees(MyFSDP):
    def finish(self):
        kept = [p.data for p in self.params]
        super().finish()
        for p, data in zip(self.params, kept):
            p.data = data


class KeepsAGatheredCopy(MyFSDP):  # frees module.parameters(), but keeps the full vector in an attribute
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        self.kept = torch.cat([p.detach().reshape(-1) for p in self.params])
        return out


def _a_hiding_place():
    kept = []

    def keep(tensor):
        kept[:] = [tensor]

    return keep


_KEEP_ASIDE = _a_hiding_place()


class KeepsACopyInAClosure(MyFSDP):  # frees everything it owns, but a closure holds the full vector
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        _KEEP_ASIDE(torch.cat([p.detach().reshape(-1) for p in self.params]))
        return out


class ShardTooLong(MyFSDP):  # ceil(P/N) + 7 elements: right updates, more memory than the contract
    def __init__(self, module):
        super().__init__(module)
        self.length += 7
        padded = torch.zeros(self.length * self.world)
        flat = torch.cat([self.shard.detach(), torch.zeros(7)])
        self.shard = torch.nn.Parameter(flat)


class SumsGradients(MyFSDP):
    def finish(self):
        super().finish()
        self.shard.grad *= self.world


from ddpkit.exercises.fsdp import check_fsdp  # noqa: E402

class TorchsFullyShard(torch.nn.Module):  # FSDP2's fully_shard, the feature the exercise rebuilds
    def __init__(self, module):
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.module = fully_shard(module, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))

    def shard_parameters(self):
        return list(self.module.parameters())

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish(self):
        pass


grade(check_fsdp, TorchsFullyShard)
grade(check_fsdp, MyFSDP, AllReduceGradients, NeverFrees, KeepsAGatheredCopy, ShardTooLong, SumsGradients,
      KeepsACopyInAClosure)


def test_fsdp_from_scratch_check(verdicts):
    v = verdicts
    assert v(check_fsdp, MyFSDP).passed
    assert "an all-reduce gives every rank the whole gradient" in v(check_fsdp, AllReduceGradients).message
    assert "between steps the wrapper still holds" in v(check_fsdp, NeverFrees).message
    assert "between steps the wrapper still holds" in v(check_fsdp, KeepsAGatheredCopy).message
    assert "between steps the wrapper still holds" in v(check_fsdp, KeepsACopyInAClosure).message
    assert "where ceil(P/N) elements make" in v(check_fsdp, ShardTooLong).message
    assert "the parameters differ from DDP's" in v(check_fsdp, SumsGradients).message
    assert v(check_fsdp, TorchsFullyShard).message == "MyFSDP runs torch's fully_shard (FSDP2), the feature this " \
        "exercise rebuilds: gather and scatter yourself", v(check_fsdp, TorchsFullyShard).message


rank_wiring = load("08_rank_wiring.ipynb", "rank_wiring")


def gpu_by_global_rank(env, gpus_on_node):
    return {**rank_wiring(env, gpus_on_node), "device": f"cuda:{env['RANK']}" if gpus_on_node else "cpu"}


def gpu_whenever_there_is_one(env, gpus_on_node):
    return {**rank_wiring(env, gpus_on_node), "device": f"cuda:{env['LOCAL_RANK']}" if gpus_on_node else "cpu"}


from ddpkit.exercises.wiring import check_rank_wiring  # noqa: E402

grade(check_rank_wiring, rank_wiring, gpu_by_global_rank, gpu_whenever_there_is_one)


def test_rank_wiring_check(verdicts):
    v = verdicts
    assert v(check_rank_wiring, rank_wiring).passed
    assert "index them by LOCAL_RANK, not RANK" in v(check_rank_wiring, gpu_by_global_rank).message
    assert "with fewer GPUs than ranks on the node" in v(check_rank_wiring, gpu_whenever_there_is_one).message


# --------------------------------------------------------------------------- reshard after forward (lesson 10b)

from ddpkit.exercises.resharding_memory import check_held_between  # noqa: E402

held_between = load("10b_reshard_after_forward.ipynb", "held_between")


def whole_parameters_only(shapes, world, rank, reshard_after_forward):  # forgets the shards under ZeRO-2 behaviour
    import math

    return held_between(shapes, world, rank, True) if reshard_after_forward else sum(math.prod(s) * 4 for s in shapes)


def an_even_split(shapes, world, rank, reshard_after_forward):  # P/N on every rank, not torch.chunk's rows
    import math

    total = sum(math.prod(s) * 4 for s in shapes)
    return total // world + (0 if reshard_after_forward else total)


def the_other_setting(shapes, world, rank, reshard_after_forward):
    return held_between(shapes, world, rank, not reshard_after_forward)


def the_kits_calculator(shapes, world, rank, reshard_after_forward):
    import math

    from ddpkit.parallel import memory

    sizes = [math.prod(s) for s in shapes]
    return memory.bytes_per_rank(sum(sizes), "fsdp2" if reshard_after_forward else "zero2", world,
                                 param_sizes=sizes)["params"]


grade(check_held_between, held_between, whole_parameters_only, an_even_split, the_other_setting, the_kits_calculator)


def test_reshard_after_forward_check(verdicts):
    v = verdicts
    assert v(check_held_between, held_between).passed
    assert "what stays allocated besides the gathered parameters?" in v(check_held_between, whole_parameters_only).message
    assert "with torch.chunk's cut?" in v(check_held_between, an_even_split).message
    assert "which one frees the gathered parameters after forward?" in v(check_held_between, the_other_setting).message
    assert "uses the kit's own calculator" in v(check_held_between, the_kits_calculator).message
    assert all(len(v(check_held_between, fn).message) < 200 for fn in (whole_parameters_only, an_even_split, the_other_setting))


# --------------------------------------------------------------------------- ring attention's step (lesson 17)

from ddpkit.exercises.attention import check_attend_block  # noqa: E402

attend_block = load("17_ring_attention_step.ipynb", "attend_block")


def adds_the_outputs(q, k, v, out, lse):  # each block normalised by its own denominator, never re-weighted
    block_out, block_lse = attend_block(q, k, v, None, None)
    return (block_out, block_lse) if out is None else (out + block_out, torch.logaddexp(lse, block_lse))


def raw_exponentials(q, k, v, out, lse):  # right in exact arithmetic; exp overflows float32 past 88.7
    e = torch.exp(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5)
    block_lse, block_out = e.sum(-1).log(), (e / e.sum(-1, keepdim=True)) @ v
    if out is None:
        return block_out, block_lse
    new = (lse.exp() + block_lse.exp()).log()
    return (lse - new).exp().unsqueeze(-1) * out + (block_lse - new).exp().unsqueeze(-1) * block_out, new


SEEN_BLOCKS = []  # where a cheat keeps every block it was given


def keeps_every_block(q, k, v, out, lse):  # exact, by holding all of K and V: what ring attention avoids
    if out is None:
        SEEN_BLOCKS.clear()
    SEEN_BLOCKS.append((k, v))
    keys, values = torch.cat([b[0] for b in SEEN_BLOCKS], -2), torch.cat([b[1] for b in SEEN_BLOCKS], -2)
    scores = q @ keys.transpose(-2, -1) * q.shape[-1] ** -0.5
    return torch.softmax(scores, -1) @ values, torch.logsumexp(scores, -1)


def gathers_the_keys(q, k, v, out, lse):  # a collective inside the step: the ring's job, done by all-gather
    keys = [torch.empty_like(k) for _ in range(dist.get_world_size())]
    dist.all_gather(keys, k.contiguous())
    return attend_block(q, k, v, out, lse)


def the_kits_merge(q, k, v, out, lse):
    from ddpkit.parallel.context import block_attention, merge

    return merge(out, lse, *block_attention(q, k, v, q.shape[-1] ** -0.5, False))


grade(check_attend_block, attend_block, adds_the_outputs, raw_exponentials, keeps_every_block, gathers_the_keys,
      the_kits_merge)


def test_ring_attention_step_check(verdicts):
    v = verdicts
    assert v(check_attend_block, attend_block).passed
    assert "how much of the total is each?" in v(check_attend_block, adds_the_outputs).message
    assert "with scores near 100 the output holds inf or NaN" in v(check_attend_block, raw_exponentials).message
    assert "changed when another set's blocks were merged" in v(check_attend_block, keeps_every_block).message
    assert "calls dist.all_gather, a collective" in v(check_attend_block, gathers_the_keys).message
    assert "uses the kit's own" in v(check_attend_block, the_kits_merge).message
    assert all(len(v(check_attend_block, fn).message) < 200 for fn in (adds_the_outputs, raw_exponentials, keeps_every_block))


# --------------------------------------------------------------------------- all-to-all dispatch (lesson 18)

from ddpkit.exercises.dispatch import check_dispatch  # noqa: E402

dispatch = load("18_expert_dispatch.ipynb", "dispatch")


def receives_what_it_sends(rows, counts):  # no count exchange: assumes its peers routed as it did
    world = dist.get_world_size()
    guess = counts.view(world, -1)
    received = rows.new_empty((int(guess.sum()), rows.shape[1]))
    dist.all_to_all_single(received, rows.contiguous(), guess.sum(1).tolist(), guess.sum(1).tolist())
    return received, guess


def counts_by_expert_then_source(rows, counts):  # the right rows, per_source laid out (local expert, source)
    received, per_source = dispatch(rows, counts)
    return received, per_source.t().contiguous().view(per_source.shape)


def gathers_every_row(rows, counts):  # every rank gets every rank's rows, then keeps its experts'
    world, rank = dist.get_world_size(), dist.get_rank()
    local = counts.numel() // world
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts)
    sizes = [int(c.sum()) for c in all_counts]
    everything = [rows.new_empty((n, rows.shape[1])) for n in sizes]
    dist.all_gather(everything, rows.contiguous())
    mine = [torch.split(e, c.tolist())[rank * local:(rank + 1) * local] for e, c in zip(everything, all_counts)]
    return torch.cat([t for parts in mine for t in parts]), torch.stack([c[rank * local:(rank + 1) * local] for c in all_counts])


def the_kits_exchange(rows, counts):
    from ddpkit.parallel.expert_parallel import AllToAll, exchange_counts

    world = dist.get_world_size()
    per_source = exchange_counts(counts, dist.group.WORLD)
    return AllToAll.apply(rows, per_source.sum(1).tolist(), counts.view(world, -1).sum(1).tolist(),
                          dist.group.WORLD), per_source


grade(check_dispatch, dispatch, receives_what_it_sends, counts_by_expert_then_source, gathers_every_row,
      the_kits_exchange)


def test_expert_dispatch_check(verdicts):
    v = verdicts
    assert v(check_dispatch, dispatch).passed
    assert "does each receiver know how many rows every peer sends it?" in v(check_dispatch, receives_what_it_sends).message
    assert "one row per source rank, one column per local expert" in v(check_dispatch, counts_by_expert_then_source).message
    assert "calls dist.all_gather, which hands every rank every row" in v(check_dispatch, gathers_every_row).message
    assert "uses the kit's own" in v(check_dispatch, the_kits_exchange).message
    assert all(len(v(check_dispatch, fn).message) < 200 for fn in (receives_what_it_sends, counts_by_expert_then_source))


# --------------------------------------------------------------------------- the flight recorder's culprit (lesson 20)

from ddpkit.exercises.flight_culprit import check_culprit  # noqa: E402

culprit = load("20_flight_culprit.ipynb", "culprit")


def _call(entry):
    return entry["profiling_name"], str(entry["input_sizes"]), str(entry["input_dtypes"])


def against_rank_0(dumps):  # torch's analyzer's rule: whoever differs from the first rank is to blame
    first = {e["collective_seq_id"]: _call(e) for e in dumps[0]["entries"]}
    for rank in sorted(dumps)[1:]:
        for e in dumps[rank]["entries"]:
            if first.get(e["collective_seq_id"]) != _call(e):
                return rank, e["collective_seq_id"]
    return None, None


def the_first_entry(dumps):  # the right rank, but the first entry's number, where every rank still agreed
    rank, _ = culprit(dumps)
    return rank, dumps[rank]["entries"][0]["collective_seq_id"]


def the_kits_analyzer(dumps):
    import os
    import pickle

    from ddpkit.debug import flight

    folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), "fr-kit")
    os.makedirs(folder, exist_ok=True)
    for rank, dump in dumps.items():
        with open(os.path.join(folder, f"fr_rank_{rank}"), "wb") as handle:
            pickle.dump(dump, handle)
    found = flight.analyze(folder)
    return found.culprits[0], found.seq


grade(check_culprit, culprit, against_rank_0, the_first_entry, the_kits_analyzer)


def test_flight_culprit_check(verdicts):
    v = verdicts
    assert v(check_culprit, culprit).passed
    assert "which rank is the odd one out? (it can be the first rank)" in v(check_culprit, against_rank_0).message
    assert "is not where the ranks first disagree" in v(check_culprit, the_first_entry).message
    assert "uses the kit's own Flight Recorder analysis" in v(check_culprit, the_kits_analyzer).message
    assert all(len(v(check_culprit, fn).message) < 200 for fn in (against_rank_0, the_first_entry))


# --------------------------------------------------------------------------- ranks fed the same samples (lesson 20)

from ddpkit.exercises.same_samples import check_fed_the_same  # noqa: E402

fed_the_same = load("20_same_samples.ipynb", "fed_the_same")


def on_this_rank_only(ids):  # no communication: a rank alone sees no repeat across ranks
    return len(set(ids)) < len(ids)


def compared_with_rank_0(ids):  # every rank compares its ids with rank 0's, and all agree on the answer
    first = [list(ids)]
    dist.broadcast_object_list(first, src=0)
    shared = torch.tensor([float(dist.get_rank() != 0 and bool(set(first[0]) & set(ids)))])
    dist.all_reduce(shared, op=dist.ReduceOp.MAX)
    return bool(shared.item())


def whole_copies(ids):  # looks for two ranks fed the very same ids, not for one shared id
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(ids))
    return len({tuple(x) for x in everyone}) < len(everyone)


def answered_on_rank_0(ids):  # gathers to rank 0 only: the other ranks never learn the answer
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(list(ids), everyone, dst=0)
    return dist.get_rank() == 0 and len({i for x in everyone for i in x}) < sum(len(x) for x in everyone)


def by_the_counts(ids):  # more ids than the dataset holds means repeats; uneven shares break it
    total = torch.tensor([float(len(ids))])
    dist.all_reduce(total)
    return bool(total.item() > 20)


def the_kits_partition_check(ids):
    from ddpkit.data import check_partition

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(ids))
    return bool(check_partition(everyone, range(20)).duplicates)


grade(check_fed_the_same, fed_the_same, on_this_rank_only, compared_with_rank_0, whole_copies, answered_on_rank_0,
      by_the_counts, the_kits_partition_check)


def test_same_samples_check(verdicts):
    v = verdicts
    assert v(check_fed_the_same, fed_the_same).passed
    assert "a rank alone sees no repeat, compare its ids with the other ranks'" in v(check_fed_the_same, on_this_rank_only).message
    assert "comparing each rank with rank 0 misses a pair of other ranks" in v(check_fed_the_same, compared_with_rank_0).message
    assert "look for any id on two ranks, not only for whole copies" in v(check_fed_the_same, whole_copies).message
    assert "every rank must get the same answer" in v(check_fed_the_same, answered_on_rank_0).message
    assert "compare the ids, not the counts" in v(check_fed_the_same, by_the_counts).message
    assert "uses the kit's own partition check" in v(check_fed_the_same, the_kits_partition_check).message
    assert all(len(v(check_fed_the_same, fn).message) < 200
               for fn in (on_this_rank_only, compared_with_rank_0, whole_copies, answered_on_rank_0, by_the_counts))


# --------------------------------------------------------------------------- build it live

(BuildConfig, build_model_and_optimizer, broadcast_solution, run_solution) = load(
    "00_build_it_live.ipynb", "TrainConfig", "build_model_and_optimizer", "broadcast_parameters", "run")


def run_without_the_schedule(ctx, cfg):  # a constant learning rate: everything else as the solution
    import ddpkit.step

    real = ddpkit.step.lr_at
    run_solution.__globals__["lr_at"] = lambda cfg, step: cfg.lr
    try:
        return run_solution(ctx, cfg)
    finally:
        run_solution.__globals__["lr_at"] = real


def run_without_ddp(ctx, cfg):  # each rank trains alone on its share
    from torch.nn.parallel import DistributedDataParallel

    class Alone(DistributedDataParallel):
        def __init__(self, module):
            torch.nn.Module.__init__(self)
            self.module = module

        def forward(self, *args):
            return self.module(*args)

        def no_sync(self):
            return contextlib.nullcontext()

    run_solution.__globals__["DDP"] = Alone
    try:
        return run_solution(ctx, cfg)
    finally:
        run_solution.__globals__["DDP"] = DistributedDataParallel


class NotADataclass:
    pass


@dataclasses.dataclass
class ForgetsTheRanks:
    micro_batch_size: int = 8
    grad_accum_steps: int = 2
    world_size: int = 2

    @property
    def global_batch_size(self):
        return self.micro_batch_size * self.grad_accum_steps


def with_sgd(cfg):
    model, _ = build_model_and_optimizer(cfg)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def run_the_kits_trainer(ctx, cfg):  # the kit's own Trainer behind the contract's name
    from ddpkit.train import Trainer

    trainer = Trainer(ctx, cfg)
    trainer.fit()
    return trainer.model.state_dict()


from ddpkit.exercises.trainer import check_config_class, check_model_and_optimizer, check_trainer  # noqa: E402

grade(check_config_class, BuildConfig, NotADataclass, ForgetsTheRanks)
grade(check_model_and_optimizer, build_model_and_optimizer, with_sgd)
grade(check_trainer, run_the_kits_trainer)


def test_build_it_live_checks(verdicts):
    v = verdicts
    assert v(check_config_class, BuildConfig).passed and v(check_model_and_optimizer, build_model_and_optimizer).passed
    assert "is not a dataclass" in v(check_config_class, NotADataclass).message
    assert "gave global_batch_size 16: it must count" in v(check_config_class, ForgetsTheRanks).message
    assert "the optimizer is SGD, not torch.optim.AdamW" in v(check_model_and_optimizer, with_sgd).message
    assert v(check_trainer, run_the_kits_trainer).message.startswith("run uses the kit's own trainer")


def test_build_it_live_trainer_against_ddpkit_train():  # in this process: a check given keywords runs here
    assert check_trainer(run_solution, steps=6).passed
    assert "differ from ddpkit train's" in check_trainer(run_without_the_schedule, steps=6).message
    assert "the two ranks end with different parameters" in check_trainer(run_without_ddp, steps=6).message


@pytest.mark.parametrize("path", sorted(EXERCISES.glob("*.ipynb")) + sorted((EXERCISES / "solutions").glob("*.ipynb")),
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_exercise_notebook_conventions(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.outputs and c.execution_count is None for c in nb.cells if c.cell_type == "code"), "stored with outputs"
    assert path.name in nb.cells[0].source and "**The contract.**" in nb.cells[0].source
    written = [c for c in nb.cells if c.cell_type == "code" and "### begin" in c.source]
    assert written and all(c.source.rstrip().endswith("### end") for c in written)
    assert any("hint(" in c.source for c in nb.cells if c.cell_type == "code")
    twin = (EXERCISES / path.name) if path.parent.name == "solutions" else (EXERCISES / "solutions" / path.name)
    assert twin.exists(), f"{path.name} has no {'exercise' if path.parent.name == 'solutions' else 'solution'}"


def test_every_sentence_is_short_whatever_the_exercise(verdicts):
    """Every check's sentence, for every case graded here (right, wrong, stub, cheat) and every exercise,
    fits in 200 characters."""
    from ddpkit.exercises import catalog

    found = {key[2] for key in verdicts.found if key[0] == "notebook"}
    assert found == {e.id for e in catalog.EXERCISES}
    for key, value in verdicts.found.items():
        rows = value if key[0] == "notebook" else [{"message": value.message}]
        for row in rows:
            assert len(row["message"]) <= 200, (key, row["message"])
    wrong = {CASES[key][0] for key, value in verdicts.found.items() if key[0] != "notebook" and not value.passed}
    assert len(wrong) >= 18, sorted(wrong)  # a wrong answer's sentence, for nearly every exercise


def test_every_master_passes_and_every_stub_says_not_implemented(verdicts):
    """The published solution passes every check of its exercise; the untouched student notebook fails each
    with "not implemented yet" (both graded from their marked cells, in the module's sandboxes)."""
    from ddpkit.exercises import catalog

    for exercise in catalog.EXERCISES:
        for row in verdicts.found[("notebook", "solutions", exercise.id)]:
            assert row["passed"], (exercise.id, row)
        for row in verdicts.found[("notebook", "exercises", exercise.id)]:
            assert not row["passed"] and row["message"].startswith("not implemented yet"), (exercise.id, row)
