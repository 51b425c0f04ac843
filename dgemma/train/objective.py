"""The DiffusionGemma training objective (Google's fine-tuning recipe).

Per example: a noise level t ~ U(eps, 1 - eps) and one canvas s drawn uniformly among the valid ones; each token of
canvas s is kept with probability 1 - t, else replaced by a uniform random token. The encoder runs causally over
the clean sequence (writing the cache, in the graph); the decoder denoises canvas s seeing the prompt and the
clean canvases before it. Self-conditioning: pass 1 with a zero signal and no gradient; pass 2 receives pass 1's
soft embedding with probability `self_cond_prob` per example, else zero. Only pass 2 is scored.
Loss = mean cross-entropy over canvas s (every position) + `ar_weight` * the encoder's next-token cross-entropy.
The losses run through the tied head in chunks of positions, so no [B, L, vocab] float32 tensor is kept.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dgemma.cache import KVCache
from dgemma.train.data import TrainBatch, rows_of_rank, take_rows

LOGIT_BUDGET = 2**24  # float32 logits per loss chunk (64 MiB)


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


def rows_per_chunk(vocab_size: int) -> int:
    """Positions per loss chunk: about LOGIT_BUDGET float32 logits (64 at the real 262,144 vocabulary)."""
    return max(1, LOGIT_BUDGET // vocab_size)


def _summed_ce(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden), targets, reduction="sum")


def cross_entropy(x: torch.Tensor, targets: torch.Tensor, head=None, chunk: int | None = None,
                  norm: float | None = None) -> torch.Tensor:
    """Mean CE against targets [N] (summed CE / `norm` if given). x [N, V] logits, or [N, H] hidden states mapped by
    `head`: then `chunk` rows at a time, each chunk's logits recomputed in backward (torch.utils.checkpoint), so no
    [N, V] tensor is kept."""
    if head is None:
        return F.cross_entropy(x, targets) if norm is None else F.cross_entropy(x, targets, reduction="sum") / norm
    chunk = chunk or len(targets)
    parts = [checkpoint(_summed_ce, head, h, t, use_reentrant=False, preserve_rng_state=False)
             for h, t in zip(x.split(chunk), targets.split(chunk))]
    return torch.stack(parts).sum() / (len(targets) if norm is None else norm)


def autoregressive_loss(x: torch.Tensor, ids: torch.Tensor, ar_mask: torch.Tensor, head=None,
                        chunk: int | None = None, norm: float | None = None) -> torch.Tensor:
    """Mean next-token CE over masked positions: x [B, L, V] logits (or hidden with `head`, see cross_entropy) at
    i predict ids[:, i + 1]."""
    targets = ids[:, 1:][ar_mask[:, :-1]]
    if targets.numel() == 0:
        return x.sum() * 0
    return cross_entropy(x[:, :-1][ar_mask[:, :-1]], targets, head, chunk, norm)


def diffusion_loss(x: torch.Tensor, x0: torch.Tensor, head=None, chunk: int | None = None,
                   norm: float | None = None) -> torch.Tensor:
    """Mean CE over every canvas position (corrupted or not, no 1/t weight): x [B, C, V] logits (or hidden with
    `head`), x0 [B, C]."""
    return cross_entropy(x.reshape(-1, x.shape[-1]), x0.reshape(-1), head, chunk, norm)


@torch.no_grad()
def self_condition_signal(model, hidden: torch.Tensor, use: torch.Tensor, chunk: int) -> torch.Tensor:
    """Pass 1's soft embedding [B, C, H] from its hidden states, `chunk` positions at a time, zeroed where not
    `use` [B]."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    soft = torch.cat([model.soft_embed(model.head(h)) for h in flat.split(chunk)])
    soft = soft.view(*hidden.shape[:-1], soft.shape[-1])
    return soft * use[:, None, None].to(soft.dtype)


@dataclass
class Noise:
    """One step's random draws for every row of a batch."""

    context: torch.Tensor  # [B] clean tokens before the scored canvas
    x0: torch.Tensor  # [B, C] the scored canvas, clean
    noisy: torch.Tensor  # [B, C] the same canvas, corrupted
    use_sc: torch.Tensor  # [B] bool: pass 2 receives the self-conditioning signal


def draw_noise(batch: TrainBatch, cfg: ObjectiveConfig, generator: torch.Generator, canvas_length: int,
               vocab_size: int) -> Noise:
    """Noise level, scored canvas, self-conditioning choice and corruption, drawn row-wise in one fixed order."""
    b = batch.ids.shape[0]
    t = sample_noise_level(b, cfg.t_eps, generator)
    if cfg.fixed_t is not None:
        t = torch.full_like(t, cfg.fixed_t)
    s = select_canvas(batch.n_canvases, generator)
    use_sc = torch.rand(b, generator=generator) < cfg.self_cond_prob
    context = batch.prompt_len + s * canvas_length
    x0 = gather_canvas(batch.ids, context, canvas_length)
    return Noise(context, x0, corrupt(x0, t, vocab_size, generator), use_sc)


def compute_losses(model, batch: TrainBatch, cfg: ObjectiveConfig, generator: torch.Generator,
                   autocast: torch.dtype | None = None, part: tuple[int, int] | None = None) -> Losses:
    """The objective on `batch`. With `part` = (rank, world) the batch is the global one: the draws are made for
    all of it (so they do not depend on the world size), this rank scores its rows (rows_of_rank), and each loss
    is divided by its global token count / world, so that the mean over ranks of the losses and of their
    gradients is the one-process value. Canvas and token counts are the global ones."""
    c = model.cfg.canvas_length
    device = model.device
    noise = draw_noise(batch, cfg, generator, c, model.cfg.text.vocab_size)
    self_condition = bool(noise.use_sc.any())  # one decision for the whole batch: every rank runs the same passes
    canvas_tokens, ar_tokens = noise.x0.numel(), int(batch.ar_mask[:, :-1].sum())
    diff_norm = ar_norm = None
    if part is not None:
        rows = rows_of_rank(batch.ids.shape[0], *part)
        batch, noise = take_rows(batch, rows), take_rows(noise, rows)
        diff_norm, ar_norm = canvas_tokens / part[1], ar_tokens / part[1]
    ids, valid, ar_mask = batch.ids.to(device), batch.valid.to(device), batch.ar_mask.to(device)
    x0, noisy = noise.x0.to(device), noise.noisy.to(device)
    context, use_sc = noise.context.to(device), noise.use_sc.to(device)

    chunk = rows_per_chunk(model.cfg.text.vocab_size)
    amp = torch.autocast(device.type, dtype=autocast) if autocast is not None else nullcontext()
    with amp:
        cache = KVCache(model.cfg.text, ids.shape[0], ids.shape[1], autocast or model.dtype, device)
        hidden = model.encode(ids, cache, valid=valid)
        ar = autoregressive_loss(hidden, ids, ar_mask, model.head, chunk, ar_norm)
        signal = None
        if self_condition:
            with torch.no_grad():
                first = model.denoise(noisy, cache, None, context=context)
            signal = self_condition_signal(model, first, use_sc, chunk)
        hidden = model.denoise(noisy, cache, signal, context=context)
        diff = diffusion_loss(hidden, x0, model.head, chunk, diff_norm)
    total = diff + cfg.ar_weight * ar if cfg.ar_weight else diff
    return Losses(total, float(diff.detach()), float(ar.detach()), canvas_tokens, ar_tokens)
