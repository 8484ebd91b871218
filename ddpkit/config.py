"""The control plane's contract: one validated config that says what a run trains and how.

Two ideas carry the lesson:

* **The global batch is explicit.** ``global_batch_size = micro_batch_size * grad_accum * world_size``.
  Each optimizer step averages gradients over exactly that many samples, whatever the topology; so
  2 ranks x 8, or 1 rank x 8 x accumulation 2, or 1 rank x 16 train the same model.
* **A digest names the training trajectory.** It is a sha256 over the sorted JSON of the fields that
  change *what is learned* (model, data, optimizer, seed, global batch), never Python's ``hash()``,
  which is salted per process (``PYTHONHASHSEED``) and so differs between ranks and between runs.
  Fields that change only *how* it runs (world size at a fixed global batch, paths, step budget,
  fault injection) are left out, so a run may resume on another topology or train for longer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

MODELS = ("mlp", "gpt")
AMP_MODES = ("off", "bf16", "fp16")
FAIL_MODES = ("raise", "exit", "kill", "hang", "slow")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs. Validated on construction: bad values raise ``ValueError``."""

    # --- what is learned (part of the digest) -------------------------------------------------
    model: str = "mlp"
    """``mlp`` (the handbook's 3-layer MLP on a teacher-labelled set) or ``gpt`` (tiny GPT, Markov corpus)."""
    dataset_size: int = 2048
    """Number of samples in the synthetic dataset (one epoch)."""
    seed: int = 17
    """Seeds model init, data, and the epoch shuffles."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 5
    """Linear warm-up from lr/warmup to lr; then constant (the schedule never depends on --steps)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm at this value, or disable if == 0.0."""
    amp: str = "off"
    """``off`` (fp32), ``bf16`` (autocast, no scaler needed) or ``fp16`` (autocast + GradScaler)."""
    input_width: int = 256
    """MLP input features."""
    hidden_width: int = 512
    """MLP hidden width."""
    num_classes: int = 8
    """MLP output classes."""
    vocab_size: int = 64
    """GPT vocabulary."""
    seq_len: int = 16
    """GPT context length."""
    d_model: int = 32
    """GPT embedding width."""
    n_heads: int = 4
    """GPT attention heads (must divide d_model)."""
    n_layers: int = 2
    """GPT transformer blocks."""

    # --- how it runs (not in the digest) ------------------------------------------------------
    world_size: int = 2
    """Ranks (processes). Under torchrun it comes from WORLD_SIZE."""
    micro_batch_size: int = 8
    """Samples per rank per forward/backward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank."""
    steps: int = 40
    """Optimizer steps to reach (counting steps done before a resume)."""
    backend: str = "auto"
    """``auto`` (NCCL with one GPU per rank, else gloo), ``gloo`` or ``nccl``."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 = load in the training process)."""
    data_delay_s: float = 0.0
    """Extra seconds to load each sample: simulates a slow input pipeline."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; None disables checkpointing."""
    checkpoint_every: int = 0
    """Save every N steps (0 = only at the end). Step-based, so every rank agrees when to save."""
    keep_last: int = 3
    """Keep this many newest checkpoints."""
    resume: bool = False
    """Resume from the newest checkpoint in checkpoint_dir that verifies."""
    max_restarts: int = 0
    """On a rank failure, restart the whole world from the newest good checkpoint up to N times."""
    timeout: float = 30.0
    """Seconds a collective may wait before raising (PyTorch's default is 30 minutes)."""
    metrics_dir: str | None = None
    """One JSONL file per rank with step events; None disables."""
    summary_json: str | None = None
    """Rank 0 writes the run summary here at the end."""
    log_every: int = 10
    """Rank 0 prints a loss-table row every N steps (and the last one)."""
    fail_at_step: int | None = None
    """Fault injection: fail once, after this many optimizer steps."""
    fail_rank: int = 0
    """Fault injection: the rank that fails."""
    fail_mode: str = "raise"
    """Fault injection: ``raise`` an exception, ``exit`` the process, ``kill`` it with SIGKILL, ``hang``,
    or ``slow``: from ``fail_at_step`` on, spend ``slow_step_s`` more per step (a straggler)."""
    slow_step_s: float = 0.05
    """Fault injection, mode ``slow``: extra seconds the slow rank spends loading each step's data."""

    def __post_init__(self) -> None:
        def need(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(message)

        need(self.model in MODELS, f"unknown model {self.model!r}: use one of {', '.join(MODELS)}")
        need(self.amp in AMP_MODES, f"unknown amp mode {self.amp!r}: use one of {', '.join(AMP_MODES)}")
        need(self.fail_mode in FAIL_MODES, f"unknown fail mode {self.fail_mode!r}: use one of {', '.join(FAIL_MODES)}")
        for name in ("world_size", "micro_batch_size", "grad_accum", "dataset_size", "keep_last",
                     "input_width", "hidden_width", "num_classes", "vocab_size", "seq_len",
                     "d_model", "n_heads", "n_layers", "log_every"):
            need(getattr(self, name) >= 1, f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "warmup_steps", "checkpoint_every", "max_restarts", "num_workers"):
            need(getattr(self, name) >= 0, f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(self.weight_decay >= 0 and self.grad_clip >= 0 and self.data_delay_s >= 0 and self.slow_step_s >= 0,
             "weight-decay, grad-clip, data-delay-s and slow-step-s must be >= 0")
        need(self.timeout > 0, f"timeout must be > 0 seconds, got {self.timeout}")
        need(self.d_model % self.n_heads == 0, f"n-heads ({self.n_heads}) must divide d-model ({self.d_model})")
        need(self.global_batch_size <= self.dataset_size,
             f"global batch {self.global_batch_size} (micro {self.micro_batch_size} x accum "
             f"{self.grad_accum} x world {self.world_size}) is larger than the dataset "
             f"({self.dataset_size} samples): lower the batch or raise --dataset-size")
        need(not self.resume or self.checkpoint_dir is not None, "--resume needs --checkpoint-dir")
        need(0 <= self.fail_rank < self.world_size,
             f"fail-rank {self.fail_rank} is not a rank of a world of {self.world_size}")
        need(self.fail_at_step is None or self.fail_at_step >= 0, "fail-at-step must be >= 0")

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step across the whole job."""
        return self.micro_batch_size * self.grad_accum * self.world_size

    def semantics(self) -> dict:
        """The fields that decide what is learned, plus the global batch: what the digest covers."""
        names = [f.name for f in dataclasses.fields(self)][: _FIRST_RUNTIME_FIELD]
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


_FIRST_RUNTIME_FIELD = [f.name for f in dataclasses.fields(TrainConfig)].index("world_size")
