"""A Llama-3 style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

A plain nn.Module: nothing in this file knows about FSDP, rings or processes
(prime/parallelize.py wraps it, prime/diloco.py synchronizes it). The presets
in PRESETS name the shapes used in docs and configs; FLOPs per token for MFU
come from the shape (`ModelArgs.flops_per_token`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelArgs", "PRESETS", "preset", "Transformer", "TransformerBlock", "RMSNorm"]


@dataclass
class ModelArgs:
    """The shape of a model. Every field is fixed once the model is built."""

    dim: int = 4096
    """Hidden size (the residual stream width)."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads; the head size is dim / n_heads."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (None: same as n_heads). Must divide n_heads."""
    ffn_dim: int = 14336
    """Hidden size of the SwiGLU feed-forward block."""
    vocab_size: int = 128256
    """Embedding rows; must cover every token id of the data."""
    max_seq_len: int = 8192
    """Longest sequence the rotary tables are built for."""
    rope_theta: float = 500000.0
    """Base of the rotary embedding frequencies (Llama 3: 500000)."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""

    def validate(self) -> None:
        """Raises ValueError naming the field when the shape is inconsistent."""
        for name in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"the head size dim/n_heads = {self.dim // self.n_heads} must be even for rotary embeddings")
        kv = self.kv_heads
        if kv < 1 or self.n_heads % kv:
            raise ValueError(f"model.n_kv_heads ({kv}) must be >= 1 and divide model.n_heads ({self.n_heads})")
        if self.rope_theta <= 0:
            raise ValueError(f"model.rope_theta must be > 0, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"model.norm_eps must be > 0, got {self.norm_eps}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count from the shape (tied embeddings counted once)."""
        hd, kv = self.head_dim, self.kv_heads
        attn = self.dim * self.n_heads * hd * 2 + self.dim * kv * hd * 2  # wq, wo, wk, wv
        mlp = 3 * self.dim * self.ffn_dim
        block = attn + mlp + 2 * self.dim  # two RMSNorm weights
        emb = self.vocab_size * self.dim
        out = 0 if self.tie_embeddings else self.vocab_size * self.dim
        n = self.n_layers * block + self.dim + out
        return n + emb if include_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), the PaLM/Chinchilla convention.

        6 * N for every weight that takes part in a matrix multiply (all blocks and
        the output projection, not the embedding lookup), plus 12 * layers * dim *
        seq_len for the attention scores and their weighted sum. The causal mask
        is not subtracted, as in the usual MFU definition (PaLM appendix B).
        """
        n_matmul = self.num_params(include_embedding=False) - self.n_layers * 2 * self.dim - self.dim
        if self.tie_embeddings:
            n_matmul += self.vocab_size * self.dim  # the shared matrix is still multiplied at the output
        return 6.0 * n_matmul + 12.0 * self.n_layers * self.dim * seq_len


# Preset shapes. `tiny` (1.7M parameters, byte vocabulary) runs on a laptop CPU in
# seconds; `150M` and `1B` are the usual ablation sizes; `10B` is INTELLECT-1's shape.
PRESETS = {
    "tiny": ModelArgs(
        dim=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_dim=512, vocab_size=256, max_seq_len=1024, rope_theta=10000.0
    ),
    # 150M: GPT-2-small width and depth, Llama-2's 32000-token vocabulary (148M parameters).
    "150M": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2560, vocab_size=32000, max_seq_len=2048),
    # 1B: the Llama-3.2-1B shape (tied embeddings, 1.24B parameters), without its RoPE scaling.
    "1B": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256, max_seq_len=8192,
        tie_embeddings=True,
    ),
    # INTELLECT-1 (Prime Intellect, 2024): 42 layers, hidden 4096, 32 heads, context 8192,
    # Llama-3 vocabulary 128256 (model card). 8 KV heads and FFN 14336 (= Llama-3's SwiGLU
    # rule with multiplier 1.3 rounded to 1024) and untied embeddings are from the prime
    # repository's config as we recall it; they give 10.2B parameters.
    "10B": ModelArgs(
        dim=4096, n_layers=42, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, max_seq_len=8192,
        rope_theta=500000.0, tie_embeddings=False,
    ),
}


def preset(name: str, **overrides) -> ModelArgs:
    """The ModelArgs of preset `name` with fields replaced by `overrides` (None values ignored)."""
    if name not in PRESETS:
        raise ValueError(f"model.name must be one of {sorted(PRESETS)}, got {name!r}")
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"unknown model field(s) {bad}; valid fields: {sorted(fields)}")
    args = dataclasses.replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
    args.validate()
    return args


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_len, head_dim/2] in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates interleaved pairs (x[2i], x[2i+1]) of x [batch, seq, heads, head_dim] (Llama layout)."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention through scaled_dot_product_attention."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        if self.n_kv_heads != self.n_heads:
            # Expanding K/V costs memory but works on every SDPA backend and torch version.
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(x))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        # Output projections get a depth-scaled init so the residual stream does not grow with depth.
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self) -> None:
        for lin in (self.attention.wq, self.attention.wk, self.attention.wv, self.feed_forward.w1, self.feed_forward.w3):
            nn.init.trunc_normal_(lin.weight, std=0.02, a=-0.06, b=0.06)
        for lin in (self.attention.wo, self.feed_forward.w2):
            nn.init.trunc_normal_(lin.weight, std=self.out_std, a=-3 * self.out_std, b=3 * self.out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(nn.Module):
    """The decoder: tokens [batch, seq] (int64) -> logits [batch, seq, vocab].

    Build on the meta device for big models and call `init_weights()` after
    moving to the real device (`to_empty`); a model built on a real device is
    initialized in the constructor. Initialization draws from torch's global
    RNG, so the same seed gives the same weights on every node.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Rotary tables are derived data: not saved in checkpoints, rebuilt by init_weights.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if self.tok_embeddings.weight.device.type != "meta":
            self.init_weights()

    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        """(Re)initializes every parameter and rebuilds the rotary tables."""
        device = buffer_device or self.tok_embeddings.weight.device
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # `to_empty` from the meta device gives each module its own tensor (FSDP2 keeps shared ones shared):
            # tie again, or the output weight stays uninitialized memory and is trained (and synced) on its own
            self.output.weight = self.tok_embeddings.weight
        with torch.no_grad():
            cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=device)
            self.rope_cos, self.rope_sin = cos, sin
            nn.init.normal_(self.tok_embeddings.weight, std=1.0 if not self.args.tie_embeddings else 0.02)
            for layer in self.layers:
                layer.reset_parameters()
            self.norm.reset_parameters()
            if not self.args.tie_embeddings:
                std = self.args.dim**-0.5
                nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def num_params(self) -> int:
        """Parameters actually held (shared tensors counted once)."""
        return sum(p.numel() for p in self.parameters())
