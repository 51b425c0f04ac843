"""Samplers for the denoising step: temperature schedule, token entropy, entropy-bound acceptance,
renoising, the reference step, and autoregressive next-token sampling. Pure tensor functions: no host syncs,
no loops over positions.

`reference_step` reproduces HF's `_denoising_step` draw for draw (multinomial, then randint, from the
same generator), so identical processed logits and seed give identical ids. The fast path's fused step
lives in `fused.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

Generators = torch.Generator | Sequence[torch.Generator] | None  # one for the batch, or one per row


class StepOutput(NamedTuple):
    canvas: Tensor  # [B, C] next decoder input: accepted samples, fresh uniform noise elsewhere
    argmax: Tensor  # [B, C] argmax of the processed logits (the draft, and HF's final output)
    accepted: Tensor  # [B, C] bool, positions whose sample was kept
    entropy: Tensor  # [B, C] token entropy of the processed logits (feeds the stopper)


def temperature_schedule(n_steps: int, t_min: float, t_max: float, device=None) -> Tensor:
    """[n_steps] float32, entry i for steps_remaining = n_steps - i, bit-equal to HF `generate` (which
    evaluates the schedule on an int32 tensor step, i.e. in float32; the same formula in double precision
    differs by an ulp on some steps). Divide logits by an entry (a device tensor), not by a Python float:
    CUDA turns `x / float` into `x * (1 / float)`."""
    steps = torch.arange(n_steps, 0, -1, dtype=torch.int32, device=device)
    return t_min + (t_max - t_min) * (steps / n_steps)


def token_entropy(logits: Tensor, dtype: torch.dtype | None = torch.float32) -> Tensor:
    """Entropy of softmax(logits) over the last dim: [B, C, V] -> [B, C].

    Normalises with logsumexp and clamps -inf like torch.distributions.Categorical, whose op sequence
    this follows so the values are bit-equal to HF's. dtype=None keeps the logits dtype (HF on bf16)."""
    if dtype is not None:
        logits = logits.to(dtype)
    logp = logits - logits.logsumexp(dim=-1, keepdim=True)
    p = torch.softmax(logp, dim=-1)
    return -(logp.clamp(min=torch.finfo(logp.dtype).min) * p).sum(-1)


def entropy_bound_accept(entropy: Tensor, bound: float | Tensor) -> Tensor:
    """EB-sampler (arXiv 2505.24857): accept the k lowest-entropy positions with
    sum(H_1..k) - max(H_1..k) <= bound (a number, or [B, 1] per row). [B, C] -> bool [B, C]; at least
    one position per row.
    Same sort call and expression as HF so equal entropies resolve to the same positions."""
    h, order = torch.sort(entropy, dim=-1)
    keep = torch.cumsum(h, dim=-1) - h <= bound
    return torch.zeros_like(keep).scatter(-1, order, keep)


def renoise(accepted_canvas: Tensor, accept_mask: Tensor, random_tokens: Tensor) -> Tensor:
    """Rejected positions get fresh uniform tokens (the sampler's self-correction)."""
    return torch.where(accept_mask, accepted_canvas, random_tokens)


def reference_step(logits: Tensor, entropy_bound: float, generator: torch.Generator | None = None) -> StepOutput:
    """One HF-compatible sampling step on processed (temperature-scaled) logits [B, C, V].

    Draw order as HF: multinomial over every position, then randint for the renoise. The current canvas
    is not an input: HF's where(accept, sample, current) is fully overwritten by the renoise."""
    B, C, V = logits.shape
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    sampled = torch.multinomial(probs.view(-1, V), 1, generator=generator).view(B, C)
    entropy = token_entropy(logits, dtype=None)
    accepted = entropy_bound_accept(entropy, entropy_bound)
    noise = torch.randint(0, V, (B, C), device=logits.device, generator=generator)
    return StepOutput(renoise(sampled, accepted, noise), logits.argmax(-1), accepted, entropy)


def exponential_race(probs: Tensor, generators: Generators = None) -> Tensor:
    """Sample ids from probs [B, ..., V]: argmax(p / E) with E ~ Exp(1) iid is distributed as p (the
    Gumbel-max trick in another form). One elementwise pass and an argmax."""
    noise = _fill(torch.empty_like(probs), generators, lambda t, g: t.exponential_(generator=g))
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # Exp(1) may return 0; p / tiny stays finite for p <= 1
    return torch.div(probs, noise, out=noise).argmax(-1)


def inverse_cdf(p: Tensor, u: Tensor, total: Tensor) -> Tensor:
    """Per row, the index where the running sum of p [R, W] first exceeds u * total."""
    cdf = p.cumsum(-1)
    return torch.searchsorted(cdf, (u * total)[:, None], right=True).squeeze(1).clamp_(max=p.shape[1] - 1)


def random_tokens(shape: tuple[int, ...], vocab_size: int, device, generators: Generators = None) -> Tensor:
    """Uniform ids in [0, vocab_size), int64."""
    out = torch.empty(shape, dtype=torch.long, device=device)
    return _fill(out, generators, lambda t, g: t.random_(0, vocab_size, generator=g))


def sample_next(logits: Tensor, temperature: float, generators: Generators = None) -> Tensor:
    """Autoregressive next token from logits [B, V]: greedy at temperature 0, else softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    return exponential_race(torch.softmax(logits.float() / temperature, dim=-1), generators)


def make_generator(seed: int | None, device=None) -> torch.Generator:
    """A request's generator: seeded, or from a non-deterministic seed when seed is None."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def _fill(out: Tensor, generators: Generators, draw: Callable[[Tensor, torch.Generator | None], Tensor]) -> Tensor:
    """Fill `out` in place: with one generator (or the default), or row by row with one per row of dim 0."""
    if generators is None or isinstance(generators, torch.Generator):
        return draw(out, generators)
    if len(generators) != out.shape[0]:
        raise ValueError(f"got {len(generators)} generators for a batch of {out.shape[0]}")
    for row, g in zip(out, generators):
        draw(row, g)
    return out
