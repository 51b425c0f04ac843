"""Gemma 4's vision tower and the multimodal embedder: one image's patches -> soft tokens in the text model's space.

The tower embeds patches (a linear map of their pixels plus learned x and y position rows), runs a bidirectional
encoder with 2D RoPE (half the head dims rotate with x, half with y), average-pools k x k patches into one soft token
(scaled by sqrt(hidden) in float32, then optionally standardised), and the embedder norms and projects them to the
text width. Submodule names follow the checkpoint's (`vision_tower.*`, `embed_vision.*`). One image per call: no
padding patches, so no attention mask (the reference pads to a fixed patch count and masks the padding out).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgemma.config import TextConfig, VisionConfig
from dgemma.model.layers import Linear, RMSNorm, apply_rope, gelu_tanh


class ClippableLinear(nn.Module):
    """A bias-free linear whose input and output may be clamped to stored ranges (`use_clipped_linears`)."""

    def __init__(self, cfg: VisionConfig, n_in: int, n_out: int):
        super().__init__()
        self.linear = Linear(n_in, n_out, bias=False)
        self.clipped = cfg.use_clipped_linears
        if self.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(name, torch.tensor(float("-inf") if name.endswith("min") else float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        return self.linear(x.clamp(self.input_min, self.input_max)).clamp(self.output_min, self.output_max)


def rope_2d(cfg: VisionConfig, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """positions [P, 2] (x, y) -> for x and for y, cos and sin [1, P, 1, head_dim / 2] (computed in float32)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=positions.device) / half)
    out = []
    for axis in range(2):
        freqs = positions[:, axis, None].float() * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[None, :, None, :]
        out.append((emb.cos().to(dtype), emb.sin().to(dtype)))
    return out


def apply_rope_2d(x: torch.Tensor, rope: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """x [1, P, heads, head_dim]: the first half of the head dims rotates with x, the second with y."""
    parts = x.chunk(2, dim=-1)
    return torch.cat([apply_rope(p, cos, sin) for p, (cos, sin) in zip(parts, rope)], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = ClippableLinear(cfg, h, self.n_heads * self.head_dim)
        self.k_proj = ClippableLinear(cfg, h, self.n_kv * self.head_dim)
        self.v_proj = ClippableLinear(cfg, h, self.n_kv * self.head_dim)
        self.o_proj = ClippableLinear(cfg, self.n_heads * self.head_dim, h)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, rope: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        b, n, _ = x.shape
        q = apply_rope_2d(self.q_norm(self.q_proj(x).view(b, n, self.n_heads, self.head_dim)), rope)
        k = apply_rope_2d(self.k_norm(self.k_proj(x).view(b, n, self.n_kv, self.head_dim)), rope)
        v = self.v_norm(self.v_proj(x).view(b, n, self.n_kv, self.head_dim))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=1.0,
                                             enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.gate_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = ClippableLinear(cfg, cfg.intermediate_size, cfg.hidden_size)
        self.act = gelu_tanh if cfg.hidden_activation == "gelu_pytorch_tanh" else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.self_attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, x: torch.Tensor, rope: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.input_proj = Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.ones(2, cfg.position_embedding_size, cfg.hidden_size))

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """patches [P, 3 * patch^2] in [0, 1], positions [P, 2] -> [1, P, hidden]."""
        x = self.input_proj((2 * (patches - 0.5)).to(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        return (x + (F.embedding(positions[:, 0], table[0]) + F.embedding(positions[:, 1], table[1])))[None]


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.num_hidden_layers))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = Encoder(cfg)
        if cfg.standardize:
            self.register_buffer("std_bias", torch.zeros(cfg.hidden_size))
            self.register_buffer("std_scale", torch.ones(cfg.hidden_size))

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One image's patches [P, 3 * patch^2] at positions [P, 2] -> soft tokens [P / k^2, hidden]."""
        x = self.patch_embedder(patches, positions)
        rope = rope_2d(self.cfg, positions, x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, rope)
        pooled = self._pool(x[0], positions).float() * self.cfg.hidden_size**0.5
        if self.cfg.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled.to(x.dtype)

    def _pool(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Average of each k x k block of patches, k = pooling_kernel_size, blocks in row-major order."""
        k = self.cfg.pooling_kernel_size
        n = x.shape[0] // k**2
        width = int(positions[:, 0].max()) + 1
        block = positions[:, 0] // k + (width // k) * (positions[:, 1] // k)
        weights = F.one_hot(block, n).float() / k**2  # [P, n]
        return (weights.T @ x.float()).to(x.dtype)


class MultimodalEmbedder(nn.Module):
    """Soft tokens -> the text model's width: a norm without weight, then a projection."""

    def __init__(self, cfg: VisionConfig, text: TextConfig):
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.embedding_projection = Linear(cfg.hidden_size, text.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class Vision(nn.Module):
    """The tower and the embedder: `forward(patches, positions)` -> one image's soft tokens [n, text hidden]."""

    def __init__(self, cfg: VisionConfig, text: TextConfig):
        super().__init__()
        self.tower = VisionTower(cfg)
        self.embed = MultimodalEmbedder(cfg, text)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed(self.tower(patches, positions))
