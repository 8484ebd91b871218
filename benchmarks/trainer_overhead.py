"""The trainer's step against a hand-written DDP loop, in the same ranks, alternating blocks of steps.

ddpkit's step (``Trainer.run_step``: hooks, phase timers, the comm-timing hook, the global loss every
rank agrees on, ``data_sha256``, logging), and the same without the comm-timing hook, against what the
PyTorch DDP tutorial writes:
a DataLoader over a ``DistributedSampler``, forward, backward, clip, AdamW, and an ``all_reduce`` of the
loss to log a global value. Same model, same data, world 2. Target: <= 1.02x.
Also weak scaling on a compute-bound MLP: 2 ranks x 1 thread against 1 rank x 1 thread. Target >= 90%.
"""

import os
import statistics
import sys
import time
import unittest.mock

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summarize, write_results  # noqa: E402

from ddpkit.config import TrainConfig  # noqa: E402
from ddpkit.launch import launch  # noqa: E402
from ddpkit.metrics import CommTimer  # noqa: E402
from ddpkit.models import build_model, loss_fn  # noqa: E402
from ddpkit.parallel.ddp import DDPStrategy  # noqa: E402
from ddpkit.train import Trainer, build_dataset  # noqa: E402


class HandWritten:
    """The tutorial loop, one step per call."""

    def __init__(self, ctx, cfg):
        self.cfg = cfg
        self.model = DDP(build_model(cfg))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        dataset = build_dataset(cfg)
        self.sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.seed, drop_last=True)
        self.loader = DataLoader(dataset, batch_size=cfg.micro_batch_size, sampler=self.sampler, drop_last=True)
        self.epoch, self.batches = 0, iter(self.loader)

    def step(self) -> float:
        try:
            batch = next(self.batches)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self.batches = iter(self.loader)
            batch = next(self.batches)
        loss = loss_fn(self.model(batch["inputs"]), batch["targets"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        dist.all_reduce(reported)  # a global loss to log, as every real loop has
        return reported.item() / dist.get_world_size()


def build_trainer(ctx, cfg, measure_comm: bool = True) -> Trainer:
    if measure_comm:
        trainer = Trainer(ctx, cfg)
    else:  # the same trainer, with DDP's built-in all-reduce instead of the timing hook
        with unittest.mock.patch.object(DDPStrategy, "comm_timer", lambda self, model: CommTimer()):
            trainer = Trainer(ctx, cfg)
    trainer.prepare()
    return trainer


def overhead(ctx, cfg, steps, warmup):
    """Round-robin single steps of each variant, so that drift on a noisy machine hits all alike."""
    cfg = cfg.replace(steps=steps + warmup)
    variants = {"ddpkit": build_trainer(ctx, cfg).run_step,
                "ddpkit_without_comm_timing": build_trainer(ctx, cfg, measure_comm=False).run_step,
                "hand_written": HandWritten(ctx, cfg).step}
    times = {name: [] for name in variants}
    for _ in range(steps + warmup):
        for name, step in variants.items():
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    return {name: values[warmup:] for name, values in times.items()}


def throughput(ctx, cfg, steps):
    model = DDP(build_model(cfg)) if ctx.world_size > 1 else build_model(cfg)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(cfg.micro_batch_size, cfg.input_width)
    y = torch.randint(0, cfg.num_classes, (cfg.micro_batch_size,))
    for i in range(steps + 3):
        if i == 3:
            start = time.perf_counter()
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return cfg.micro_batch_size * steps / (time.perf_counter() - start)


def main(steps: int = 600, warmup: int = 30) -> dict:
    cfg = TrainConfig(world_size=2, micro_batch_size=32, dataset_size=4096, log_every=10**6)
    runs = launch(overhead, cfg, steps, warmup, world_size=2, output="none")[0]
    s = {name: summarize(values) for name, values in runs.items()}
    base = s["hand_written"]["median_s"]
    heavy = TrainConfig(world_size=2, micro_batch_size=256, hidden_width=1024, dataset_size=4096)
    one = launch(throughput, heavy.replace(world_size=1), 20, world_size=1, output="none")[0]
    two = sum(launch(throughput, heavy, 20, world_size=2, output="none"))
    return write_results("trainer_overhead", {
        "step_overhead": {**s, "ratio_median": s["ddpkit"]["median_s"] / base,
                          "ratio_without_comm_timing": s["ddpkit_without_comm_timing"]["median_s"] / base,
                          "paired_ratio_median": statistics.median(a / b for a, b in zip(runs["ddpkit"], runs["hand_written"])),
                          "target_ratio": 1.02,
                          "note": f"world 2, MLP 256-512-512-8, micro-batch 32; {steps} steps each, one step of each "
                                  "variant in turn in the same ranks, after a warm-up. Without comm timing: DDP's "
                                  "built-in all-reduce instead of the Python hook that measures comm_s"},
        "weak_scaling": {"one_rank_samples_per_s": one, "two_ranks_samples_per_s": two,
                         "efficiency": two / (2 * one), "target_efficiency": 0.90,
                         "note": "2 ranks x 1 thread vs 1 rank x 1 thread, compute-bound MLP (hidden 1024, batch 256)"},
    })


if __name__ == "__main__":
    main()
