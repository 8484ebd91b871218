"""The capstone's helpers: the FLOPs accounting against PyTorch's FLOP counter, MFU, and the
continuations against a chain whose rule is known."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ddpkit import capstone
from ddpkit.models import build_model, loss_fn


def _explicit_attention(q, k, v, is_causal=False):
    """Scaled dot-product attention as two plain matmuls, which the FLOP counter sees on any device."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if is_causal:
        T = q.shape[-2]
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("changes", [{}, {"d_model": 64, "n_layers": 3, "seq_len": 32}])
def test_flops_per_token_matches_pytorchs_flop_counter(changes, monkeypatch):
    cfg = capstone.capstone_config(**changes)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _explicit_attention)
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(tokens), tokens).backward()
    counted = counter.get_total_flops() / tokens.numel()
    assert capstone.flops_per_token(cfg) == counted, (capstone.flops_per_token(cfg), counted)


def test_mfu_is_achieved_over_peak_and_unknown_devices_give_none():
    cfg = capstone.capstone_config()
    per_token = capstone.flops_per_token(cfg)
    assert capstone.mfu(989e12 / per_token, cfg, "NVIDIA H100 80GB HBM3", 1) == pytest.approx(1.0)
    assert capstone.mfu(989e12 / per_token, cfg, "NVIDIA H100 80GB HBM3", 2) == pytest.approx(0.5)
    assert capstone.mfu(1.0, cfg, "a CPU", 1) is None


class _ChainModel(torch.nn.Module):
    """Predicts the next token from the current one with a given (V, V) table of scores."""

    def __init__(self, scores: torch.Tensor, context: int = 16) -> None:
        super().__init__()
        self.scores, self.pos_emb = scores, torch.nn.Embedding(context, 1)

    def forward(self, idx):
        return self.scores[idx]  # (B, T, V)


def test_continuations_follow_the_model_and_count_agreement_with_the_chain():
    transition = torch.softmax(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 4, dim=1)
    copy = capstone.continuations(_ChainModel(transition.log()), transition, [0, 5], 6)
    assert copy["model"] == copy["chain"] and copy["agreement"] == 1.0
    assert copy["chain"][0][1] == int(transition[0].argmax()) and len(copy["chain"][0]) == 7
    contrary = capstone.continuations(_ChainModel(-transition), transition, [0], 6)  # picks the least likely
    assert contrary["agreement"] == 0.0 and contrary["model"][0][1] == int(transition[0].argmin())


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA L40", 181.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA GH200 480GB", None), ("NVIDIA H200 NVL", 835.0), ("NVIDIA H200", 989.0),
])
def test_gpu_names_match_their_own_peak_word_by_word(name, peak):
    """A substring match would give the PCIe H100 the SXM peak and the L40 the L4's."""
    cfg = capstone.capstone_config()
    achieved = 100e12 / capstone.flops_per_token(cfg)  # tokens/s at 100 TFLOP/s
    assert capstone.mfu(achieved, cfg, name, 1) == (pytest.approx(100 / peak) if peak else None)


def test_gpus_without_bf16_tensor_cores_have_no_bf16_peak_and_their_fp16_one():
    """A T4 (Colab's free GPU) or V100 has fp16 tensor cores only: MFU of a bf16 run there against the
    fp16 peak would mislead, so there is none; an fp16 run is measured against it."""
    cfg = capstone.capstone_config()
    for name, peak, capability in (("Tesla T4", 65.0, "7.5"), ("Tesla V100-SXM2-16GB", 125.0, "7.0")):
        assert capstone.peak_tflops(name, "bf16") is None and capstone.peak_tflops(name, "fp16") == peak
        assert capstone.amp_for(capability) == "fp16"
        assert capstone.mfu(1e12 / capstone.flops_per_token(cfg), cfg.replace(amp="bf16"), name, 1) is None
        assert capstone.mfu(1e12 / capstone.flops_per_token(cfg), cfg.replace(amp="fp16"), name, 1) == pytest.approx(1 / peak)
    assert capstone.amp_for("8.0") == capstone.amp_for("9.0") == "bf16"
    assert capstone.peak_tflops("NVIDIA A100-SXM4-80GB", "fp16") == capstone.peak_tflops("NVIDIA A100-SXM4-80GB", "bf16")
