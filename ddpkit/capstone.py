"""The capstone: a tiny GPT on 4 ranks, with DDP and then ZeRO-1, a sharded checkpoint at the midpoint,
the job killed there and resumed on 4 ranks and on 2, and seed 004's invariants asserted on the way.

Seed 004's published demo stops at "RESUME VERIFIED" after reloading its checkpoint, never trains past
it, and its loss moves from 4.297 to 4.222 (ln 64 = 4.159 is a model that knows nothing). Here the
corpus has structure to learn (:class:`~ddpkit.data.MarkovTokens`: a sparse Markov chain whose own
entropy, 1.418 nats for the capstone's chain and data, is the best any model can reach), the loss falls well below half of ln(vocab),
and the resumed runs are compared with the uninterrupted one by hash.

What this module gives the notebook:

* :func:`capstone_config`: the run (GPT, 4 ranks, lr and steps sized to learn in seconds on a CPU);
* :class:`Invariants`: a hook that records, every step on every rank, the parameters' L2 norm (seed
  004's check: all ranks must agree, they hold replicas) and their sha256 (the stronger one: a norm
  misses a value whose sign flipped, a hash does not), that the loss is finite, and the state hashes at each
  save; :func:`replicas_agree` compares the ranks' records;
* :func:`train_capstone`: a function for ``ddpkit.launch``: the trainer with that hook, plus what the
  model predicts before and after training (greedy continuations against the chain's own);
* :func:`flops_per_token` and :func:`mfu`: model FLOPs utilisation, for a GPU run.
"""

from __future__ import annotations

import math
import re

import torch

from ddpkit import metrics
from ddpkit.config import TrainConfig
from ddpkit.hooks import Hook, StepResult

PEAK_TFLOPS = {  # dense 16-bit tensor-core peaks from the vendors' data sheets (half the "with sparsity" figure)
    # (model, variant or None): a device name matches when both are words of it, variants first.
    # From Ampere on, bf16 and fp16 peaks are the same figure.
    ("H100", "PCIE"): 756.0, ("H100", "NVL"): 835.0, ("H100", None): 989.0,
    ("H200", "NVL"): 835.0, ("H200", None): 989.0,
    ("A100", None): 312.0, ("L40S", None): 362.0, ("L40", None): 181.0, ("L4", None): 121.0, ("A10G", None): 125.0,
}
FP16_ONLY_TFLOPS = {  # Turing and Volta have fp16 tensor cores and no bf16 ones: a bf16 run there uses none of this
    ("T4", None): 65.0, ("V100", None): 125.0,
}


def capstone_config(world_size: int = 4, steps: int = 100, **changes) -> TrainConfig:
    """The capstone run: seed 004's model (2 blocks, d 32, 4 heads, vocab 64, context 16), micro-batch 4
    per rank, a learning rate that learns the chain in ~100 steps, dcp checkpoints."""
    return TrainConfig(**{"model": "gpt", "world_size": world_size, "steps": steps, "micro_batch_size": 4, "lr": 1e-2,
                          "warmup_steps": 5, "dataset_size": 4096, "checkpoint_format": "dcp", "log_every": 20, **changes})


class Invariants(Hook):
    """Seed 004's per-step invariants, recorded on every rank (compared across ranks afterwards)."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.hashes: list[str] = []
        self.finite = True
        self.at_save: dict[int, dict[str, str]] = {}

    def after_step(self, trainer, result: StepResult) -> None:
        with torch.no_grad():
            norm = torch.sqrt(sum(p.detach().double().pow(2).sum() for p in trainer.raw_model.parameters()))
        self.norms.append(float(norm))
        self.hashes.append(metrics.state_sha256(dict(trainer.raw_model.named_parameters())))
        self.finite &= math.isfinite(result.loss) and math.isfinite(float(norm))

    def on_saved(self, trainer, step: int) -> None:
        model_state, optimizer_state = trainer.strategy.state_dicts(trainer.model, trainer.optimizer, rank0_only=False)
        self.at_save[step] = {"param_sha256": metrics.state_sha256(model_state),
                              "optimizer_sha256": metrics.optimizer_sha256(optimizer_state)}


class _AfterSave(Hook):
    """Runs after the checkpoint cadence: hashes the state a save has just written."""

    def __init__(self, invariants: Invariants) -> None:
        self.invariants = invariants

    def after_step(self, trainer, result: StepResult) -> None:
        if result.checkpoint_s:
            self.invariants.on_saved(trainer, result.step)


def replicas_agree(ranks: list[dict]) -> dict[str, bool]:
    """Whether every rank's record (from :func:`train_capstone`) matches rank 0's at every step: by the
    parameter norm (``norms``) and by the parameters' sha256 (``hashes``). Replicas must pass both; a
    drift that keeps the norm (a value's sign flipped on one rank) passes the first and fails the second."""
    return {name: all(r[name] == ranks[0][name] for r in ranks) for name in ("norms", "hashes")}


@torch.no_grad()
def continuations(model: torch.nn.Module, transition: torch.Tensor, starts: list[int], length: int) -> dict:
    """Greedy continuations of single start tokens by the model and by the chain itself (its most likely
    next token each time), and how often the model's next-token choice is the chain's, over all tokens."""
    model.eval()
    out = {"model": [], "chain": []}
    for start in starts:
        seq = [start]
        for _ in range(length):
            logits = model(torch.tensor([seq[-model.pos_emb.num_embeddings:]]))
            seq.append(int(logits[0, -1].argmax()))
        out["model"].append(seq)
        chain = [start]
        for _ in range(length):
            chain.append(int(transition[chain[-1]].argmax()))
        out["chain"].append(chain)
    vocab = transition.shape[0]
    logits = model(torch.arange(vocab).unsqueeze(1))  # every token as a one-token context
    out["agreement"] = float((logits[:, -1].argmax(dim=1) == transition.argmax(dim=1)).float().mean())
    model.train()
    return out


def train_capstone(ctx, cfg: TrainConfig, attempt: int = 0, starts: tuple[int, ...] = (0, 7, 21)) -> dict:
    """Train ``cfg`` with the invariants recorded (a function for ``ddpkit.launch``). Returns the run
    summary, this rank's norms, parameter hashes and save hashes, and (rank 0) the model's continuations
    before and after."""
    from ddpkit.train import Trainer

    invariants = Invariants()
    trainer = Trainer(ctx, cfg, attempt, hooks=[invariants])
    trainer.hooks.append(_AfterSave(invariants))  # after the built-in cadence, which saves
    transition = trainer.dataset.transition
    before = continuations(trainer.raw_model, transition, list(starts), 10) if ctx.is_main and not trainer.resumed_from else None
    summary = trainer.fit()
    after = continuations(trainer.raw_model, transition, list(starts), 10) if ctx.is_main else None
    return {"summary": summary, "norms": invariants.norms, "hashes": invariants.hashes, "finite": invariants.finite,
            "at_save": invariants.at_save,
            "before": before, "after": after, "entropy_floor": trainer.dataset.entropy_floor(),
            "params": sum(p.numel() for p in trainer.raw_model.parameters())}


def flops_per_token(cfg: TrainConfig) -> float:
    """Training FLOPs per token: 6 per weight of the matmuls (forward 2, backward 4) plus attention's
    score and value products, 6 x 2 x n_layers x seq_len x d_model (the PaLM paper's accounting)."""
    d, L, T, V = cfg.d_model, cfg.n_layers, cfg.seq_len, cfg.vocab_size
    matmul_weights = L * (3 * d * d + d * d + 2 * 4 * d * d) + d * V  # qkv, proj, MLP, head (embeddings are lookups)
    return 6 * matmul_weights + 12 * L * T * d


def peak_tflops(device_name: str, amp: str = "bf16") -> float | None:
    """The dense tensor-core peak of a GPU for ``amp`` ("bf16" or "fp16"), from its name
    (``torch.cuda.get_device_name`` or nvidia-smi), or None if unknown or if the GPU has no tensor cores
    for that dtype (a T4 or V100 running bf16).

    Names are matched word by word, never by substring: "NVIDIA L40" is not an L4, "NVIDIA H100 PCIe"
    (HBM2e, 114 SMs) is not the SXM part ("NVIDIA H100 80GB HBM3", 132 SMs), "A100-SXM4-80GB" is an A100.
    """
    words = set(re.findall(r"[A-Z0-9]+", device_name.upper()))
    table = {**PEAK_TFLOPS, **FP16_ONLY_TFLOPS} if amp == "fp16" else PEAK_TFLOPS
    return next((tflops for (model, variant), tflops in table.items()
                 if model in words and (variant is None or variant in words)), None)


def amp_for(compute_capability: str) -> str:
    """The 16-bit dtype a GPU has tensor cores for, from its compute capability ("7.5" for a T4):
    bf16 from Ampere (8.0) on, fp16 before (fp16 needs the loss scaler; bf16 does not)."""
    return "bf16" if int(compute_capability.split(".")[0]) >= 8 else "fp16"


def mfu(tokens_per_s: float, cfg: TrainConfig, device_name: str, world_size: int) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the GPUs' peak for ``cfg.amp`` (None for an
    unknown device, or one without tensor cores for that dtype)."""
    peak = peak_tflops(device_name, cfg.amp)
    if peak is None:
        return None
    return tokens_per_s * flops_per_token(cfg) / (peak * 1e12 * world_size)
