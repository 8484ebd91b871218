"""FSDP2 as it is used: what its knobs (resharding, mixed precision, prefetch, meshes, offload) change, counted.

Every function here runs on real ranks (``ddpkit.launch``) and measures; nothing is modelled.

* **Collectives, counted.** :class:`~ddpkit.parallel.collective_log.CollectiveLog` records each
  collective FSDP2 issues: its phase (forward, backward, optimizer), dtype, bytes and group size.
* **ZeRO-3 vs ZeRO-2.** ``fully_shard(module, reshard_after_forward=True)`` frees a unit's gathered
  parameters after its forward and all-gathers them again in backward (ZeRO stage 3: parameters
  sharded); ``False`` keeps them gathered from forward to backward, so backward gathers nothing, at the
  price of holding every unit's whole parameters in between (parameters not sharded during the step,
  as in ZeRO stage 2; Rajbhandari et al., "ZeRO", 2020, section 5). After backward FSDP2 reshards
  either way, so between steps both hold only the shards (measured: ``held[...]["after_step"]``).
  :func:`run_fsdp` measures both the gathers and the parameter bytes held between forward and backward.
* **Mixed precision.** ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
  casts the sharded fp32 parameters to bf16 *before* the all-gather (half the bytes on the wire),
  computes in bf16, and reduce-scatters gradients in fp32; "the optimizer step uses the sharded
  parameter in the original dtype" (``MixedPrecisionPolicy``'s docstring): the fp32 shards are the
  master weights, at no extra memory. :func:`lost_update` shows why the master must be fp32: bf16
  keeps 8 significant bits.
* **Prefetch.** ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` issue the
  same all-gathers earlier: :mod:`ddpkit.parallel.fsdp_prefetch` counts how many units are then
  gathered at once, and measures the overlap with compute from a profiler trace.
* **HSDP.** ``fully_shard(module, mesh=mesh_2d)`` with a 2-D mesh (replicate, shard) shards within a
  group and replicates across groups: parameters are ``DTensor`` s placed ``(Replicate(), Shard(0))``,
  gradients are reduce-scattered in the shard group then all-reduced across the replicate group.
* **TP x FSDP2** (:func:`run_tp_fsdp`): tensor parallelism on the inner axis of a ``(dp, tp)`` mesh,
  ``fully_shard`` on the outer, as torchtitan composes them. **CPU offload**: ``run_fsdp(offload=True)``
  and :func:`offload_bytes`, what ``CPUOffloadPolicy`` would take off a GPU.

FSDP2 runs on CPU tensors from torch 2.7 (see :mod:`ddpkit.parallel.fsdp`); :func:`check_supported`
refuses an older torch before any rank starts.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ddpkit.parallel import fsdp, memory
from ddpkit.parallel.collective_log import CollectiveLog


def check_supported() -> None:
    """Refuse, with the reason, a torch whose FSDP2 cannot run on the CPU (before any rank starts)."""
    fsdp.check_supported("cpu")


def fsdp_api():
    """``(fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy)`` wherever this torch keeps them."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    return fsdp.fully_shard_fn(), MixedPrecisionPolicy, CPUOffloadPolicy


def make_model(width: int = 64, depth: int = 4, seed: int = 0) -> torch.nn.Sequential:
    """``depth`` Linear(width, width) layers with tanh between: every layer an FSDP unit of equal size."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(depth):
        layers.append(torch.nn.Linear(width, width))
        if i < depth - 1:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def batch_for(replica: int, step: int, width: int = 64, batch: int = 8, seed: int = 1234):
    """The (inputs, targets) data-parallel replica ``replica`` trains on at ``step``: same on every run."""
    g = torch.Generator().manual_seed(seed + 1000 * step + replica)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def _check_even(world: int, what: str) -> None:
    if world < 4 or world % 2:
        raise ValueError(f"{what} here uses groups of 2 on a 2-D mesh: launch an even world of at least 4 ranks, not {world}")


def _param_bytes(model: torch.nn.Module) -> dict:
    """Parameter bytes this rank holds right now: local shards of ``DTensor`` s, whole tensors otherwise."""
    sharded = unsharded = 0
    for p in model.parameters():
        if hasattr(p, "to_local"):
            local = p.to_local()
            sharded += local.numel() * local.element_size()
        else:
            unsharded += p.numel() * p.element_size()
    return {"sharded": sharded, "unsharded": unsharded}


def run_fsdp(ctx, *, reshard_after_forward: bool = True, mixed_precision: bool = False, mesh: str = "1d",
             offload: bool = False, steps: int = 3, width: int = 64, depth: int = 4, lr: float = 0.1) -> dict:
    """Train :func:`make_model` with FSDP2 for ``steps`` SGD steps on this rank; return what was measured.

    ``mesh``: ``"1d"`` shards over the world; ``"hsdp"`` builds a 2-D mesh ``(world/2, 2)`` named
    ``("replicate", "shard")`` and passes it to ``fully_shard`` (HSDP); ``"shard-only"`` is the negative
    control, the same shard groups without the replicate axis (each pair trains on its own). ``offload``
    passes ``CPUOffloadPolicy(pin_memory=False)``: shards, gradients and the optimizer step live in host
    memory (on a CPU-only job they are there anyway: the saving is a GPU's). Returns the
    losses (averaged over the data-parallel replicas), the collectives counted per step and phase, their
    dtypes, the parameter bytes held before forward and between forward and backward, the placements.
    """
    check_supported()
    fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy = fsdp_api()
    from torch.distributed.device_mesh import init_device_mesh

    if mesh == "1d":
        device_mesh, replica, replicas = init_device_mesh("cpu", (ctx.world_size,)), ctx.rank, ctx.world_size
    elif mesh in ("hsdp", "shard-only"):
        _check_even(ctx.world_size, "HSDP")
        device_mesh = init_device_mesh("cpu", (ctx.world_size // 2, 2), mesh_dim_names=("replicate", "shard"))
        replica, replicas = ctx.rank, ctx.world_size  # every rank its own samples, as under DDP on the world
        if mesh == "shard-only":
            device_mesh = device_mesh["shard"]
    else:
        raise ValueError(f"unknown mesh {mesh!r}: use 1d, hsdp or shard-only")
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy())
    options = {"mesh": device_mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": policy}
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)  # pinning needs a GPU's driver
    model = make_model(width, depth)
    sizes = [p.numel() for p in model.parameters()]
    for unit in fsdp.shard_units(model):
        fully_shard(unit, **options)
    fully_shard(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    first = next(model.parameters())
    out = {"placements": [str(p) for p in first.placements], "mesh": str(device_mesh.mesh.tolist()),
           "param_device": str(first.device),
           "param_sizes": sizes, "losses": [], "held": []}
    with CollectiveLog() as log:
        for step in range(steps):
            x, y = batch_for(replica, step, width)
            before = _param_bytes(model)
            with log.during("forward"):
                pred = model(x)
                loss = torch.nn.functional.mse_loss(pred.float(), y)
            between = _param_bytes(model)  # after forward, before backward: what reshard_after_forward decides
            with log.during("backward"):
                loss.backward()
            with log.during("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            out["held"].append({"before_forward": before, "between": between, "after_step": _param_bytes(model)})
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=ctx.world_group)  # outside the log: the report's own collective
            out["losses"].append(mean.item() / replicas)
            if step == 0:
                out["forward_dtype"] = str(pred.dtype).replace("torch.", "")
    per_step = {f"{phase}_{op}": log.count(op, phase) // steps
                for phase in ("forward", "backward") for op in ("all_gather", "reduce_scatter", "all_reduce")}
    ops = ("all_gather", "reduce_scatter", "all_reduce")
    out.update(per_step=per_step, units=len(fsdp.shard_units(model)),
               dtypes={op: sorted({r["dtype"] for r in log.step_records(op)}) for op in ops},
               group_sizes={op: sorted({r["group_size"] for r in log.step_records(op)}) for op in ops},
               bytes_per_step={op: sum(r["bytes"] for r in log.step_records(op)) // steps for op in ops})
    # The shards stay allocated all along (the optimizer owns them); whole parameters come on top.
    out["held_between"] = max(h["before_forward"]["sharded"] + h["between"]["unsharded"] for h in out["held"])
    return out


def run_ddp(ctx, *, steps: int = 3, width: int = 64, depth: int = 4, lr: float = 0.1, replica: int | None = None) -> dict:
    """The reference: the same model, data and optimizer under DDP on the world. ``replica`` picks the
    samples (default: this rank's); ranks given the same replica count twice in the mean, which leaves
    it the mean over the distinct replicas."""
    model = torch.nn.parallel.DistributedDataParallel(make_model(width, depth), process_group=ctx.world_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch_for(ctx.rank if replica is None else replica, step, width)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=ctx.world_group)
        losses.append(mean.item() / ctx.world_size)
    return {"losses": losses}


def run_tp_fsdp(ctx, *, steps: int = 3, width: int = 64, depth: int = 4, lr: float = 0.1) -> dict:
    """torchtitan's 2-D recipe on ``world`` ranks: tensor parallelism inside each ``tp`` pair, then FSDP2
    over the ``dp`` axis of the same ``(dp, tp)`` mesh.

    ``parallelize_module`` makes Linear layers 0, 4, ... column-parallel and 1, 3, ... (the next Linear)
    row-parallel (Megatron's pairing: the tanh between them is elementwise, so it runs on the column
    shards); then ``fully_shard(mesh=mesh["dp"])`` shards those DTensors once more over ``dp``. TP peers
    see the same samples (their ``dp`` index). FSDP2's collectives are counted by :class:`CollectiveLog`;
    tensor parallelism's, which DTensor issues as functional collectives, by torch's ``CommDebugMode``."""
    check_supported()
    fully_shard, _, _ = fsdp_api()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _check_even(ctx.world_size, "TP x FSDP2")
    mesh = init_device_mesh("cpu", (ctx.world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    model = make_model(width, depth)
    linears = [name for name, m in model.named_children() if isinstance(m, torch.nn.Linear)]
    plan = {name: ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i, name in enumerate(linears)}
    parallelize_module(model, mesh["tp"], plan)
    for unit in fsdp.shard_units(model):
        fully_shard(unit, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    replica, replicas = mesh["dp"].get_local_rank(), mesh["dp"].size()
    out = {"placements": {name: str(p.placements) for name, p in model.named_parameters() if name.endswith("weight")},
           "losses": [], "comm_debug_mode": {}}
    with CollectiveLog() as log, warnings.catch_warnings():
        # DTensor hands back its outputs as views, and the model's input needs no gradient: FSDP2 warns
        # about both; neither applies here (no in-place op follows, the gradients are checked against DDP)
        warnings.filterwarnings("ignore", message=".*returned a view tensor")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for step in range(steps):
            x, y = batch_for(replica, step, width)
            with CommDebugMode() as comm:
                with log.during("forward"):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                with log.during("backward"):
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                # CommDebugMode sees FSDP2's c10d calls too: an independent count to check the log against
                out["comm_debug_mode"] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=mesh["dp"].get_group())  # TP peers hold the same loss already
            out["losses"].append(mean.item() / replicas)
    out["fsdp_per_step"] = {f"{phase}_{op}": log.count(op, phase) // steps
                            for phase in ("forward", "backward") for op in ("all_gather", "reduce_scatter")}
    out["fsdp_group_sizes"] = sorted({r["group_size"] for r in log.records if r["phase"] != "idle"})
    return out


def calculator_bytes(param_sizes: list[int], world: int) -> dict:
    """What :func:`ddpkit.parallel.memory.bytes_per_rank` says one rank holds in fp32 parameters:
    ``zero3`` (FSDP2, every tensor sharded along dim 0) and ``zero2`` (whole parameters)."""
    total = sum(param_sizes)
    return {"zero3": memory.bytes_per_rank(total, "fsdp2", world, param_sizes=param_sizes)["params"],
            "zero2": memory.bytes_per_rank(total, "zero2", world)["params"]}


def offload_bytes(run: dict, world: int) -> dict:
    """What ``CPUOffloadPolicy`` moves off a GPU for a :func:`run_fsdp` result: the state it keeps in host
    memory (fp32 shards, gradient shards and AdamW's moments, from :mod:`ddpkit.parallel.memory`) and the
    bytes copied per step: shards host-to-device before each all-gather, gradient shards device-to-host
    after each reduce-scatter (the policy's docstring)."""
    sizes = run["param_sizes"]
    state = memory.bytes_per_rank(sum(sizes), "fsdp2", world, param_sizes=sizes)
    return {"state_off_device": state["params"] + state["grads"] + state["optimizer"],
            "h2d_per_step": run["bytes_per_step"]["all_gather"],
            "d2h_per_step": run["bytes_per_step"]["reduce_scatter"] // world}


def lost_update(weight: float = 1.0, update: float = 2.0 ** -9, steps: int = 100) -> dict:
    """Add ``update`` to ``weight`` ``steps`` times in bf16 and in fp32.

    bf16 has an 8-bit significand (7 stored bits and the implicit leading 1), so between 1 and 2 its
    values are 2^-7 apart; adding less than half of that, 2^-8, rounds back to the same number and the
    update is lost, every step. An fp32 master (24-bit significand) keeps it: that is why mixed
    precision updates fp32 weights and casts them to bf16 for compute (Micikevicius et al., "Mixed
    Precision Training", 2018)."""
    bf16 = torch.tensor(weight, dtype=torch.bfloat16)
    fp32 = torch.tensor(weight, dtype=torch.float32)
    for _ in range(steps):
        bf16 = bf16 + torch.tensor(update, dtype=torch.bfloat16)
        fp32 = fp32 + update
    return {"weight": weight, "update": update, "steps": steps, "bf16": bf16.item(), "fp32": fp32.item(),
            "bf16_spacing": bf16_spacing(weight)}


def bf16_spacing(weight: float) -> float:
    """The gap from ``weight`` to the next larger bf16 number, measured with ``torch.nextafter``."""
    here = torch.tensor(weight, dtype=torch.bfloat16)
    return (torch.nextafter(here, torch.tensor(float("inf"), dtype=torch.bfloat16)) - here).item()
