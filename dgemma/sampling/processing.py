"""A row's sampling knobs (dgemma/knobs/) run on its logits: the bias and the penalties, then the temperature, then
the truncations; and the denoising step's vocabulary work for the rows that have knobs. Those rows' logits are
materialized, a block of positions at a time (the fused step streams the vocabulary and never holds them), and
every use of the distribution follows the processed logits, as transformers' generate applies its logits
processors: the sample, the draft (argmax), the entropy the acceptance reads, and the self-conditioning signal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dgemma.knobs import KNOBS, Knob
from dgemma.knobs.base import LOGITS
from dgemma.model.head import Head

BLOCK_BYTES = 64 << 20  # float32 logits materialized at once


class History:
    """What a row's penalties count: its prompt (repetition) and its committed output (all three), the `pending`
    ids chosen before this one included; ids past the vocabulary (an image's soft tokens) are not tokens. Each count
    is made once per history (presence and frequency share theirs)."""

    def __init__(self, prompt: list[int], output: list[int], vocab: int, pending: Sequence[int] = ()):
        self.prompt, self.output, self.vocab = prompt, [*output, *pending], vocab
        self._seen: Tensor | None = None
        self._counts: Tensor | None = None

    def seen(self, device: torch.device) -> Tensor:
        if self._seen is None:
            ids = torch.tensor(self.prompt + self.output, dtype=torch.long, device=device)
            self._seen = ids[ids < self.vocab].unique()
        return self._seen

    def counts(self, vocab: int, device: torch.device) -> Tensor:
        if self._counts is None:
            ids = torch.tensor(self.output, dtype=torch.long, device=device)
            self._counts = torch.bincount(ids[ids < vocab], minlength=vocab).float()
        return self._counts


class Processor:
    """The knobs a row asked for, in their order, over its history."""

    def __init__(self, steps: list[tuple[Knob, Any]], history: History):
        self.steps, self.history = steps, history

    @classmethod
    def of(cls, params, prompt: list[int], output: list[int], vocab: int,
           pending: Sequence[int] = ()) -> Processor | None:
        """None when the row asked for no knob (its decoding is the plain one, fused); nothing is copied then."""
        steps = [(k, getattr(params, k.option.name)) for k in KNOBS if k.active(getattr(params, k.option.name))]
        return cls(steps, History(prompt, output, vocab, pending)) if steps else None

    def __call__(self, logits: Tensor, inv_temp: Tensor | float | None) -> Tensor:
        """Processed logits [N, V] (float32, a new tensor) at 1 / `inv_temp` ([N, 1] or a number); None: greedy,
        where only the rules before the temperature matter (the truncations keep the most likely token)."""
        x = logits.float().clone()
        for knob, value in self.steps:
            if knob.stage == LOGITS:
                x = knob.apply(x, value, self.history)
        if inv_temp is None:
            return x
        x = x.mul_(inv_temp)
        for knob, value in self.steps:
            if knob.stage != LOGITS:
                x = knob.apply(x, value, self.history)
        return x


def processed_step(hidden: Tensor, head: Head, process: Processor, inv_temp: Tensor, uniforms: Tensor,
                   want_signal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The fused step's outputs for one row's positions hidden [N, H] (inv_temp [N], uniforms [N, U]): argmax,
    sample (inverse CDF at the positions' first uniform), entropy, and the soft embedding, of its processed
    logits."""
    n, v = hidden.shape[0], head.vocab_size
    block = max(1, BLOCK_BYTES // (4 * v))
    parts = [_block(hidden[lo:lo + block], head, process, inv_temp[lo:lo + block, None], uniforms[lo:lo + block, 0],
                    want_signal) for lo in range(0, n, block)]
    argmax, sample, entropy, signal = (list(x) for x in zip(*parts))
    return torch.cat(argmax), torch.cat(sample), torch.cat(entropy), torch.cat(signal) if want_signal else None


def _block(hidden: Tensor, head: Head, process: Processor, inv_temp: Tensor, u: Tensor,
           want_signal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    x = process(head.logits(hidden), inv_temp)
    logp = x.log_softmax(-1)
    p = logp.exp()
    entropy = -(p * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
    cdf = p.cumsum(-1)
    sample = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp_(max=x.shape[-1] - 1)
    return x.argmax(-1), sample, entropy, head.soft_embed(x) if want_signal else None
