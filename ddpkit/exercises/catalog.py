"""The exercises the grader knows: for each, the names its contract defines, its checks, and what it must
not use.

``checks`` maps a check's name (the otter test case's name too) to the check function (``module:name``)
and the contract names it is called with. ``forbidden`` lists the implementations that would answer the
exercise for the learner, the kit's own and PyTorch's, each with the sentence a learner gets when one of
them runs in a process that runs their code (:func:`ddpkit.exercises.witness.watch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

C10D = "torch.distributed.distributed_c10d"
DDP = "torch.nn.parallel.distributed:DistributedDataParallel"


def _collectives(label: str) -> dict[str, str]:
    names = ("all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
             "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce",
             "gather", "scatter", "all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list")
    return {f"{C10D}:{n}": label.format(name=n) for n in names}


@dataclass(frozen=True)
class Exercise:
    id: str  # the notebook's name without .ipynb
    checks: dict[str, tuple[str, tuple[str, ...]]]  # check name -> (function ref, contract names)
    forbidden: dict[str, str] = field(default_factory=dict)  # ref -> sentence
    budget_units: float = 150.0  # the check's wall-clock limit, in baselines (see timing.py)
    trains: bool = False  # its ranks take optimizer steps: the sandbox imports what a first step loads, once

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for _, names in self.checks.values() for n in names))


KIT = "uses the kit's own {what} ({ref}): write your own"

EXERCISES = [
    Exercise("01_config_digest", {"config_digest": ("ddpkit.exercises.config:check_config_digest", ("config_digest",))},
             {"ddpkit.config:TrainConfig.digest": KIT.format(what="digest", ref="ddpkit.config.TrainConfig.digest")}),
    Exercise("02_sampler", {"sampler": ("ddpkit.exercises.data:check_sampler", ("ResumableDistributedSampler",))},
             {"ddpkit.data:ResumableDistributedSampler": KIT.format(what="sampler", ref="ddpkit.data.ResumableDistributedSampler"),
              "torch.utils.data.distributed:DistributedSampler": "uses torch's DistributedSampler, the class this "
                                                                  "exercise rebuilds: write the partition yourself"}),
    Exercise("03_state_bytes", {"state_bytes": ("ddpkit.exercises.memory:check_state_bytes", ("state_bytes",))},
             {"ddpkit.parallel.memory:bytes_per_rank": KIT.format(what="calculator", ref="ddpkit.parallel.memory")},
             trains=True),
    Exercise("04_broadcast_parameters",
             {"broadcast_parameters": ("ddpkit.exercises.init:check_broadcast_parameters", ("broadcast_parameters",))},
             {DDP: "wraps the model in torch's DistributedDataParallel, which does the broadcast for you: send the "
                   "parameters yourself",
              "torch.distributed.utils:_sync_module_states": "calls torch's _sync_module_states, DDP's own broadcast: "
                                                             "send the parameters yourself"}),
    Exercise("05_train_step", {"train_step": ("ddpkit.exercises.step:check_train_step", ("train_step",))},
             {"ddpkit.step:train_step": KIT.format(what="train step", ref="ddpkit.step.train_step"),
              "ddpkit.step:MicroStep": KIT.format(what="micro-step", ref="ddpkit.step.MicroStep")},
             trains=True),
    Exercise("05_ddp_from_scratch", {"naive": ("ddpkit.exercises.ddp:check_naive_ddp", ("NaiveDDP",)),
                                     "overlap": ("ddpkit.exercises.ddp:check_overlap_ddp", ("OverlapDDP",)),
                                     "buckets": ("ddpkit.exercises.ddp:check_bucketed_ddp", ("BucketedDDP",))},
             {DDP: "runs torch's DistributedDataParallel (its reducer does the work): build the hooks and buckets "
                   "yourself",
              "torch.distributed._composable.replicate:replicate": "runs torch's replicate (DDP underneath): build the "
                                                                     "hooks and buckets yourself",
              "ddpkit.parallel.ddp:DDPStrategy": KIT.format(what="DDP strategy", ref="ddpkit.parallel.ddp")},
             budget_units=400.0,
             trains=True),
    Exercise("06_checkpoint", {"checkpoint": ("ddpkit.exercises.checkpointing:check_checkpoint", ("save_fn", "load_fn"))},
             {"ddpkit.files:atomic_write": KIT.format(what="atomic writer", ref="ddpkit.files"),
              "ddpkit.files:write_atomic": KIT.format(what="atomic writer", ref="ddpkit.files"),
              "ddpkit.checkpoint:save": KIT.format(what="checkpoint writer", ref="ddpkit.checkpoint.save")},
             budget_units=250.0),
    Exercise("07_global_mean_loss",
             {"global_mean_loss": ("ddpkit.exercises.metrics:check_global_mean_loss", ("global_mean_loss",))},
             {"ddpkit.step:global_loss_sum": KIT.format(what="global loss", ref="ddpkit.step.global_loss_sum"),
              "ddpkit.step:GlobalLossSum": KIT.format(what="global loss", ref="ddpkit.step.GlobalLossSum")}),
    Exercise("08_rank_wiring", {"rank_wiring": ("ddpkit.exercises.wiring:check_rank_wiring", ("rank_wiring",))},
             {"ddpkit.runtime:RankContext": KIT.format(what="rank context", ref="ddpkit.runtime.RankContext"),
              "ddpkit.runtime:device_for": KIT.format(what="device rule", ref="ddpkit.runtime.device_for")}),
    Exercise("09_ring_all_reduce",
             {"ring_all_reduce": ("ddpkit.exercises.collectives:check_ring_all_reduce", ("ring_all_reduce",))},
             {"ddpkit.parallel.comm:ring_all_reduce": KIT.format(what="ring", ref="ddpkit.parallel.comm.ring_all_reduce"),
              "ddpkit.parallel.comm:ring_reduce_scatter_": KIT.format(what="ring", ref="ddpkit.parallel.comm"),
              "ddpkit.parallel.comm:ring_all_gather_": KIT.format(what="ring", ref="ddpkit.parallel.comm"),
              "torch.distributed.nn.functional:all_reduce": "calls torch.distributed.nn.functional.all_reduce, a "
                                                            "collective with autograd: build the sum from sends and "
                                                            "receives only",
              **_collectives("calls dist.{name}, a collective: build the sum from sends and receives only")}),
    Exercise("10_zero1", {"zero1": ("ddpkit.exercises.sharding:check_zero1", ("ZeroAdamW",))},
             {"ddpkit.parallel.zero:ZeroAdamW": KIT.format(what="ZeRO-1 optimizer", ref="ddpkit.parallel.zero.ZeroAdamW"),
              "torch.distributed.optim.zero_redundancy_optimizer:ZeroRedundancyOptimizer":
                  "uses torch's ZeroRedundancyOptimizer, the feature this exercise rebuilds: shard the state yourself"},
             trains=True),
    Exercise("10_fsdp_from_scratch", {"fsdp": ("ddpkit.exercises.fsdp:check_fsdp", ("MyFSDP",))},
             {"torch.distributed.fsdp.fully_sharded_data_parallel:FullyShardedDataParallel":
                  "runs torch's FSDP, the feature this exercise rebuilds: gather and scatter the shards yourself",
              "torch.distributed.fsdp._fully_shard._fully_shard:fully_shard":
                  "runs torch's fully_shard (FSDP2), the feature this exercise rebuilds: gather and scatter yourself",
              "ddpkit.parallel.fsdp:FSDPStrategy": KIT.format(what="FSDP strategy", ref="ddpkit.parallel.fsdp")},
             trains=True),
    Exercise("10b_reshard_after_forward",
             {"held_between": ("ddpkit.exercises.resharding_memory:check_held_between", ("held_between",))},
             {"ddpkit.parallel.memory:bytes_per_rank": KIT.format(what="calculator", ref="ddpkit.parallel.memory"),
              "ddpkit.parallel.fsdp_depth:run_fsdp": KIT.format(what="FSDP2 measurement", ref="ddpkit.parallel.fsdp_depth"),
              "ddpkit.parallel.fsdp_depth:calculator_bytes": KIT.format(what="calculator", ref="ddpkit.parallel.fsdp_depth"),
              "torch.distributed.fsdp._fully_shard._fully_shard:fully_shard":
                  "runs torch's fully_shard to measure the answer: count the bytes from the shapes yourself"},
             budget_units=250.0,
             trains=True),
    Exercise("11_load_shard", {"load_shard": ("ddpkit.exercises.resharding:check_load_shard", ("load_shard",))}),
    Exercise("12_f_and_g", {"f_and_g": ("ddpkit.exercises.tensor:check_f_and_g", ("copy_to_parallel", "reduce_from_parallel"))},
             {"ddpkit.parallel.tensor:CopyToTP": KIT.format(what="f", ref="ddpkit.parallel.tensor"),
              "ddpkit.parallel.tensor:ReduceFromTP": KIT.format(what="g", ref="ddpkit.parallel.tensor"),
              "torch.distributed.nn.functional:all_reduce": "calls torch.distributed.nn.functional.all_reduce, an "
                                                            "autograd all-reduce: write the autograd Functions yourself"}),
    Exercise("13_one_f_one_b", {"one_f_one_b": ("ddpkit.exercises.pipeline:check_one_f_one_b", ("one_f_one_b",))},
             {"ddpkit.parallel.pipeline:one_f_one_b": KIT.format(what="schedule", ref="ddpkit.parallel.pipeline.one_f_one_b"),
              "torch.distributed.pipelining.schedules:Schedule1F1B": "uses torch's Schedule1F1B, the schedule this "
                                                                     "exercise asks for: order the actions yourself"}),
    Exercise("13b_interleaved_order",
             {"interleaved_order": ("ddpkit.exercises.interleaved:check_interleaved_order", ("interleaved_order",))},
             {**{f"ddpkit.parallel.pipeline_schedules:{name}": KIT.format(what="schedule", ref="ddpkit.parallel.pipeline_schedules")
                 for name in ("interleaved", "zero_bubble", "generate", "torch_order")},
              "torch.distributed.pipelining.schedules:ScheduleInterleaved1F1B":
                  "uses torch's ScheduleInterleaved1F1B, the schedule this exercise asks for: order the actions yourself",
              "torch.distributed.pipelining.schedules:_get_1f1b_rank_ops":
                  "uses torch's own 1F1B order builder (_get_1f1b_rank_ops): order the actions yourself",
              "torch.distributed.pipelining.schedules:_get_warmup_ops":
                  "uses torch's own warm-up count (_get_warmup_ops): work out the warm-up yourself"}),
    Exercise("14_should_stop", {"should_stop": ("ddpkit.exercises.agreement:check_should_stop", ("should_stop",))}),
    Exercise("15_same_everywhere",
             {"same_everywhere": ("ddpkit.exercises.invariants:check_same_everywhere", ("same_everywhere",))},
             {"ddpkit.metrics:state_sha256": KIT.format(what="hash", ref="ddpkit.metrics.state_sha256")}),
    Exercise("17_ring_attention_step",
             {"attend_block": ("ddpkit.exercises.attention:check_attend_block", ("attend_block",))},
             {"ddpkit.parallel.context:block_attention": KIT.format(what="block attention", ref="ddpkit.parallel.context"),
              "ddpkit.parallel.context:merge": KIT.format(what="merge", ref="ddpkit.parallel.context.merge"),
              "ddpkit.parallel.context:RingAttention": KIT.format(what="ring attention", ref="ddpkit.parallel.context"),
              **_collectives("calls dist.{name}, a collective: merge the block you are given; the ring brings the others")}),
    Exercise("18_expert_dispatch", {"dispatch": ("ddpkit.exercises.dispatch:check_dispatch", ("dispatch",))},
             {"ddpkit.parallel.expert_parallel:exchange_counts": KIT.format(what="count exchange",
                                                                            ref="ddpkit.parallel.expert_parallel"),
              "ddpkit.parallel.expert_parallel:AllToAll": KIT.format(what="all-to-all", ref="ddpkit.parallel.expert_parallel"),
              "ddpkit.parallel.expert_parallel:ExpertParallelMoE": KIT.format(what="expert-parallel MoE",
                                                                              ref="ddpkit.parallel.expert_parallel"),
              **{ref: label for ref, label in _collectives(
                  "calls dist.{name}, which hands every rank every row: send each row only to the rank of its expert").items()
                 if not ref.endswith(("all_to_all", "all_to_all_single"))}}),
    Exercise("20_flight_culprit", {"culprit": ("ddpkit.exercises.flight_culprit:check_culprit", ("culprit",))},
             {"ddpkit.debug.flight:analyze": KIT.format(what="Flight Recorder analysis", ref="ddpkit.debug.flight.analyze"),
              "ddpkit.debug.flight:stall_summary": KIT.format(what="Flight Recorder analysis", ref="ddpkit.debug.flight"),
              "torch.distributed.flight_recorder.components.builder:build_db":
                  "runs torch's Flight Recorder analyzer, the tool this exercise rebuilds: line the entries up yourself"},
             budget_units=250.0),
    Exercise("20_same_samples", {"fed_the_same": ("ddpkit.exercises.same_samples:check_fed_the_same", ("fed_the_same",))},
             {"ddpkit.data:check_partition": KIT.format(what="partition check", ref="ddpkit.data.check_partition")}),
    Exercise("00_build_it_live",
             {"config": ("ddpkit.exercises.trainer:check_config_class", ("TrainConfig",)),
              "sampler": ("ddpkit.exercises.data:check_sampler", ("ResumableDistributedSampler",)),
              "model_and_optimizer": ("ddpkit.exercises.trainer:check_model_and_optimizer", ("build_model_and_optimizer",)),
              "broadcast_parameters": ("ddpkit.exercises.init:check_broadcast_parameters", ("broadcast_parameters",)),
              "train_step": ("ddpkit.exercises.step:check_train_step", ("train_step",)),
              "checkpoint": ("ddpkit.exercises.checkpointing:check_checkpoint", ("save_fn", "load_fn")),
              "global_mean_loss": ("ddpkit.exercises.metrics:check_global_mean_loss", ("global_mean_loss",)),
              "run": ("ddpkit.exercises.trainer:check_trainer", ("run",))},
             {"ddpkit.train:Trainer": KIT.format(what="trainer", ref="ddpkit.train.Trainer"),
              "ddpkit.train:run": KIT.format(what="trainer", ref="ddpkit.train.run"),
              "ddpkit.data:ResumableDistributedSampler": KIT.format(what="sampler", ref="ddpkit.data.ResumableDistributedSampler"),
              "ddpkit.step:train_step": KIT.format(what="train step", ref="ddpkit.step.train_step"),
              "ddpkit.step:MicroStep": KIT.format(what="micro-step", ref="ddpkit.step.MicroStep"),
              "ddpkit.files:atomic_write": KIT.format(what="atomic writer", ref="ddpkit.files")},
             budget_units=500.0,
             trains=True),
]

BY_ID = {e.id: e for e in EXERCISES}


def exercise(exercise_id: str) -> Exercise:
    try:
        return BY_ID[exercise_id]
    except KeyError:
        raise KeyError(f"no exercise {exercise_id!r}: one of {', '.join(sorted(BY_ID))}") from None


def check_of(exercise_id: str, check: str):
    """The check function itself (unwrapped from :func:`ddpkit.exercises.graded`)."""
    from ddpkit.exercises.witness import resolve

    ref, _ = exercise(exercise_id).checks[check]
    fn = resolve(ref)
    return getattr(fn, "__wrapped__", fn)
