"""The two models the kit trains: the handbook's MLP, and a tiny GPT.

The MLP is enough to show gradient synchronisation. The GPT adds what an MLP hides: an embedding
(sparse-looking gradients), LayerNorm weights that must stay in sync, masked attention, and a separate
LM head (untied here for clarity; GPT-2 ties it to the token embedding).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from ddpkit.config import TrainConfig


class MLP(nn.Module):
    """``Linear(256,512)-GELU-Linear(512,512)-GELU-Linear(512,8)`` by default, as in the handbook."""

    def __init__(self, input_width: int = 256, hidden_width: int = 512, num_classes: int = 8):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_width, hidden_width), nn.GELU(),
            nn.Linear(hidden_width, hidden_width), nn.GELU(),
            nn.Linear(hidden_width, num_classes),
        )

    activation_checkpointing = False
    """Keep only each layer's input in forward and recompute the rest in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint_sequential(self.net, 3, x, use_reentrant=False)  # (B, num_classes)
        return self.net(x)  # (B, input_width) -> (B, num_classes)


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t sees positions <= t."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """2 blocks, d=32, 4 heads, vocab 64, context 16 by default: a few tens of thousands of parameters."""

    def __init__(self, vocab_size: int = 64, seq_len: int = 16, d_model: int = 32,
                 n_heads: int = 4, n_layers: int = 2):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)  # separate head, not tied
        for name, p in self.named_parameters():  # GPT-2 init: small normal weights, scaled residuals
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    activation_checkpointing = False
    """Keep only each block's input in forward and recompute the block in backward: activation memory
    falls from every intermediate of every block to one (B, T, C) tensor per block, for one more
    forward pass of the blocks (about a third more compute, since backward costs about two forwards)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def build_model(cfg: TrainConfig) -> nn.Module:
    """The model a config names, initialised from ``cfg.seed`` (identical on every rank)."""
    torch.manual_seed(cfg.seed)
    if cfg.model == "mlp":
        model = MLP(cfg.input_width, cfg.hidden_width, cfg.num_classes)
    else:
        model = TinyGPT(cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_heads, cfg.n_layers)
        if cfg.experts:  # every block's MLP becomes a mixture of experts (parallel/experts.py)
            from ddpkit.parallel.experts import moe_gpt

            moe_gpt(model, cfg.experts, cfg.top_k, cfg.capacity_factor, seed=cfg.seed)
    model.activation_checkpointing = cfg.activation_checkpointing
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy for both models: (B, K) vs (B,), or (B, T, V) vs (B, T) averaged per sample."""
    if logits.dim() == 3:  # GPT: mean over positions gives one loss per sample
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        per_sample = per_token.view(targets.shape).mean(dim=1)  # (B,)
    else:
        per_sample = F.cross_entropy(logits.float(), targets, reduction="none")  # (B,)
    return per_sample.mean() if reduction == "mean" else per_sample.sum() if reduction == "sum" else per_sample


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
