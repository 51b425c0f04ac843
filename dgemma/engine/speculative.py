"""Self-speculative decoding: the decoder drafts, the encoder checks, and the output is autoregressive decoding's.

The encoder is a next-token model (its training objective keeps it one), and committing a canvas already runs it
over every canvas position. So one cycle is: a denoising pass drafts a canvas after the next token (known from
the encoder), the encoder pass that writes the draft into the cache gives the next-token choice after each drafted
position, and the draft is kept up to its first position where that choice differs; the choice there is the next
token. Each token is chosen by `autoregressive.next_token` from the same logits autoregressive decoding would give
it (up to float rounding: several positions per pass), with one draw per token from the request's generator,
so the ids are `AutoregressiveEngine`'s, greedy or sampled, with a grammar or not; what the draft gets right is
how many of them one cycle commits. Rejected slots leave the cache (`KVCache.truncate`). Where drafts seldom hold
(a weak or mismatched decoder), `Pace` falls back to plain autoregressive steps and tries a draft again now and
then. Requests run one after another."""

from __future__ import annotations

import time

import torch

from dgemma.cache import KVCache
from dgemma.engine.autoregressive import AutoregressiveEngine, emit, next_token
from dgemma.engine.request import Event, Request
from dgemma.model import DiffusionGemma
from dgemma.sampling import make_generator
from dgemma.sampling.samplers import random_tokens


MAX_PLAIN = 64  # plain steps between two tries of a draft, at most


class Pace:
    """When to draft: while a cycle commits ids faster than a plain autoregressive step does (both timed), every
    step drafts; a slower cycle sends the next 1, 2, 4, ... (at most MAX_PLAIN) ids through plain steps before the
    next try. It sets the speed only: the ids are the same either way."""

    def __init__(self):
        self.plain_rate: float | None = None  # ids per second of plain steps (running mean; kept across requests)
        self.backoff = self.plain = 0  # plain steps: the current back-off, and how many are left before a try

    def restart(self) -> None:
        """A new request drafts at once."""
        self.backoff = self.plain = 0

    def drafts(self) -> bool:
        """Whether the next step drafts (else it is a plain step)."""
        if self.plain:
            self.plain -= 1
            return False
        return True

    def cycled(self, ids: int, seconds: float) -> None:
        if self.plain_rate is None:
            self.plain = int(ids == 1)  # a cycle kept no draft: time a plain step before judging
        elif ids / seconds < self.plain_rate:
            self.backoff = self.plain = min(2 * self.backoff or 1, MAX_PLAIN)
        else:
            self.backoff = 0

    def stepped(self, seconds: float) -> None:
        rate = 1 / seconds
        self.plain_rate = rate if self.plain_rate is None else (self.plain_rate + rate) / 2


class SpeculativeEngine(AutoregressiveEngine):
    mode = "speculative"
    paced = True  # False: draft at every step (tests of the cycle itself)

    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...]):
        super().__init__(model, eos_ids)
        self.pace = Pace()
        self.noise: torch.Generator | None = None  # the running request's draft noise

    def _start(self, req: Request) -> tuple[Request, KVCache, torch.Tensor]:
        self.noise = make_generator(req.params.seed, self.model.device)  # the drafts' own: the ids never use it
        self.pace.restart()
        return super()._start(req)

    def _advance(self, req: Request, cache: KVCache, token: int, events: list[Event]) -> list[int]:
        t0 = time.perf_counter()
        if self.paced and not self.pace.drafts():
            start, tokens = cache.length, super()._advance(req, cache, token, events)
            req.stats.cycles.append((start, 1, False))
            self.pace.stepped(time.perf_counter() - t0)
            return tokens
        tokens = self._cycle(req, cache, token, events)
        self.pace.cycled(len(tokens), time.perf_counter() - t0)
        return tokens

    def _cycle(self, req: Request, cache: KVCache, token: int, events: list[Event]) -> list[int]:
        """Draft after `token`, check the draft in the encoder pass that caches it (and `token`); the drafted ids
        that hold, then the next token."""
        draft = self._draft(cache, token)
        if req.drafts:
            events.append(Event(req.id, "draft", req.visible(draft[1:])))
        start, span = cache.length, self._span(req, draft)
        logits = self.model.head(self.model.encode(torch.tensor([draft[:span]], device=self.model.device), cache))
        req.stats.decoder_passes += 2
        req.stats.cycles.append((start, span, True))
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
