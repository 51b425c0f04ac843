"""The fast denoising step's vocabulary-sized work, fused and streamed over vocabulary chunks.

Per chunk of the (tied) embedding: head logits for every position, softcap, temperature, then online
(rescaled, flash-attention style) running max / argmax, normaliser, entropy accumulator and the
self-conditioning soft embedding p @ E, and a weighted-reservoir sample (inverse CDF inside the chunk, kept
with probability chunk mass / mass so far: exactly softmax-distributed). The embedding is read once per step,
only a [positions, chunk] block is alive, and no random number is drawn per vocabulary entry.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from dgemma.model.layers import matmul

VOCAB_CHUNK = 4096


class VocabStep(NamedTuple):
    argmax: Tensor  # [N] long
    sample: Tensor  # [N] long, drawn from softmax(logits / T)
    entropy: Tensor  # [N] float32 entropy of softmax(logits / T)
    signal: Tensor  # [N, H] soft embedding softmax(logits / T) @ E * sqrt(H), in E's dtype


def num_uniforms(vocab_size: int) -> int:
    """Uniforms per position that `vocab_step` consumes (two per vocabulary chunk)."""
    return 2 * math.ceil(vocab_size / VOCAB_CHUNK)


def vocab_step(hidden: Tensor, embedding: Tensor, softcap: float, embed_scale: float, inv_temp: Tensor,
               uniforms: Tensor) -> VocabStep:
    """hidden [N, H] (final-normed), embedding [V, H], inv_temp [N], uniforms [N, num_uniforms(V)] in [0, 1)."""
    n, v = hidden.shape[0], embedding.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    peak = torch.full((n,), -math.inf, **f32)
    mass = torch.zeros(n, **f32)  # sum of exp(z - peak)
    moment = torch.zeros(n, **f32)  # sum of exp(z - peak) * (z - peak)
    soft = torch.zeros(n, embedding.shape[1], **f32)
    best = torch.full((n,), -math.inf, **f32)
    argmax = torch.zeros(n, dtype=torch.long, device=hidden.device)
    sample = torch.zeros_like(argmax)
    scale = (2 * softcap * inv_temp)[:, None]
    shift = (softcap * inv_temp)[:, None]
    for k, lo in enumerate(range(0, v, VOCAB_CHUNK)):
        chunk = embedding[lo:lo + VOCAB_CHUNK]
        # softcap * tanh(x / softcap) / T, as softcap * (2 sigmoid(2x / softcap) - 1) / T: sigmoid is much faster
        z = matmul(hidden, chunk.T).float().mul_(2 / softcap).sigmoid_().mul_(scale).sub_(shift)
        top = z.amax(dim=-1)
        better = top > best
        if bool(better.any()):  # a new row maximum: rare after the first chunks, so argmax runs on few rows
            rows = better.nonzero().squeeze(1)
            argmax[rows] = z[rows].argmax(-1) + lo
            best = torch.where(better, top, best)
        new_peak = torch.maximum(peak, top)
        decay = torch.exp(peak - new_peak)
        z.sub_(new_peak[:, None])  # z - peak <= 0
        p = torch.exp(z)
        chunk_mass = p.sum(-1)
        dot = torch.bmm(p[:, None, :], z[:, :, None]).view(-1)  # row-wise sum p * (z - peak), as a GEMM
        # rescale the running sums to the new peak: sum p (z - m') = decay * (M + (m - m') S)
        moment = decay * (moment + torch.nan_to_num(peak - new_peak) * mass) + dot
        mass = mass * decay + chunk_mass
        soft = soft * decay[:, None] + matmul(p.to(chunk.dtype), chunk).float()
        # weighted reservoir: the chunk replaces the sample with probability chunk_mass / mass, and only the
        # rows it replaces need the candidate (an inverse-CDF draw inside the chunk)
        take = uniforms[:, 2 * k + 1] * mass < chunk_mass
        if bool(take.any()):
            rows = take.nonzero().squeeze(1)
            cdf = p[rows].cumsum(-1)
            target = (uniforms[rows, 2 * k] * chunk_mass[rows])[:, None]
            pick = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=chunk.shape[0] - 1)
            sample[rows] = pick + lo
        peak = new_peak
    entropy = torch.log(mass) - moment / mass
    signal = (soft / mass[:, None] * embed_scale).to(embedding.dtype)
    return VocabStep(argmax, sample, entropy, signal)
