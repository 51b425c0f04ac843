"""Attention with q/k/v norms, per-layer head size and kv heads, score scale 1.0 and GQA.

Full-attention layers have no v_proj: their values are the v-normed k_proj output, their keys the k-normed and
rotated one. The cache keeps that output alone for them, and each pass derives the keys and values of the slots it
reads (`derive`) with the reference's ops, so they are bit for bit what storing them would give; past WHOLE_KEYS
slots a block of keys at a time (`blocked.py`). A pass's rows come in `Part`s, one per cache (one for a batch sharing
a cache, one per request with caches of their own), and a `Span` the cache gives (`cache/views.py`) says which
cached slots a part sees and whether it needs a mask: plain causal prefill and unpadded batches call SDPA without
one, so the fused kernels stay eligible (docs/kernels.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dgemma.cache import KVCache
from dgemma.config import TextConfig
from dgemma.cache.views import Span, mask_block, row_runs
from dgemma.model.blocked import attend_blocks
from dgemma.model.layers import Linear, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq


# Flash kernels take head dims up to this; past it (and with a mask) CUDA SDPA uses the memory-efficient kernel,
# which does not broadcast GQA heads itself: without expanded kv it would fall back to math.
FLASH_MAX_HEAD_DIM = 256
# Mask entries one SDPA call takes at most (SDPA makes a float copy of a boolean mask: 1 MB at float32).
MASK_FLOATS = 1 << 18
# Queries a pass may have for `attend` to skip SDPA on a CPU (measured crossover: SDPA wins from ~16).
FEW_QUERIES = 4
# Full-attention layers reading more cached slots than this (without a graph) attend a block of keys at a time,
# deriving only that block's keys and values; blocks hold at most BLOCK_FLOATS scores.
WHOLE_KEYS = 1024
BLOCK_FLOATS = 1 << 18


class Part(NamedTuple):
    """Rows of a pass that share one cache (the whole batch, or one request): the cache, the first slot their new
    tokens take, what they see, and for full-attention layers the positions [B, keys] of the slots they read (from
    which those layers derive their keys)."""

    cache: KVCache
    start: int
    span: Span
    positions: torch.Tensor | None = None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: Span) -> torch.Tensor:
    """SDPA over q [B, heads, n, D], k/v [B, kv_heads, S, D] with score scale 1.0. A mask is taken a block of
    query rows at a time: SDPA turns a boolean mask into a float copy, which would otherwise grow with the cache.
    A few queries on a CPU (a decoded token, a row of a rows-apart check, a short draft) take blocked.py's float32
    softmax instead: SDPA's CPU flash kernel spent 10-50x longer on one query, 1.5-3.5x on four (docs/kernels.md)."""
    if q.shape[2] <= FEW_QUERIES and q.device.type == "cpu" and not torch.is_grad_enabled():
        return attend_blocks(q, k.shape[2], lambda keys: (k[:, :, keys], v[:, :, keys]), span.mask, span.causal,
                             max(16, BLOCK_FLOATS // (q.shape[1] * q.shape[2])))
    if span.mask is None:
        return _sdpa(q, k, v, None, span.causal)
    rows = max(1, MASK_FLOATS // k.shape[2])
    blocks = [_sdpa(q[:, :, i:i + rows], k, v, mask_block(span.mask, slice(i, i + rows), slice(None)), False)
              for i in range(0, q.shape[2], rows)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)


def _sdpa(q, k, v, mask, causal):
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and q.is_cuda and (mask is not None or q.shape[-1] > FLASH_MAX_HEAD_DIM):
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=1.0,
                                          enable_gqa=k.shape[1] != q.shape[1])


def one_token_views(seen: tuple[torch.Tensor, ...], part: Part) -> list[tuple]:
    """For each query row of a rows-apart pass: (keys' tensors, positions, span) as a pass of that token alone sees
    them (`cache.views.row_runs`): SDPA and the blocked path split keys by the number of queries, which at bfloat16
    changes the rounding."""
    mask = mask_block(part.span.mask, slice(None), slice(None))  # [B or 1, 1, n, keys]
    views = []
    for i, run in enumerate(row_runs(part.span)):
        if run is None:
            views.append((seen, part.positions, Span(part.span.lo, mask[:, :, i:i + 1])))
        else:
            at = slice(*run)
            positions = None if part.positions is None else part.positions[:, at]
            views.append((tuple(t[:, :, at] for t in seen), positions, Span(part.span.lo)))
    return views


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
        with torch.device("cpu"):  # arithmetic on the meta device (a load's skeleton) would import torch._dynamo: 1.3 s
            inv_freq = rope_inv_freq(cfg.rope(spec.sliding), self.head_dim)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], parts: list[Part],
                write: bool = True, keep: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """x [B, L, H]; each part's rows take slots start..start+L of its cache and attend to slots span.lo.. of it.

        write=True puts the new keys in the cache first (encoder commit, or the decoder's scratch slots);
        write=False leaves the cache untouched and appends them (training, where the cache is in the graph).
        keep=(index [B, L], n): x holds only these of a canvas's n positions; the others' keys and values stay
        what the canvas's last pass wrote to their scratch slots (settled positions, engine/features/skip_settled.py).
        """
        b, n, _ = x.shape
        cos, sin = rope
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, n, self.n_heads, self.head_dim)), cos, sin).transpose(1, 2)
        new = self._new(x, cos, sin)
        outs, row = [], 0
        for part in parts:
            rows = slice(row, row + part.cache.batch_size)
            row = rows.stop
            ours = tuple(t[rows] for t in new)
            if keep is not None:
                index = keep[0][rows, None, :, None].expand_as(ours[0])
                ours = tuple(old.scatter(2, index, t) for old, t in
                             zip(part.cache.read(self.layer, part.start, keep[1]), ours))
            if write:
                seen = part.cache.view(self.layer, part.span.lo, part.start, *ours)
            else:
                old = part.cache.slice(self.layer, part.span.lo, part.start)
                seen = tuple(torch.cat([o, t[rows]], dim=2) for o, t in zip(old, new))
            if part.span.rows_apart:
                outs.append(torch.cat([self._attend(q[rows][:, :, i:i + 1], *one)
                                       for i, one in enumerate(one_token_views(seen, part))], dim=2))
            else:
                outs.append(self._attend(q[rows], seen, part.positions, part.span))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def _new(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the cache stores for x's tokens, each [B, kv_heads, n, D]: keys and values, or for full-attention
        layers k_proj's output alone."""
        b, n, _ = x.shape
        k_raw = self.k_proj(x).view(b, n, self.n_kv, self.head_dim)
        if self.v_proj is None:
            return (k_raw.transpose(1, 2),)
        k = apply_rope(self.k_norm(k_raw), cos, sin)
        v = self.v_norm(self.v_proj(x).view(b, n, self.n_kv, self.head_dim))
        return k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q: torch.Tensor, seen: tuple[torch.Tensor, ...], positions: torch.Tensor | None,
                span: Span) -> torch.Tensor:
        if self.v_proj is not None:
            return attend(q, *seen, span)
        return self._attend_derived(q, seen[0], positions, span)

    def _attend_derived(self, q: torch.Tensor, raw: torch.Tensor, positions: torch.Tensor, span: Span) -> torch.Tensor:
        """Attention of a full-attention layer over cached k_proj outputs raw [B, kv_heads, S, D] at `positions`
        [B, S]: whole (SDPA) for a short history or with a graph, else a block of keys at a time."""
        s = raw.shape[2]
        if torch.is_grad_enabled() or s <= WHOLE_KEYS:
            return attend(q, *self.derive(raw, positions), span)
        block = max(16, BLOCK_FLOATS // (q.shape[1] * q.shape[2]))
        return attend_blocks(q, s, lambda keys: self.derive(raw[:, :, keys], positions[:, keys]),
                             span.mask, span.causal, block)

    def derive(self, raw: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys rope(k_norm(raw)) and values v_norm(raw) of full-attention slots raw [B, kv_heads, S, D] at
        `positions` [B, S]: the reference's ops, element for element, so bit for bit what it computes."""
        cos, sin = (t.transpose(1, 2) for t in rope_cos_sin(self.inv_freq, positions, raw.dtype))
        return apply_rope(self.k_norm(raw), cos, sin), self.v_norm(raw)
