"""Early commit and early stop as tensor rules. A canvas's left prefix is frozen once each of its positions has
kept the same draft token, with its sample accepted, for N steps in a row (the longest stable prefix): its
tokens are committed before the canvas ends and held in the canvas (input and draft) from then on, so the text
sent never changes. The early stop ends a canvas on confidence alone (mean token entropy), stable or not."""

from __future__ import annotations

import torch
from torch import Tensor

from dgemma.sampling.samplers import StepOutput


def stable_runs(prev: Tensor, argmax: Tensor, accepted: Tensor, run: Tensor) -> Tensor:
    """[B, C] steps in a row each position's draft kept its token with its sample accepted (0 when it moved)."""
    return torch.where((argmax == prev) & accepted, run + 1, 0)


def early_length(run: Tensor, argmax: Tensor, need: Tensor, eos: Tensor, limit: Tensor) -> Tensor:
    """[B] the longest left prefix whose runs reach `need` [B] and that holds no EOS (eos [B, E], padded with -1;
    the EOS and what follows it stay with the canvas's own commit), at most `limit` [B] (the row's budget)."""
    is_eos = (argmax[:, :, None] == eos[:, None, :]).any(-1)
    ok = (run >= need[:, None]) & ~is_eos
    return torch.minimum(ok.long().cumprod(-1).sum(-1), limit)


def decided(run: Tensor, argmax: Tensor, need: Tensor, eos: Tensor, frozen: Tensor, limit: Tensor) -> Tensor:
    """[B] rows with nothing left to denoise: their early-committed prefix fills their budget, or the position after
    it is an EOS stable for as long (the commit cuts there, so the text is decided)."""
    at = frozen.clamp(max=argmax.shape[1] - 1)[:, None]
    next_eos = (argmax.gather(1, at) == eos).any(-1) & (run.gather(1, at)[:, 0] >= need)
    return (frozen >= limit) | (next_eos & (frozen < argmax.shape[1]))


def hold_prefix(out: StepOutput, ids: Tensor, frozen: Tensor) -> StepOutput:
    """The step's output with each row's first `frozen` [B] positions set to `ids` [B, C] (input, draft and
    accepted)."""
    held = torch.arange(ids.shape[1], device=ids.device)[None] < frozen[:, None]
    return out._replace(canvas=torch.where(held, ids, out.canvas), argmax=torch.where(held, ids, out.argmax),
                        accepted=out.accepted | held)


def confident(entropy: Tensor, threshold: Tensor) -> Tensor:
    """[B] rows whose mean token entropy (entropy [B, C]) is below their threshold [B]."""
    return entropy.mean(-1) < threshold
