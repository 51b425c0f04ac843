"""The fast denoising step's vocabulary-sized work, fused and chunked over positions.

For each chunk of positions: tied-head logits, softcap, temperature, max / argmax, exp, entropy, an
inverse-CDF sample (one uniform per position instead of one random number per vocabulary entry), and the
self-conditioning soft embedding probs @ E. Only a [chunk, V] float32 block is alive at a time, never a full
[B, C, V] tensor, and every pass over it stays in cache-sized pieces.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 22  # ~16 MB of float32 per chunk


class VocabStep(NamedTuple):
    argmax: Tensor  # [N] long
    sample: Tensor  # [N] long, drawn from softmax(logits / T)
    entropy: Tensor  # [N] float32 entropy of softmax(logits / T)
    signal: Tensor  # [N, H] soft embedding softmax(logits / T) @ E * sqrt(H), in E's dtype


def vocab_step(hidden: Tensor, embedding: Tensor, softcap: float, embed_scale: float, inv_temp: Tensor,
               uniforms: Tensor) -> VocabStep:
    """hidden [N, H] (final-normed), embedding [V, H], inv_temp [N], uniforms [N] in [0, 1)."""
    n, v = hidden.shape[0], embedding.shape[0]
    rows = max(1, CHUNK_ELEMENTS // v)
    argmax = torch.empty(n, dtype=torch.long, device=hidden.device)
    sample = torch.empty_like(argmax)
    entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
    signal = torch.empty(n, embedding.shape[1], dtype=embedding.dtype, device=hidden.device)
    scale = torch.tensor(embed_scale, dtype=embedding.dtype)
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        z = (hidden[lo:hi] @ embedding.T).float()
        z.div_(softcap).tanh_().mul_(softcap * inv_temp[lo:hi, None])
        peak, argmax[lo:hi] = z.max(dim=-1)
        z.sub_(peak[:, None])
        p = z.exp()  # unnormalised probabilities
        total = p.sum(-1)
        # entropy = log(total) - E_p[z - peak]
        entropy[lo:hi] = torch.log(total) - (p * z).sum(-1) / total
        del z
        cdf = p.cumsum(-1)
        target = (uniforms[lo:hi] * cdf[:, -1])[:, None]
        sample[lo:hi] = torch.searchsorted(cdf, target, right=True).clamp_(max=v - 1).squeeze(1)
        del cdf
        p.div_(total[:, None])
        signal[lo:hi] = (p.to(embedding.dtype) @ embedding) * scale
    return VocabStep(argmax, sample, entropy, signal)
