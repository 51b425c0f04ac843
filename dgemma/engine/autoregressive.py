"""Autoregressive decoding of the same weights: the encoder as a plain next-token model, one token per pass.
Same interface and events as `Engine`, so the API and the server drive either; requests run one after
another, one token per `step()`."""

from __future__ import annotations

import math
import time

import torch

from dgemma.cache import KVCache
from dgemma.engine.request import Event, Request
from dgemma.engine.runner import Runner
from dgemma.model import DiffusionGemma
from dgemma.sampling import sample_next


class AutoregressiveEngine(Runner):
    mode = "autoregressive"

    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...]):
        super().__init__(model, eos_ids)
        self.current: tuple[Request, KVCache, torch.Tensor] | None = None  # request, cache, last hidden [1, H]

    def held(self) -> list[Request]:
        return self.waiting + ([self.current[0]] if self.current else [])

    def has_work(self) -> bool:
        return bool(self.waiting) or self.current is not None

    @property
    def num_running(self) -> int:
        return int(self.current is not None)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """One token of the current request (starting the next waiting one first if none runs)."""
        if self.current is None or self.current[0].finished:
            self.current = self._start(self.waiting.pop(0)) if self.waiting else None
        if self.current is None:
            return []
        req, cache, hidden = self.current
        logits = self.model.head(hidden)
        if req.grammar is not None:  # masked logits; the token is then locked into the grammar's prefix
            logits = logits.masked_fill(~req.grammar.allowed().to(logits.device), -math.inf)
        token = int(sample_next(logits, req.params.ar_temperature, req.generator)[0])
        if req.grammar is not None and not req.grammar.extend([token]):
            req.grammar.give_up()
            token = req.grammar.locked[-1]
        req.stats.decoder_passes += 1
        req.stats.t_first_commit = req.stats.t_first_commit or time.perf_counter()
        events: list[Event] = []
        if token in req.eos:
            req.finish("stop", events)
        else:
            req.output.append(token)
            events.append(Event(req.id, "commit", [token]))
            if req.budget <= 0:
                req.finish("length", events)
        self.current = None if req.finished else (req, cache, self._encode([token], cache))
        return events

    def _start(self, req: Request) -> tuple[Request, KVCache, torch.Tensor]:
        req.stats.t_start = time.perf_counter()
        if req.grammar is not None:
            req.grammar.start_canvas(req.params.max_new_tokens + 1, req.params.max_new_tokens)  # one prefix
        cache = self.model.new_cache(1, len(req.prompt) + req.params.max_new_tokens + 1)
        return req, cache, self.model.prefill(torch.tensor([req.prompt], device=self.model.device), cache)

    def _encode(self, ids: list[int], cache: KVCache) -> torch.Tensor:
        """Append ids to the cache; the last position's hidden state [1, H]."""
        return self.model.encode(torch.tensor([ids], device=self.model.device), cache)[:, -1]
