"""Attention over keys and values produced a block of keys at a time (`attend_blocks`, an online softmax:
full-attention layers derive their keys from the cache per block, so no tensor the size of the history is made;
masks come from the cache, `cache/views.py`, a block at a time)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dgemma.cache.views import Mask, mask_block


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
