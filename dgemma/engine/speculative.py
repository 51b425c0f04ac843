"""Self-speculative decoding: the decoder drafts, the encoder checks, and the output is autoregressive decoding's.

The encoder is a next-token model (its training objective keeps it one), and committing a canvas already runs it
over every canvas position. So one cycle is: a denoising pass drafts a canvas after the next token (known from
the encoder), the encoder pass that writes the draft into the cache gives the next-token choice after each drafted
position, and the draft is kept up to its first position where that choice differs; the choice there is the next
token. Each token is chosen by `autoregressive.next_token` from the same logits autoregressive decoding would give
it (up to float rounding: several positions per pass), with one draw per token from the request's generator,
so the ids are `AutoregressiveEngine`'s, greedy or sampled, with a grammar or not; what the draft gets right is
how many of them one cycle commits. Rejected slots leave the cache (`KVCache.truncate`). Requests run one after
another."""

from __future__ import annotations

import torch

from dgemma.cache import KVCache
from dgemma.engine.autoregressive import AutoregressiveEngine, emit, next_token
from dgemma.engine.request import Event, Request
from dgemma.sampling import make_generator
from dgemma.sampling.samplers import random_tokens


class SpeculativeEngine(AutoregressiveEngine):
    mode = "speculative"

    def _start(self, req: Request) -> tuple[Request, KVCache, torch.Tensor]:
        self.noise = make_generator(req.params.seed, self.model.device)  # the drafts' own: the ids never use it
        return super()._start(req)

    def _advance(self, req: Request, cache: KVCache, token: int, events: list[Event]) -> list[int]:
        """Draft after `token`, check the draft in the encoder pass that caches it (and `token`); the drafted ids
        that hold, then the next token."""
        draft = self._draft(cache, token)
        if req.drafts:
            events.append(Event(req.id, "draft", req.visible(draft[1:])))
        start, span = cache.length, self._span(req, draft)
        logits = self.model.head(self.model.encode(torch.tensor([draft[:span]], device=self.model.device), cache))
        req.stats.decoder_passes += 2
        req.stats.verified.append((start, span))
        tokens = []
        for i in range(span):  # logits[:, i] choose the id after draft[i]
            tokens.append(next_token(req, logits[:, i]))
            if i + 1 == span or tokens[-1] != draft[i + 1]:
                break
        cache.truncate(start + len(tokens))  # `token` and the drafted ids kept; the rejected ones leave
        return tokens

    def _draft(self, cache: KVCache, token: int) -> list[int]:
        """One denoising pass over a canvas of noise that starts with `token`: its argmax, `token` first."""
        c, vocab = self.model.cfg.canvas_length, self.model.cfg.text.vocab_size
        canvas = random_tokens((1, c), vocab, self.model.device, self.noise)
        canvas[:, 0] = token
        ids = self.model.head(self.model.denoise(canvas, cache)).argmax(-1)[0].tolist()
        return [token, *ids[1:]]

    @staticmethod
    def _span(req: Request, draft: list[int]) -> int:
        """Draft positions to check: those before its first end-of-sequence id (the last of them predicts it), and
        no more than the budget can take."""
        end = next((i for i, t in enumerate(draft) if i and t in req.eos), len(draft))
        return max(1, min(end, req.budget))
