"""The comm-timing hook runs only when ``--metrics-dir`` asks for ``comm_s``, and either way the bits are the same.

Without a metrics folder the trainer leaves the all-reduce to DDP's built-in C++ hook (no Python per
bucket); with one it times each bucket in a Python hook. Both divide the bucket and then all-reduce it,
so the weights agree bit for bit, on 3 ranks too, where DDP's own no-hook path (multiply by 1/3) does not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit import metrics, train
from ddpkit.config import TrainConfig
from ddpkit.launch import launch
from ddpkit.models import build_model, loss_fn

CFG = TrainConfig(world_size=3, steps=4, micro_batch_size=8, dataset_size=384, log_every=1)


def test_the_hook_is_off_without_a_metrics_dir_and_the_weights_are_the_same(tmp_path, capsys):
    plain = launch(train.run, CFG, world_size=3, output="rank0")[0]
    console = capsys.readouterr().out
    measured = launch(train.run, CFG.replace(metrics_dir=str(tmp_path)), world_size=3, output="none")[0]
    assert plain["param_sha256"] == measured["param_sha256"] and plain["losses"] == measured["losses"]
    assert "comm_s" not in plain["phase_s"] and measured["phase_s"]["comm_s"]["mean"] > 0
    rows = [line.split()[2:] for line in console.splitlines() if line.split()[1:3] == ["0]", "1"]]  # "[rank 0] 1 ..."
    assert rows and rows[0][-1] == "-", console  # the console's comm column says "not measured", not 0
    steps = metrics.read_metrics(str(tmp_path))
    assert len(steps) == 3 * CFG.steps and all(r["comm_s"] > 0 and r["comm_calls"] >= 1 for r in steps)


def _three_ways(ctx, cfg):
    """The same 3 steps under DDP with the timing hook, with the built-in hook, and with no hook at all."""
    out = {}
    for name in ("timing hook", "built-in hook", "no hook"):
        torch.manual_seed(0)
        model = DDP(build_model(cfg), gradient_as_bucket_view=True)
        if name != "no hook":
            metrics.CommTimer().register(model, measure=name == "timing hook")
        optimizer = torch.optim.AdamW(model.parameters())
        gen = torch.Generator().manual_seed(ctx.rank)
        for _ in range(3):
            x = torch.randn(16, cfg.input_width, generator=gen)
            y = torch.randint(0, cfg.num_classes, (16,), generator=gen)
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out[name] = metrics.state_sha256(model.module.state_dict())
    dist.barrier()
    return out


def test_the_built_in_hook_is_the_timing_hooks_arithmetic_and_no_hook_is_not():
    shas = launch(_three_ways, CFG, world_size=3, output="none")[0]
    assert shas["built-in hook"] == shas["timing hook"]
    # negative control: DDP's path without a hook rounds differently on 3 ranks (x * (1/3) is not x / 3)
    assert shas["no hook"] != shas["timing hook"]
