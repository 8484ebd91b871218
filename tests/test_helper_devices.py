"""The helpers the notebooks launch put every tensor on the device they are given (``ctx.device``).

Backend ``auto`` picks NCCL on a multi-GPU node, and NCCL takes only CUDA tensors; a model on the GPU
takes only inputs there. On a CPU every device is the CPU, so where a tensor *lives* proves nothing
here: :class:`HostAudit` follows where each tensor was *put* instead. A tensor made without
``device=ctx.device`` (``torch.ones(4)``, a module's parameters before ``.to(ctx.device)``) is marked as
left on the host, and so is anything computed from it, until ``.to(ctx.device)`` moves it. Handing a
marked tensor to ``torch.distributed``, or mixing it with unmarked tensors in one operation, is what
would fail on a GPU: it is recorded."""

import weakref

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.parallel import comm, pipeline, rendezvous, tensor

FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.randn, torch.rand, torch.randint,
             torch.tensor, torch.as_tensor, torch.linspace, torch.eye, torch.randperm, torch.empty_strided}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, dist.P2POp):
        yield value.tensor


class HostAudit(TorchFunctionMode):
    """Within it, tensors left on the host (see the module docstring) are tracked and their misuse recorded."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device, self.misuse = torch.device(device), []
        self._host: dict[int, weakref.ref] = {}  # by id: a tensor's == is elementwise
        self._saved = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in _tensors((args, kwargs))]
        if func in FACTORIES:
            device = kwargs.get("device")
            if device is None or torch.device(device) != self.device:
                self._mark(out)
        elif func is torch.Tensor.to or getattr(func, "__name__", "") in ("to", "cuda"):
            for t in _tensors(out):
                self._host.pop(id(t), None)
        elif any(self.is_host(t) for t in inputs):
            placed = [t for t in inputs if not self.is_host(t) and t.dim() > 0]
            if placed:
                self.misuse.append(f"{getattr(func, '__name__', func)} mixes host and device tensors")
            self._mark(out)
        return out

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, out) -> None:
        for t in _tensors(out):
            self._host[id(t)] = weakref.ref(t)

    def _check(self, name, fn):
        def wrapper(*args, **kwargs):
            if any(self.is_host(t) for t in _tensors((args, kwargs))):
                self.misuse.append(f"dist.{name} given a tensor left on the host")
            return fn(*args, **kwargs)
        return wrapper

    def __enter__(self):
        for module in (dist, c10d):
            for name in ("batch_isend_irecv", *rendezvous.P2P, *rendezvous.COLLECTIVES):
                if hasattr(module, name) and not name.endswith("_object") and name != "broadcast_object_list":
                    self._saved[(module, name)] = getattr(module, name)
        wrappers = {name: self._check(name, getattr(c10d, name)) for (_, name) in self._saved}
        for (module, name) in self._saved:
            setattr(module, name, wrappers[name])
        self._parameter_new = torch.nn.Parameter.__new__
        audit = self

        def parameter_new(cls, data=None, requires_grad=True):
            made = audit._parameter_new(cls, data, requires_grad)
            if data is not None and audit.is_host(data):
                audit._mark(made)
            return made

        torch.nn.Parameter.__new__ = parameter_new
        return super().__enter__()

    def __exit__(self, *exc):
        torch.nn.Parameter.__new__ = self._parameter_new
        for (module, name), fn in self._saved.items():
            setattr(module, name, fn)
        return super().__exit__(*exc)


def audited(ctx, helper, *args):
    """Run ``helper(ctx, *args)`` under a :class:`HostAudit` for ``ctx.device`` (a function for ``ddpkit.launch``)."""
    with HostAudit(ctx.device) as audit:
        helper(ctx, *args)
    return audit.misuse


def _all_reduce_of_host_tensors(ctx):
    t = torch.ones(4)  # on the host, whatever ctx.device is
    dist.all_reduce(t)
    model = torch.nn.Linear(4, 2)  # its parameters too: never moved to ctx.device
    model(torch.ones(3, 4, device=ctx.device))


def _benchmark(ctx):
    comm.benchmark(ctx, [2**10], iters=1)


GPT = TrainConfig(model="gpt", n_layers=4)
HELPERS = {
    "show_collectives": (comm.show_collectives, 6),
    "check_ring": (comm.check_ring, [5, 100]),
    "benchmark (_timed_calls)": (_benchmark,),
    "split_linear_demo": (tensor.split_linear_demo, 6, 4),
    "check_against_unsplit": (tensor.check_against_unsplit, GPT),
    "check_against_dtensor": (tensor.check_against_dtensor, GPT),
    "run_pipeline": (pipeline.run_pipeline, GPT, "gpipe", 2, 2),
}


@pytest.mark.parametrize("name", HELPERS)
def test_a_helper_puts_its_tensors_on_the_device_it_is_given(name):
    helper, *args = HELPERS[name]
    assert launch(audited, helper, *args, world_size=2, output="none") == [[], []]


def test_the_audit_catches_tensors_left_on_the_host():
    misuse = launch(audited, _all_reduce_of_host_tensors, world_size=2, output="none")[0]
    assert "dist.all_reduce given a tensor left on the host" in misuse
    assert any("mixes host and device tensors" in m for m in misuse)
