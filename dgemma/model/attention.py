"""Attention with q/k/v norms, per-layer head size and kv heads, score scale 1.0 and GQA.

Full-attention layers have no v_proj: their values are the (v-normed) raw keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgemma.cache import KVCache
from dgemma.config import TextConfig
from dgemma.model.layers import Linear, RMSNorm, apply_rope, rope_inv_freq


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        spec = cfg.layer(layer)
        self.layer, self.sliding = layer, spec.sliding
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, spec.num_kv_heads, spec.head_dim
        h = cfg.hidden_size
        self.q_proj = Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = Linear(h, self.n_kv * self.head_dim, bias=False)
        self.v_proj = Linear(h, self.n_kv * self.head_dim, bias=False) if spec.sliding else None
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope(spec.sliding), self.head_dim), persistent=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, start: int,
                lo: int, mask: torch.Tensor | None, write: bool = True) -> torch.Tensor:
        """x [B, L, H] at slots start..start+L, attending to slots lo..start+L.

        write=True puts the new keys in the cache first (encoder commit, or the decoder's scratch slots);
        write=False leaves the cache untouched and appends them (training, where the cache is in the graph).
        """
        b, n, _ = x.shape
        cos, sin = rope
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, n, self.n_heads, self.head_dim)), cos, sin)
        k_raw = self.k_proj(x).view(b, n, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, n, self.n_kv, self.head_dim) if self.v_proj is not None else k_raw
        k = apply_rope(self.k_norm(k_raw), cos, sin)
        v = self.v_norm(v)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if write:
            cache.write(self.layer, start, k, v)
            keys, values = cache.slice(self.layer, lo, start + n)
        else:
            keys, values = cache.slice(self.layer, lo, start)
            keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=1.0,
                                             enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
