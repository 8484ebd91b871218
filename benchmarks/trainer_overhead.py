"""ddpkit's train step (phase timers, comm hook, loss/id gathering) against a hand-written DDP loop
on the same MLP and data, world 2, alternating blocks inside the same ranks. Target <= 1.02x.
Also weak scaling on a compute-bound MLP: 2 ranks x 1 thread vs 1 rank x 1 thread. Target >= 90%."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summarize, write_results  # noqa: E402

from ddpkit import metrics, train  # noqa: E402
from ddpkit.config import TrainConfig  # noqa: E402
from ddpkit.launch import launch  # noqa: E402
from ddpkit.models import build_model, loss_fn  # noqa: E402
from ddpkit.parallel.ddp import wrap_ddp  # noqa: E402
from ddpkit.step import PhaseTimer, gather_step, train_step  # noqa: E402


def overhead(ctx, cfg, blocks, steps_per_block):
    data = train.build_dataset(cfg)
    b = cfg.micro_batch_size
    batches = [{"index": torch.arange(i, i + b), "inputs": data.features[i:i + b], "targets": data.labels[i:i + b]}
               for i in range(0, len(data) - b, b)]
    ours_model = wrap_ddp(build_model(cfg), ctx)
    comm = metrics.CommTimer().register(ours_model)
    ours_opt = train.build_optimizer(ours_model, cfg)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    base_model = DDP(build_model(cfg))
    base_opt = train.build_optimizer(base_model, cfg)
    ours, base = [], []
    for block in range(blocks):
        for s in range(steps_per_block):
            batch = batches[(block * steps_per_block + s) % len(batches)]
            t = time.perf_counter()
            comm.reset()
            timer = PhaseTimer(ctx.device)
            loss_sum, ids = train_step(ours_model, ours_opt, scaler, [batch], cfg, ctx.device, timer)
            gather_step(ctx, loss_sum, ids)
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            loss = loss_fn(base_model(batch["inputs"]), batch["targets"])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(base_model.parameters(), cfg.grad_clip)
            base_opt.step()
            base_opt.zero_grad(set_to_none=True)
            reported = loss.detach().clone()
            dist.all_reduce(reported)  # a hand-written loop logs a global loss too
            base.append(time.perf_counter() - t)
    return {"ours": ours[steps_per_block:], "base": base[steps_per_block:]}  # first block is warm-up


def throughput(ctx, cfg, steps):
    torch.set_num_threads(1)
    model = wrap_ddp(build_model(cfg), ctx)
    opt = train.build_optimizer(model, cfg)
    x = torch.randn(cfg.micro_batch_size, cfg.input_width)
    y = torch.randint(0, cfg.num_classes, (cfg.micro_batch_size,))
    for i in range(steps + 3):
        if i == 3:
            start = time.perf_counter()
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return cfg.micro_batch_size * steps / (time.perf_counter() - start)


def main() -> None:
    cfg = TrainConfig(world_size=2, micro_batch_size=32, dataset_size=4096)
    runs = launch(overhead, cfg, 6, 40, world_size=2, output="none")
    ours = summarize(runs[0]["ours"])
    base = summarize(runs[0]["base"])
    heavy = TrainConfig(world_size=2, micro_batch_size=256, hidden_width=1024, dataset_size=4096)
    one = launch(throughput, heavy.replace(world_size=1), 20, world_size=1, output="none")[0]
    two = sum(launch(throughput, heavy, 20, world_size=2, output="none"))
    write_results("trainer_overhead", {
        "step_overhead": {"ddpkit_step": ours, "hand_written_ddp_step": base,
                          "ratio_median": ours["median_s"] / base["median_s"], "target_ratio": 1.02},
        "weak_scaling": {"one_rank_samples_per_s": one, "two_ranks_samples_per_s": two,
                         "efficiency": two / (2 * one), "target_efficiency": 0.90,
                         "note": "2 ranks x 1 thread vs 1 rank x 1 thread, compute-bound MLP (hidden 1024, batch 256)"},
    })


if __name__ == "__main__":
    main()
