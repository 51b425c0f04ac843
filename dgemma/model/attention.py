"""Attention with q/k/v norms, per-layer head size and kv heads, score scale 1.0 and GQA.

Full-attention layers have no v_proj: their values are the (v-normed) raw keys. A pass's rows come in `Part`s, one
per cache (one for a batch sharing a cache, one per request with caches of their own), and a `Span` says which
cached slots a part sees and whether it needs a mask: plain causal prefill and unpadded batches call SDPA without one,
so the fused kernels stay eligible (docs/kernels.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dgemma.cache import KVCache
from dgemma.config import TextConfig
from dgemma.model.layers import Linear, RMSNorm, apply_rope, rope_inv_freq


# Flash kernels take head dims up to this; past it (and with a mask) CUDA SDPA uses the memory-efficient kernel,
# which does not broadcast GQA heads itself: without expanded kv it would fall back to math.
FLASH_MAX_HEAD_DIM = 256
# Mask entries one SDPA call takes at most (its float copy: 4 MB at float32).
MASK_FLOATS = 1 << 20


class Span(NamedTuple):
    """Queries see cached slots lo.. and their own: through `mask` [B, 1, n or 1, keys] if given (keys in the
    order `KVCache.view` returns them), causally (SDPA's is_causal: nothing cached before, square scores) if
    `causal`, else everything."""

    lo: int
    mask: torch.Tensor | None = None
    causal: bool = False


class Part(NamedTuple):
    """Rows of a pass that share one cache (the whole batch, or one request): the cache, the first slot their new
    tokens take, and what they see."""

    cache: KVCache
    start: int
    span: Span


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: Span) -> torch.Tensor:
    """SDPA over q [B, heads, n, D], k/v [B, kv_heads, S, D] with score scale 1.0. A mask with many query rows
    (a prefill chunk after a long cache) is taken a block of rows at a time: SDPA turns a boolean mask into a
    float copy, which would otherwise grow with the cache."""
    m = span.mask
    rows = max(1, MASK_FLOATS // k.shape[2])
    if m is not None and m.shape[-2] > rows:
        return torch.cat([attend(q[:, :, i:i + rows], k, v, span._replace(mask=m[..., i:i + rows, :]))
                          for i in range(0, q.shape[2], rows)], dim=2)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and q.is_cuda and (span.mask is not None or q.shape[-1] > FLASH_MAX_HEAD_DIM):
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, is_causal=span.causal, scale=1.0,
                                          enable_gqa=k.shape[1] != q.shape[1])


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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], parts: list[Part],
                write: bool = True) -> torch.Tensor:
        """x [B, L, H]; each part's rows take slots start..start+L of its cache and attend to slots span.lo.. of it.

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
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        outs, row = [], 0
        for cache, start, span in parts:
            rows = slice(row, row + cache.batch_size)
            row = rows.stop
            if write:
                keys, values = cache.view(self.layer, span.lo, start, k[rows], v[rows])
            else:
                keys, values = cache.slice(self.layer, span.lo, start)
                keys, values = torch.cat([keys, k[rows]], dim=2), torch.cat([values, v[rows]], dim=2)
            outs.append(attend(q[rows], keys, values, span))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
