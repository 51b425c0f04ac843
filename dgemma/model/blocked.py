"""Attention pieces whose whole form grows with the cache, taken a block at a time: the encoder's causal mask
(`CausalMask`, built for the rows or keys asked), and attention over keys and values produced a block of keys at
a time (`attend_blocks`, an online softmax: full-attention layers derive their keys from the cache per block, so
no tensor the size of the history is made)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor


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


def attend_blocks(q: Tensor, n_keys: int, keys_values: Callable[[slice], tuple[Tensor, Tensor]],
                  mask: Mask | None, causal: bool, block: int) -> Tensor:
    """Attention (score scale 1.0) of q [B, heads, n, D] over n_keys keys that `keys_values(keys)` gives a block
    [B, kv_heads, block, D] at a time, in float32, merging the blocks' softmaxes; `causal`: lower-right aligned."""
    b, h, n, d = q.shape
    out = total = top = qg = None
    for j in range(0, n_keys, block):
        keys = slice(j, min(j + block, n_keys))
        k, v = keys_values(keys)
        kv_heads = k.shape[1]
        if qg is None:  # GQA: the query heads of one kv head side by side, [B, kv_heads, groups * n, D]
            qg = q.float().reshape(b, kv_heads, -1, d)
        scores = (qg @ k.float().transpose(-1, -2)).view(b, kv_heads, h // kv_heads, n, -1)
        if mask is not None:
            scores.masked_fill_(~mask_block(mask, slice(None), keys)[:, :, None], float("-inf"))
        elif causal:
            visible = torch.arange(keys.start, keys.stop, device=q.device)[None] <= torch.arange(
                n_keys - n, n_keys, device=q.device)[:, None]
            scores.masked_fill_(~visible, float("-inf"))
        new_top = scores.amax(-1, keepdim=True)
        if top is not None:
            new_top = torch.maximum(top, new_top)
        shift = new_top.masked_fill(new_top == float("-inf"), 0)  # rows with nothing visible yet
        probs = scores.sub_(shift).exp_()
        part = (probs.view(b, kv_heads, -1, probs.shape[-1]) @ v.float()).view(b, kv_heads, -1, n, d)
        if out is None:
            out, total = part, probs.sum(-1, keepdim=True)
        else:
            scale = (top - shift).exp_()
            out = out.mul_(scale).add_(part)
            total = total.mul_(scale).add_(probs.sum(-1, keepdim=True))
        top = new_top
    return out.div_(total).view(b, h, n, d).to(q.dtype)
