"""Autoregressive decoding of the same weights: the encoder as a plain next-token model, one token per pass.
Same interface and events as `Engine`, so the API and the server drive either; requests run one after
another, one token per `step()`. `next_token` and `emit` are the token rule and the commit rule it shares with
the speculative engine (`speculative.py`), whose output is this one's."""

from __future__ import annotations

import math
import time

import torch

from dgemma.cache import KVCache
from dgemma.engine.request import Event, Request
from dgemma.engine.runner import Runner
from dgemma.model import DiffusionGemma
from dgemma.sampling import sample_next


def next_token(req: Request, logits: torch.Tensor) -> int:
    """The request's next token from next-token logits [1, V]: masked by its grammar, greedy or drawn at
    `ar_temperature` from its generator (one draw per token), then locked into the grammar's prefix."""
    if req.grammar is not None:
        logits = logits.masked_fill(~req.grammar.allowed().to(logits.device), -math.inf)
    token = int(sample_next(logits, req.params.ar_temperature, req.generator)[0])
    if req.grammar is not None and not req.grammar.extend([token]):
        req.grammar.give_up()
        token = req.grammar.locked[-1]
    return token


def emit(req: Request, tokens: list[int], events: list[Event]) -> None:
    """Commit `tokens` in order until an end-of-sequence id ("stop") or the token budget ("length") ends it."""
    req.stats.t_first_commit = req.stats.t_first_commit or time.perf_counter()
    cut = next((i for i, t in enumerate(tokens) if t in req.eos), len(tokens))
    new = tokens[:min(cut, req.budget)]
    req.output.extend(new)
    if new:
        events.append(Event(req.id, "commit", new))
    if cut < len(tokens) and len(new) == cut:
        req.finish("stop", events)
    elif req.budget <= 0:
        req.finish("length", events)


class AutoregressiveEngine(Runner):
    mode = "autoregressive"

    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...]):
        super().__init__(model, eos_ids)
        # the running request, its cache, and its last committed token (not yet in the cache)
        self.current: tuple[Request, KVCache, int] | None = None

    def held(self) -> list[Request]:
        return self.waiting + ([self.current[0]] if self.current else [])

    def has_work(self) -> bool:
        return bool(self.waiting) or self.current is not None

    @property
    def num_running(self) -> int:
        return int(self.current is not None)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Start the next waiting request if none runs (its first token comes from the prompt's prefill), else
        commit the current one's next tokens (`_advance`)."""
        events: list[Event] = []
        if self.current is None or self.current[0].finished:
            self.current = None
            if not self.waiting:
                return events
            req, cache, hidden = self._start(self.waiting.pop(0))
            tokens = [next_token(req, self.model.head(hidden))]
        else:
            req, cache, token = self.current
            tokens = self._advance(req, cache, token, events)
        emit(req, tokens, events)
        self.current = None if req.finished else (req, cache, tokens[-1])
        return events

    def _advance(self, req: Request, cache: KVCache, token: int, events: list[Event]) -> list[int]:
        """Cache `token`; the token after it."""
        hidden = self.model.encode(torch.tensor([[token]], device=self.model.device), cache)[:, -1]
        req.stats.decoder_passes += 1
        return [next_token(req, self.model.head(hidden))]

    def _start(self, req: Request) -> tuple[Request, KVCache, torch.Tensor]:
        """Prefill the prompt into a new cache; the last position's hidden state [1, H]."""
        req.stats.t_start = time.perf_counter()
        if req.grammar is not None:
            req.grammar.start_canvas(req.params.max_new_tokens + 1, req.params.max_new_tokens)  # one prefix
        cache = self.model.new_cache(1, len(req.prompt) + req.params.max_new_tokens + 1)
        req.stats.decoder_passes += 1  # the prompt's last position gives the first token
        return req, cache, self.model.prefill(torch.tensor([req.prompt], device=self.model.device), cache)
