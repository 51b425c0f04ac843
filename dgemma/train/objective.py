"""The DiffusionGemma training objective (Google's fine-tuning recipe).

Per example: a noise level t ~ U(eps, 1 - eps) and one canvas s drawn uniformly among the valid ones; each token of
canvas s is kept with probability 1 - t, else replaced by a uniform random token. The encoder runs causally over
the clean sequence (writing the cache, in the graph); the decoder denoises canvas s seeing the prompt and the
clean canvases before it. Self-conditioning: pass 1 with a zero signal and no gradient; pass 2 receives pass 1's
soft embedding with probability `self_cond_prob` per example, else zero. Only pass 2 is scored.
Loss = mean cross-entropy over canvas s (every position) + `ar_weight` * the encoder's next-token cross-entropy.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dgemma.cache import KVCache
from dgemma.train.data import Batch


@dataclass(frozen=True)
class ObjectiveConfig:
    t_eps: float = 1e-3
    self_cond_prob: float = 0.5
    ar_weight: float = 1.0
    fixed_t: float | None = None  # evaluation at one noise level instead of t ~ U(eps, 1 - eps)


@dataclass
class Losses:
    total: torch.Tensor  # scalar with grad
    diffusion: float
    autoregressive: float
    canvas_tokens: int
    ar_tokens: int


def sample_noise_level(batch: int, eps: float, generator: torch.Generator) -> torch.Tensor:
    """t [B] uniform in (eps, 1 - eps)."""
    return eps + (1 - 2 * eps) * torch.rand(batch, generator=generator)


def select_canvas(n_canvases: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """s [B] uniform in 0..n_canvases[b] - 1."""
    u = torch.rand(n_canvases.shape, generator=generator)
    return torch.minimum((u * n_canvases).long(), n_canvases - 1)


def corrupt(x0: torch.Tensor, t: torch.Tensor, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """Uniform-state corruption of x0 [B, C]: keep each token w.p. 1 - t[b], else a uniform random token."""
    replace = torch.rand(x0.shape, generator=generator) < t[:, None]
    noise = torch.randint(0, vocab_size, x0.shape, generator=generator)
    return torch.where(replace, noise, x0)


def gather_canvas(ids: torch.Tensor, start: torch.Tensor, canvas_length: int) -> torch.Tensor:
    """ids [B, L], start [B] -> ids[b, start[b]:start[b] + C] as [B, C]."""
    index = start[:, None] + torch.arange(canvas_length)
    return ids.gather(1, index)


def autoregressive_loss(logits: torch.Tensor, ids: torch.Tensor, ar_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token CE over masked positions: logits [B, L, V] at i predict ids[:, i + 1]."""
    targets = ids[:, 1:][ar_mask[:, :-1]]
    if targets.numel() == 0:
        return logits.sum() * 0
    return F.cross_entropy(logits[:, :-1][ar_mask[:, :-1]], targets)


def diffusion_loss(logits: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Mean CE over every canvas position (corrupted or not, no 1/t weight): logits [B, C, V], x0 [B, C]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x0.reshape(-1))


def compute_losses(model, batch: Batch, cfg: ObjectiveConfig, generator: torch.Generator,
                   autocast: torch.dtype | None = None) -> Losses:
    b = batch.ids.shape[0]
    c = model.cfg.canvas_length
    vocab = model.cfg.text.vocab_size
    device = model.device
    t = sample_noise_level(b, cfg.t_eps, generator)
    if cfg.fixed_t is not None:
        t = torch.full_like(t, cfg.fixed_t)
    s = select_canvas(batch.n_canvases, generator)
    use_sc = torch.rand(b, generator=generator) < cfg.self_cond_prob
    context = batch.prompt_len + s * c
    x0 = gather_canvas(batch.ids, context, c)
    noisy = corrupt(x0, t, vocab, generator)
    ids, valid, ar_mask = batch.ids.to(device), batch.valid.to(device), batch.ar_mask.to(device)
    x0, noisy, context, use_sc = x0.to(device), noisy.to(device), context.to(device), use_sc.to(device)

    amp = torch.autocast(device.type, dtype=autocast) if autocast is not None else nullcontext()
    with amp:
        cache = KVCache(model.cfg.text, b, ids.shape[1], autocast or model.dtype, device)
        hidden = model.encode(ids, cache, valid=valid)
        ar = autoregressive_loss(model.head(hidden), ids, ar_mask)
        signal = None
        if bool(use_sc.any()):
            with torch.no_grad():
                first = model.head(model.denoise(noisy, cache, None, context=context))
            signal = model.soft_embed(first) * use_sc[:, None, None].to(first.dtype)
        logits = model.head(model.denoise(noisy, cache, signal, context=context))
        diff = diffusion_loss(logits, x0)
    total = diff + cfg.ar_weight * ar if cfg.ar_weight else diff
    return Losses(total, float(diff.detach()), float(ar.detach()), x0.numel(), int(ar_mask[:, :-1].sum()))
