"""The attention views a cache implies (cf. mlx-lm's `cache.make_mask`): for a pass adding n tokens at slot
`start`, which cached slots its queries see (`Span.lo`) and through which mask, if any. The model asks its cache
(`KVCache.encoder_span` / `decoder_span` / `context_span`) and never builds a mask itself. Plain causal prefill and
unpadded batches get no mask, so SDPA's fused kernels stay eligible (docs/kernels.md); the encoder's mask grows with
the cache, so it is a `CausalMask`, built a block at a time."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from dgemma.config import TextConfig


class CacheLike(Protocol):
    """What the views read of a cache (`cache/kv.py`)."""

    cfg: TextConfig
    valid: Tensor  # [B, capacity] bool
    length: int

    def window_start(self, sliding: bool, start: int) -> int: ...

    def key_slots(self, sliding: bool, lo: int, start: int, n: int) -> tuple[int, Tensor | None]: ...

    def has_padding(self, lo: int) -> bool: ...


class CausalMask(NamedTuple):
    """The encoder's mask, never built whole: query i (slot q[i]) sees key k (slot kv[k], keys in the order the
    cache returns them) when kv[k] <= q[i], within `window` slots if given, and with `valid` [B, keys] only real
    tokens (a padding query sees itself, so no softmax row is empty)."""

    kv: Tensor
    q: Tensor
    window: int | None = None
    valid: Tensor | None = None
    groups: Tensor | None = None  # [B, n] the image run of each query (-1: text): a run's tokens see each other

    def block(self, rows: slice, keys: slice) -> Tensor:
        """[B or 1, 1, rows, keys] booleans."""
        kv, q = self.kv[keys][None], self.q[rows][:, None]
        mask = kv <= q
        if self.window is not None:
            mask &= kv > q - self.window
        mask = mask[None]
        if self.valid is not None:
            mask = mask & self.valid[:, keys][:, None]
            mask |= (kv == q)[None]
        if self.groups is not None:  # added after the window, as the reference's or-mask is
            mask = mask | self._same_image(rows, keys)
        return mask[:, None]

    def _same_image(self, rows: slice, keys: slice) -> Tensor:
        """[B, rows, keys] whether query and key are soft tokens of one image run (keys among the new tokens)."""
        n = self.groups.shape[1]
        offset = self.kv[keys] - self.q[0]  # a key's index among the new tokens (the queries)
        new = (offset >= 0) & (offset < n)
        key_groups = torch.where(new[None], self.groups[:, offset.clamp(0, n - 1)], -2)
        query_groups = self.groups[:, rows]
        return (query_groups[:, :, None] == key_groups[:, None, :]) & (query_groups[:, :, None] >= 0)


Mask = Tensor | CausalMask


def mask_block(mask: Mask, rows: slice, keys: slice) -> Tensor:
    """Rows and keys of a mask [B, 1, n or 1, keys] (a tensor of one row stands for every row)."""
    if isinstance(mask, CausalMask):
        return mask.block(rows, keys)
    return mask[..., rows if mask.shape[-2] > 1 else slice(None), keys]


class Span(NamedTuple):
    """Queries see cached slots lo.. and their own: through `mask` [B, 1, n or 1, keys] if given (keys in the
    order `KVCache.view` returns them), causally (SDPA's is_causal: nothing cached before, square scores) if
    `causal`, else everything. `rows_apart`: each query attends alone, as in a pass of one token (its mask row)."""

    lo: int
    mask: Mask | None = None
    causal: bool = False
    rows_apart: bool = False


def row_runs(span: Span) -> list[tuple[int, int] | None]:
    """Per query row of a rows-apart span (`Span.rows_apart`): the keys it sees when they are one run [a, b) of
    them (then a one-token pass sees exactly those slots, unmasked), else None (padding, a wrapped ring, a batch
    of rows: the row keeps its mask row). One host read."""
    mask = mask_block(span.mask, slice(None), slice(None))  # [B or 1, 1, n, keys]
    if mask.shape[0] > 1:
        return [None] * mask.shape[2]
    seen, keys = mask[0, 0], mask.shape[-1]
    first, last = seen.int().argmax(-1), keys - 1 - seen.flip(-1).int().argmax(-1)
    return [(a, b + 1) if b + 1 - a == c else None
            for a, b, c in zip(first.tolist(), last.tolist(), seen.sum(-1).tolist())]


def encoder_span(cache: CacheLike, start: int, n: int, sliding: bool, groups: Tensor | None = None,
                 rows_apart: bool = False) -> Span:
    """Causal attention over slots lo..start+n (and among each image run's tokens, `groups` [B, n]). No mask where
    the keys are exactly those slots, nothing visible is padding and the sliding window cuts no query's view short:
    one new token sees every slot; a first chunk is plain causal. `rows_apart` (n > 1): each token attends as a
    pass of that token alone would, through its row of the mask."""
    lo, window = cache.window_start(sliding, start), cache.cfg.sliding_window
    first, slots = cache.key_slots(sliding, lo, start, n)
    window_cuts = sliding and start + n - window > lo
    exact = first == lo and slots is None and groups is None
    rows_apart = rows_apart and n > 1
    if exact and not cache.has_padding(lo) and not window_cuts and (n == 1 or start == lo) and not rows_apart:
        return Span(lo, causal=n > 1)
    device = cache.valid.device
    kv = torch.arange(first, start + n, device=device) if slots is None else slots
    q = torch.arange(start, start + n, device=device)
    valid = _valid(cache, kv, slots, first, start + n) if cache.has_padding(first) else None
    return Span(lo, CausalMask(kv, q, window if sliding else None, valid, groups), rows_apart=rows_apart)


def decoder_span(cache: CacheLike, start: int, n: int, sliding: bool, hide: int = 0) -> Span:
    """The canvas sees all of itself but its first `hide` positions (those the cache holds already: early commit)
    and the valid cached slots; the cache knows on the host whether any visible slot is padding, so the unpadded
    case needs no device read and no mask."""
    lo = cache.window_start(sliding, start)
    first, slots = cache.key_slots(sliding, lo, start, n)
    if first >= lo and not cache.has_padding(lo) and not hide:
        return Span(lo)
    kv = torch.arange(first, start + n, device=cache.valid.device) if slots is None else slots
    mask = (kv >= lo)[None] & (_valid(cache, kv, slots, first, start + n) | (kv >= start)[None])
    mask &= ~((kv >= start) & (kv < start + hide))[None]
    return Span(lo, mask[:, None, None, :])


def context_span(cache: CacheLike, context: Tensor, n: int, sliding: bool) -> Span:
    """Training: row b's canvas sees its first context[b] cached tokens (the last window - 1 of them on sliding
    layers) and all of itself; the cache stays untouched."""
    slots = torch.arange(cache.length, device=context.device)[None]
    past = cache.valid[:, :cache.length] & (slots < context[:, None])
    if sliding:
        past = past & (slots > context[:, None] - cache.cfg.sliding_window)
    return Span(0, torch.cat([past, past.new_ones(past.shape[0], n)], dim=1)[:, None, None, :])


def _valid(cache: CacheLike, kv: Tensor, slots: Tensor | None, first: int, hi: int) -> Tensor:
    """[B, keys] whether each key's slot holds a real token."""
    return cache.valid[:, first:hi] if slots is None else cache.valid[:, kv]
