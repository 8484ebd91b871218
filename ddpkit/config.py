"""The control plane's contract: one validated config that says what a run trains and how.

Two ideas carry the lesson:

* **The global batch is explicit.** ``global_batch_size = micro_batch_size * grad_accum * dp``, where
  ``dp`` is the number of data-parallel replicas (the world size, until tensor or pipeline parallelism
  splits it: ``world = dp x cp x tp x pp``). Each optimizer step averages gradients over exactly that many
  samples, whatever the topology; so 2 ranks x 8, or 1 rank x 8 x accumulation 2, or 1 rank x 16 train
  the same model.
* **A digest names the training trajectory.** It is a sha256 over the sorted JSON of the fields that
  change *what is learned* (model, data, optimizer, seed, global batch), never Python's ``hash()``,
  which is salted per process (``PYTHONHASHSEED``) and so differs between ranks and between runs.
  Fields that change only *how* it runs (world size at a fixed global batch, paths, step budget,
  fault injection) are left out, so a run may resume on another topology or train for longer. Every
  field says which kind it is (``learned`` or ``runtime`` below): nothing is in or out of the digest
  by where it happens to be declared.

Every value is checked on construction, range included, and a bad one raises a ``ValueError`` that
names the fix: before any rank starts, not as a traceback from inside one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field

from ddpkit.parallel import expert_flags, fsdp_flags
from ddpkit.parallel.dims import ParallelDims

MODELS = ("mlp", "gpt")
AMP_MODES = ("off", "bf16", "fp16")
FAIL_MODES = ("raise", "exit", "kill", "hang", "slow", "sigterm", "nan", "spike")
STRATEGIES = ("ddp", "zero1", "zero1-torch", "fsdp2")  # each over the data-parallel axis of the layout
MESH_STRATEGIES = ("hsdp",)  # over a mesh of its own: compared, measured and tested apart from the ones above
SHARDED = fsdp_flags.SHARDED
PP_SCHEDULES = ("1f1b", "gpipe", "zero-bubble")  # the trainer's, one stage per rank
PP_NOTEBOOK_ONLY = ("interleaved", "zbv")  # several stages per rank: torch.distributed.pipelining, notebook 13
CHECKPOINT_FORMATS = ("full", "dcp")
MAX_SEED = 2**32 - 1  # numpy's limit; derived seeds (seed x 1,000,003 + epoch) stay inside torch's 64 bits
MAX_WORKERS = 32
MAX_DELAY_S = 60.0
MAX_TIMEOUT_S = 86_400.0  # a day: beyond it a "timeout" is a hang by another name
MEMORY_SHARE = 0.5  # a config whose ranks would need more than this share of the machine's memory is refused


def check_timeout(seconds) -> None:
    """A collective timeout is a finite number of seconds in (0, one day]; ValueError otherwise."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
        raise ValueError(f"timeout must be a finite number, got {seconds!r}")
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {seconds}")


def learned(default):
    """A field that changes what is learned: part of the digest; a resume may not change it."""
    return field(default=default, metadata={"digest": True})


def runtime(default):
    """A field that changes only how a run executes: outside the digest."""
    return field(default=default, metadata={"digest": False})


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs. Validated on construction: bad values raise ``ValueError``."""

    # --- what is learned (part of the digest) -------------------------------------------------
    model: str = learned("mlp")
    """``mlp`` (the handbook's 3-layer MLP on noisy class templates) or ``gpt`` (tiny GPT, Markov corpus)."""
    dataset_size: int = learned(2048)
    """Number of samples in the synthetic dataset (one epoch)."""
    seed: int = learned(17)
    """Seeds model init, data, and the epoch shuffles (0 .. 2**32-1)."""
    lr: float = learned(1e-3)
    """Peak AdamW learning rate, in (0, 1]."""
    warmup_steps: int = learned(5)
    """Linear warm-up from lr/warmup to lr; then constant (the schedule never depends on --steps)."""
    weight_decay: float = learned(0.01)
    """AdamW decoupled weight decay, in [0, 1)."""
    grad_clip: float = learned(1.0)
    """Clip the global gradient norm at this value, or disable if == 0.0."""
    amp: str = learned("off")
    """``off`` (fp32), ``bf16`` (autocast, no scaler needed) or ``fp16`` (autocast + GradScaler)."""
    input_width: int = learned(256)
    """MLP input features."""
    hidden_width: int = learned(512)
    """MLP hidden width."""
    num_classes: int = learned(8)
    """MLP output classes."""
    vocab_size: int = learned(64)
    """GPT vocabulary."""
    seq_len: int = learned(16)
    """GPT context length."""
    d_model: int = learned(32)
    """GPT embedding width."""
    n_heads: int = learned(4)
    """GPT attention heads (must divide d_model)."""
    n_layers: int = learned(2)
    """GPT transformer blocks."""
    experts: int = learned(0)
    """GPT only: 0 keeps each block's MLP; E >= 1 replaces it by a mixture of E expert MLPs
    (``parallel/experts.py``: router, top-k, capacity, load-balancing loss)."""
    top_k: int = learned(2)
    """With experts: how many experts each token goes to (1 .. experts)."""
    capacity_factor: float = learned(1.25)
    """With experts: each expert takes at most ceil(factor x top_k x tokens / E) of a rank's micro-batch's
    tokens; the rest are dropped (carried on by the residual connection)."""

    # --- how it runs (not in the digest) ------------------------------------------------------
    world_size: int = runtime(2)
    """Ranks (processes). Under torchrun it comes from WORLD_SIZE."""
    tp: int = runtime(1)
    """Tensor-parallel degree: ranks that split each layer (world = dp x tp x pp)."""
    pp: int = runtime(1)
    """Pipeline-parallel degree: ranks that split the layers into stages."""
    pp_schedule: str = runtime("1f1b")
    """The pipeline's schedule: ``1f1b``, ``gpipe`` or ``zero-bubble`` (ZB-H1: the backward split into its
    input-gradient and weight-gradient parts, the weight parts run later). Same gradients, same numbers."""
    cp: int = runtime(1)
    """Context-parallel degree: ranks that split every sequence's positions (ring attention; world = dp x cp x tp x pp)."""
    ep: int = runtime(1)
    """Expert-parallel degree: ranks that split the experts, E/ep each, tokens routed by all-to-all; they
    see different samples (world = dp, of which ep divides each expert's replicas: world / ep)."""
    strategy: str = runtime("ddp")
    """How the model, gradients and optimizer state are split across data-parallel ranks: ``ddp``
    (replicate all), ``zero1`` (ours: shard the optimizer state), ``zero1-torch`` (PyTorch's
    ZeroRedundancyOptimizer), ``fsdp2`` (shard parameters, gradients and optimizer state; with ``tp`` > 1
    each shard is of a tensor-parallel slice) or ``hsdp`` (fsdp2 within groups of ``shard`` ranks,
    replicated across ``replicate`` such groups)."""
    replicate: int = runtime(0)
    """Strategy hsdp: the replica groups, the outer axis of its 2-D mesh (0: world / shard)."""
    shard: int = runtime(0)
    """Strategy hsdp: the ranks each parameter is sharded over, the inner axis (0: world / replicate, or
    the whole world when neither is given)."""
    reshard_after_forward: bool | None = runtime(None)
    """Strategies fsdp2 and hsdp: True frees each block's gathered parameters after its forward and
    gathers them again in backward (ZeRO-3); False keeps them from forward to backward (ZeRO-2's
    memory for the parameters, no all-gather in backward); None is FSDP2's own default (True)."""
    activation_checkpointing: bool = runtime(False)
    """Recompute each block's activations in backward instead of keeping them (same numbers, less
    memory, more compute)."""
    micro_batch_size: int = runtime(8)
    """Samples per data-parallel rank per forward/backward."""
    grad_accum: int = runtime(1)
    """Micro-batches per optimizer step on each rank."""
    steps: int = runtime(40)
    """Optimizer steps to reach (counting steps done before a resume)."""
    backend: str = runtime("auto")
    """``auto`` (NCCL with one GPU per rank, else gloo), ``gloo`` or ``nccl``."""
    num_workers: int = runtime(0)
    """DataLoader worker processes per rank (0 = load in the training process)."""
    data_delay_s: float = runtime(0.0)
    """Extra seconds to load each sample: simulates a slow input pipeline."""
    checkpoint_dir: str | None = runtime(None)
    """Where checkpoints go; None disables checkpointing."""
    checkpoint_every: int = runtime(0)
    """Save every N steps (0 = only at the end). Step-based, so every rank agrees when to save."""
    checkpoint_every_s: float = runtime(0.0)
    """Also save when this many seconds have passed since the last save (0 = off): bounds lost work in
    time. Rank 0's clock decides and broadcasts the decision each step, so every rank saves together."""
    checkpoint_format: str = runtime("full")
    """``full`` (rank 0 writes one file with the whole state) or ``dcp`` (every rank writes its shards
    with torch.distributed.checkpoint; loads on another world size or strategy; needed for fsdp2)."""
    keep_last: int = runtime(3)
    """Keep this many newest good checkpoints."""
    resume: bool = runtime(False)
    """Resume from the newest checkpoint in checkpoint_dir that verifies."""
    overwrite_checkpoints: bool = runtime(False)
    """Without resume: delete the checkpoints already in checkpoint_dir instead of refusing the folder."""
    max_restarts: int = runtime(0)
    """On a rank failure, restart the whole world from the newest good checkpoint up to N times."""
    timeout: float = runtime(30.0)
    """Seconds a collective may wait before raising (PyTorch's defaults: 10 minutes on NCCL, 30 on gloo); a training step
    that takes this long plus a margin stops its rank (the stall limit: nothing waits forever)."""
    save_timeout: float = runtime(600.0)
    """Seconds a checkpoint save may take (the write, and every rank's wait until it is durable), apart
    from ``timeout``: a large save takes far longer than any collective of a training step."""
    metrics_dir: str | None = runtime(None)
    """One JSONL file per rank with step events; None disables."""
    summary_json: str | None = runtime(None)
    """Rank 0 writes the run summary here at the end."""
    log_every: int = runtime(10)
    """Rank 0 prints a loss-table row every N steps (and the last one)."""
    nan_guard: bool = runtime(False)
    """Reject a step whose global loss or gradient norm is not finite, or whose loss is a spike; roll back
    to the newest good checkpoint on a second rejection in a row (``guard.py``)."""
    spike_factor: float = runtime(3.0)
    """With nan_guard: a loss above this x the median of the recent accepted losses is a spike."""
    fail_at_step: int | None = runtime(None)
    """Fault injection: fail once, after this many optimizer steps."""
    fail_rank: int = runtime(0)
    """Fault injection: the rank that fails."""
    fail_mode: str = runtime("raise")
    """Fault injection: ``raise`` an exception, ``exit`` the process, ``kill`` it with SIGKILL, ``hang``,
    or ``slow``: from ``fail_at_step`` on, spend ``slow_step_s`` more per step (a straggler); ``sigterm``:
    send itself SIGTERM, a preemption notice to this rank only; ``nan``: this rank's forward gives NaN for
    one step (a bad batch); ``spike``: every rank's weights are damaged (x 8) before the step."""
    slow_step_s: float = runtime(0.05)
    """Fault injection, mode ``slow``: extra seconds the slow rank spends loading each step's data."""

    def __post_init__(self) -> None:
        def need(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(message)

        def flag(name: str) -> str:
            return name.replace("_", "-")

        for f in dataclasses.fields(self):  # types first: a string or a bool where a number belongs
            value = getattr(self, f.name)
            if f.type in ("int", "int | None") and value is not None:
                need(isinstance(value, int) and not isinstance(value, bool), f"{flag(f.name)} must be a whole number, got {value!r}")
            if f.type == "float":
                need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                     f"{flag(f.name)} must be a finite number, got {value!r}")
        need(self.model in MODELS, f"unknown model {self.model!r}: use one of {', '.join(MODELS)}")
        need(self.amp in AMP_MODES, f"unknown amp mode {self.amp!r}: use one of {', '.join(AMP_MODES)}")
        need(self.fail_mode in FAIL_MODES, f"unknown fail mode {self.fail_mode!r}: use one of {', '.join(FAIL_MODES)}")
        need(self.strategy in STRATEGIES + MESH_STRATEGIES,
             f"unknown strategy {self.strategy!r}: use one of {', '.join(STRATEGIES + MESH_STRATEGIES)}")
        need(self.checkpoint_format in CHECKPOINT_FORMATS,
             f"unknown checkpoint format {self.checkpoint_format!r}: use one of {', '.join(CHECKPOINT_FORMATS)}")
        need(isinstance(self.activation_checkpointing, bool), "activation-checkpointing must be True or False")
        need(not (self.strategy in SHARDED and self.checkpoint_dir and self.checkpoint_format == "full"),
             f"strategy {self.strategy} keeps only a shard of each parameter on every rank: use --checkpoint-format dcp "
             "(every rank writes its own shards)")
        for name in ("world_size", "tp", "pp", "cp", "ep", "micro_batch_size", "grad_accum", "dataset_size", "keep_last",
                     "input_width", "hidden_width", "num_classes", "vocab_size", "seq_len",
                     "d_model", "n_heads", "n_layers", "log_every"):
            need(getattr(self, name) >= 1, f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "warmup_steps", "checkpoint_every", "max_restarts", "num_workers", "replicate", "shard", "experts"):
            need(getattr(self, name) >= 0, f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        need(0 <= self.seed <= MAX_SEED, f"seed must be in 0 .. {MAX_SEED}, got {self.seed}")
        need(0 < self.lr <= 1, f"lr must be in (0, 1], got {self.lr}")
        need(0 <= self.weight_decay < 1, f"weight-decay must be in [0, 1), got {self.weight_decay}")
        need(self.grad_clip >= 0, f"grad-clip must be >= 0, got {self.grad_clip}")
        need(isinstance(self.nan_guard, bool), "nan-guard must be True or False")
        need(1 < self.spike_factor <= 1e6, f"spike-factor must be in (1, 1e6], got {self.spike_factor}")
        for name in ("data_delay_s", "slow_step_s"):
            need(0 <= getattr(self, name) <= MAX_DELAY_S, f"{flag(name)} must be in [0, {MAX_DELAY_S:g}] seconds, got {getattr(self, name)}")
        check_timeout(self.timeout)
        need(isinstance(self.save_timeout, (int, float)) and 0 < self.save_timeout <= MAX_TIMEOUT_S,
             f"save-timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {self.save_timeout}")
        need(self.num_workers <= MAX_WORKERS, f"num-workers must be <= {MAX_WORKERS}, got {self.num_workers}")
        need(self.d_model % self.n_heads == 0, f"n-heads ({self.n_heads}) must divide d-model ({self.d_model})")
        need(self.world_size % (self.tp * self.pp) == 0,
             f"world size {self.world_size} is not divisible by tp x pp = {self.tp} x {self.pp}: use a world size "
             f"that is a multiple of {self.tp * self.pp}")
        need(self.tp == 1 or self.strategy in ("ddp", "fsdp2"),
             f"tensor parallelism combines with strategy ddp or fsdp2 across replicas, not {self.strategy}: "
             f"use --strategy ddp or fsdp2")
        fsdp_flags.check(self, need)
        need(self.cp == 1 or (self.model == "gpt" and self.strategy == "ddp"),
             "context parallelism splits the GPT's sequences, with DDP across the rest of the world: use --model gpt "
             "--strategy ddp")
        need(self.world_size % (self.cp * self.tp * self.pp) == 0 and self.seq_len % (2 * self.cp) == 0,
             f"cp {self.cp} (times tp {self.tp} and pp {self.pp}) must divide the world size ({self.world_size}), and cp "
             f"half the sequence length ({self.seq_len}): choose a cp that divides both")
        expert_flags.check(self, need)
        need(self.tp == 1 or self.model == "gpt",
             "tensor parallelism splits the GPT's attention heads and MLP: use --model gpt")
        need(self.tp == 1 or (self.n_heads % self.tp == 0 and 4 * self.d_model % self.tp == 0),
             f"tp {self.tp} must divide the attention heads ({self.n_heads}) and the MLP width ({4 * self.d_model}): "
             f"choose a tp that divides {self.n_heads}")
        need(self.pp == 1 or self.strategy == "ddp",
             f"pipeline parallelism combines with strategy ddp across replicas, not {self.strategy}: use --strategy ddp")
        need(self.pp == 1 or self.model == "gpt", "pipeline parallelism cuts the GPT's blocks into stages: use --model gpt")
        need(self.pp_schedule in PP_SCHEDULES,
             f"pp-schedule {self.pp_schedule} holds several stages per rank, which the trainer's pipeline does not: "
             f"see notebook 13, or use one of {', '.join(PP_SCHEDULES)}" if self.pp_schedule in PP_NOTEBOOK_ONLY else
             f"unknown pp-schedule {self.pp_schedule!r}: use one of {', '.join(PP_SCHEDULES)}")
        need(self.pp > 1 or self.pp_schedule == "1f1b", f"pp-schedule {self.pp_schedule} schedules a pipeline: use --pp >= 2")
        need(self.pp <= self.n_layers,
             f"pp {self.pp} is more stages than the model's {self.n_layers} blocks: use --pp <= {self.n_layers} "
             f"or raise --n-layers")
        need(self.global_batch_size <= self.dataset_size,
             f"global batch {self.global_batch_size} (micro {self.micro_batch_size} x accum "
             f"{self.grad_accum} x world {self.dp}) is larger than the dataset "
             f"({self.dataset_size} samples): lower the batch or raise --dataset-size")
        need(not self.resume or self.checkpoint_dir is not None, "--resume needs --checkpoint-dir")
        need(not self.checkpoint_every or self.checkpoint_dir is not None, "--checkpoint-every needs --checkpoint-dir")
        need(0 <= self.checkpoint_every_s <= MAX_TIMEOUT_S,
             f"checkpoint-every-s must be from 0 (off) to {MAX_TIMEOUT_S:g} seconds, got {self.checkpoint_every_s:g}")
        need(not self.checkpoint_every_s or self.checkpoint_dir is not None,
             "--checkpoint-every-s needs --checkpoint-dir")
        need(not (self.resume and self.overwrite_checkpoints),
             "--resume continues the checkpoints that --overwrite-checkpoints would delete: choose one")
        need(0 <= self.fail_rank < self.world_size,
             f"fail-rank {self.fail_rank} is not a rank of a world of {self.world_size}")
        need(self.fail_at_step is None or self.fail_at_step >= 0, "fail-at-step must be >= 0")
        need_bytes, have_bytes = self.estimated_bytes_per_rank() * self.world_size, physical_memory()
        need(not have_bytes or need_bytes <= MEMORY_SHARE * have_bytes,
             f"this config needs about {need_bytes / 2**30:.1f} GiB for {self.world_size} ranks (each builds "
             f"the {self.dataset_size}-sample dataset and the model), more than half of this machine's "
             f"{have_bytes / 2**30:.1f} GiB: lower --dataset-size or the model widths")

    @property
    def hsdp_mesh(self) -> tuple[int, int]:
        """Strategy hsdp's (replicate, shard) sizes, the ones not given filled in from the world size."""
        return fsdp_flags.hsdp_mesh(self.world_size, self.replicate, self.shard)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: world / (tp x pp x cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dims(self) -> ParallelDims:
        """The parallel layout this config asks for."""
        return ParallelDims.from_world(self.world_size, self.tp, self.pp, self.cp)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step across the whole job: micro x accum x dp."""
        return self.micro_batch_size * self.grad_accum * self.dp

    def estimated_bytes_per_rank(self) -> int:
        """What one rank holds at least: the synthetic dataset, and fp32 weights, gradients and 2 Adam moments."""
        if self.model == "mlp":
            data = self.dataset_size * (self.input_width * 4 + 8)
            params = (self.input_width + 1) * self.hidden_width + (self.hidden_width + 1) * (self.hidden_width + self.num_classes)
        else:
            data = self.dataset_size * (self.seq_len + 1) * 8
            params = ((self.vocab_size * 2 + self.seq_len) * self.d_model
                      + self.n_layers * (13 + 8 * max(0, self.experts - 1)) * self.d_model**2)  # an MLP is 8 d^2 of 13
        return data + 16 * params

    def semantics(self) -> dict:
        """The fields that decide what is learned, plus the global batch: what the digest covers."""
        names = [f.name for f in dataclasses.fields(self) if f.metadata["digest"]]
        if not self.experts:  # the dense model: its routing fields decide nothing, and its digest stays as it was
            names = [n for n in names if n not in ("experts", "top_k", "capacity_factor")]
        return {**{n: getattr(self, n) for n in names}, "global_batch_size": self.global_batch_size}

    def digest(self) -> str:
        """Stable sha256 of :meth:`semantics`: equal on every rank, in every process, on every run."""
        payload = json.dumps(self.semantics(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()

    def replace(self, **changes) -> "TrainConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def physical_memory() -> int:
    """Bytes of RAM on this machine (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
