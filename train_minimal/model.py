"""The GPT: token + position embedding, N pre-norm blocks (causal self-attention + MLP),
a final LayerNorm and an lm_head (or the token embedding, with `tie_embeddings`).

Parameter names are the checkpoint's fqns (`model.` + these): `token_embedding.weight`,
`position_embedding.weight`, `blocks.0.attn_norm.weight`, `blocks.0.attn.qkv.weight`,
`blocks.0.attn.proj.weight`, `blocks.0.mlp_norm.weight`, `blocks.0.mlp.fc.weight`,
`blocks.0.mlp.proj.weight` (and `.bias`), `final_norm.weight`, `lm_head.weight` (untied only).

Example:
    >>> torch.manual_seed(0); model = GPT(dim=32, layers=2, heads=2, vocab=128, seq_len=16)
    >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
    torch.Size([3, 16, 128])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers).
INIT_STD = 0.02


class Attention(nn.Module):
    """Causal multi-head self-attention with one fused qkv projection."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        query, key, value = self.qkv(x).split(dim, dim=2)
        shape = (batch, length, self.heads, dim // self.heads)
        query, key, value = (t.view(shape).transpose(1, 2) for t in (query, key, value))
        attended = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(attended.transpose(1, 2).reshape(batch, length, dim))


class MLP(nn.Module):
    """Two linear layers with GELU, 4x wide."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block: the unit FSDP shards and gathers at a time."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x)))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    """A GPT-style decoder; `forward(tokens)` returns logits of shape (batch, length, vocab)."""

    def __init__(self, dim: int, layers: int, heads: int, vocab: int, seq_len: int,
                 tie_embeddings: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.token_embedding = nn.Embedding(vocab, dim)
        self.position_embedding = nn.Embedding(seq_len, dim)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.final_norm = nn.LayerNorm(dim)
        # Tied: logits use token_embedding.weight directly, so no module shares a parameter
        # with another (FSDP1 size-based wrapping could otherwise split a shared weight).
        self.lm_head = None if tie_embeddings else nn.Linear(dim, vocab, bias=False)
        self.initialize(layers)

    def initialize(self, layers: int) -> None:
        """Draw GPT-2 initial weights from torch's global RNG (seed it first)."""
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = INIT_STD / math.sqrt(2 * layers) if name.endswith(".proj") else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        if self.lm_head is None:
            return F.linear(x, self.token_embedding.weight)
        return self.lm_head(x)


def parameter_count(model: nn.Module) -> int:
    """Return the number of parameters of an unsharded model."""
    return sum(parameter.numel() for parameter in model.parameters())
