"""The GPT: token + position embedding, N pre-norm blocks (causal self-attention + MLP),
a final LayerNorm and an lm_head (or the token embedding, with `tie_embeddings`).

Parameter names are the checkpoint's fqns (`model.` + these): `token_embedding.weight`,
`position_embedding.weight`, `blocks.0.attn_norm.weight`, `blocks.0.attn.qkv.weight`,
`blocks.0.attn.proj.weight`, `blocks.0.mlp_norm.weight`, `blocks.0.mlp.fc.weight`,
`blocks.0.mlp.proj.weight` (and `.bias`), `final_norm.weight`, `lm_head.weight` (untied only).

The Llama-shaped model (`--arch llama`) has the module names and weight layout of
transformers' `LlamaForCausalLM` and computes its forward pass with the same operations in
the same order (models/llama/modeling_llama.py, transformers 5.x, with the default "sdpa"
attention), so its weights load there as they are and give the same logits:
`model.embed_tokens.weight`, `model.layers.0.self_attn.{q,k,v,o}_proj.weight`,
`model.layers.0.mlp.{gate,up,down}_proj.weight`, `model.layers.0.input_layernorm.weight`,
`model.layers.0.post_attention_layernorm.weight`, `model.norm.weight` and `lm_head.weight`
(untied only: tied, there is no lm_head module, as save_pretrained writes a tied model).
transformers is never imported here.

Example:
    >>> torch.manual_seed(0); model = GPT(dim=32, layers=2, heads=2, vocab=128, seq_len=16)
    >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
    torch.Size([3, 16, 128])
    >>> llama = Llama(dim=32, layers=2, heads=4, kv_heads=2, vocab=64, intermediate_size=96)
    >>> sorted(llama.state_dict())[:2]
    ['lm_head.weight', 'model.embed_tokens.weight']
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from train_minimal.config import TrainConfig
from train_minimal.lora import apply_lora

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


# ---------------------------------------------------------------------------------------------
# The Llama-shaped model. Every op below mirrors transformers' modeling_llama.py line for line
# (same dtype casts, same order of additions and products): float32 logits are then equal
# bit for bit, not merely close.


class RMSNorm(nn.Module):
    """Root-mean-square LayerNorm without bias (transformers' LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


def rotary_cos_sin(length: int, head_dim: int, theta: float, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the rotary (cos, sin) of positions 0..length-1, each of shape (1, 1, length,
    head_dim): frequencies theta^(-2i/head_dim), the two halves repeated (transformers'
    default RoPE and `LlamaRotaryEmbedding.forward`)."""
    # Computed on the CPU in float32 as transformers computes inv_freq at init; never a
    # buffer, so a bfloat16 model does not round the frequencies.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    positions = torch.arange(length, device=device)[None, :]
    freqs = positions[..., None].float() * inv_freq.to(device=device, dtype=torch.float)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Return (-x2, x1) for the halves (x1, x2) of the last dimension (transformers' convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary positions; `kv_heads` key/value heads
    serve `heads` query heads (`heads / kv_heads` each)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.groups = heads // kv_heads
        self.scaling = self.head_dim ** -0.5
        self.dropout = dropout
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        shape = (batch, length, -1, self.head_dim)
        query = self.q_proj(x).view(shape).transpose(1, 2)
        key = self.k_proj(x).view(shape).transpose(1, 2)
        value = self.v_proj(x).view(shape).transpose(1, 2)
        query = (query * cos) + (rotate_half(query) * sin)
        key = (key * cos) + (rotate_half(key) * sin)
        attended = F.scaled_dot_product_attention(
            query, key, value, dropout_p=self.dropout if self.training else 0.0, scale=self.scaling,
            is_causal=True, enable_gqa=self.groups > 1)
        return self.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))


class SwiGLU(nn.Module):
    """The Llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, intermediate_size, bias=False)
        self.up_proj = nn.Linear(dim, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """One pre-norm Llama decoder layer (RMSNorm, attention, RMSNorm, SwiGLU): the unit FSDP
    shards and gathers at a time."""

    def __init__(self, dim: int, heads: int, kv_heads: int, intermediate_size: int, norm_eps: float,
                 dropout: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dim, norm_eps)
        self.self_attn = LlamaAttention(dim, heads, kv_heads, dropout)
        self.post_attention_layernorm = RMSNorm(dim, norm_eps)
        self.mlp = SwiGLU(dim, intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaTrunk(nn.Module):
    """Embedding, decoder layers and final norm: the `model.` submodule of LlamaForCausalLM."""

    def __init__(self, dim: int, layers: int, heads: int, kv_heads: int, vocab: int, intermediate_size: int,
                 norm_eps: float, dropout: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, intermediate_size, norm_eps, dropout)
                                    for _ in range(layers))
        self.norm = RMSNorm(dim, norm_eps)


class Llama(nn.Module):
    """A Llama-shaped decoder with LlamaForCausalLM's names; `forward(tokens)` returns logits
    of shape (batch, length, vocab)."""

    def __init__(self, dim: int, layers: int, heads: int, vocab: int, intermediate_size: int,
                 kv_heads: int | None = None, norm_eps: float = 1e-6, rope_theta: float = 10000.0,
                 tie_embeddings: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.rope_theta = rope_theta
        self.model = LlamaTrunk(dim, layers, heads, kv_heads or heads, vocab, intermediate_size, norm_eps, dropout)
        # Tied: logits use embed_tokens.weight directly (as GPT does), so no parameter is
        # shared between modules, and the state dict holds one copy as save_pretrained writes it.
        self.lm_head = None if tie_embeddings else nn.Linear(dim, vocab, bias=False)
        self.initialize(layers)

    @property
    def blocks(self) -> nn.ModuleList:
        """Return the decoder layers (what FSDP wraps one by one, as GPT's `blocks`)."""
        return self.model.layers

    def initialize(self, layers: int) -> None:
        """Draw initial weights from torch's global RNG: N(0, 0.02) (LlamaConfig's
        initializer_range), the residual projections o_proj and down_proj scaled by
        1/sqrt(2 * layers) as in GPT; RMSNorm weights are ones."""
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                residual = name.endswith((".o_proj", ".down_proj"))
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD / math.sqrt(2 * layers) if residual else INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        cos, sin = rotary_cos_sin(tokens.shape[1], self.head_dim, self.rope_theta, x.dtype, x.device)
        for block in self.model.layers:
            x = block(x, cos, sin)
        x = self.model.norm(x)
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight)
        return self.lm_head(x)


# The modules FSDP shards one at a time (FSDP1's transformer_auto_wrap_policy classes).
BLOCK_TYPES = (Block, LlamaBlock)


def build_model(config: TrainConfig) -> nn.Module:
    """Return the unsharded model a TrainConfig describes (draws from torch's global RNG);
    with `--lora-rank`, its base frozen and the targeted Linears wrapped (train_minimal/lora.py),
    the adapters drawn after the base weights, so the base equals a run's without LoRA."""
    if config.arch == "llama":
        llama = Llama(config.dim, config.layers, config.heads, config.vocab, config.intermediate_size,
                      kv_heads=config.kv_heads, norm_eps=config.norm_eps, rope_theta=config.rope_theta,
                      tie_embeddings=config.tie_embeddings, dropout=config.dropout)
        return apply_lora(llama, config)
    return GPT(config.dim, config.layers, config.heads, config.vocab, config.seq_len,
               tie_embeddings=config.tie_embeddings, dropout=config.dropout)


def parameter_count(model: nn.Module, trainable_only: bool = False) -> int:
    """Return the number of parameters of an unsharded model (only those that train, if asked)."""
    return sum(parameter.numel() for parameter in model.parameters()
               if parameter.requires_grad or not trainable_only)
