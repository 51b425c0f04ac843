"""Autoregressive decoding of the same weights: the encoder as a plain next-token model, one token per pass.
Same interface and events as `Engine`, so the API and the server drive either; requests run one after
another, one token per `step()`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import torch

from dgemma.cache import KVCache
from dgemma.engine.request import Event, Request
from dgemma.model import DiffusionGemma
from dgemma.sampling import SamplingParams, make_generator, sample_next

_ids = itertools.count()


class AutoregressiveEngine:
    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...]):
        self.model = model
        self.eos_ids = tuple(eos_ids)
        self.waiting: list[Request] = []
        self.current: tuple[Request, KVCache, torch.Tensor] | None = None  # request, cache, last hidden [1, H]

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    drafts: bool = False) -> Request:
        eos = params.eos_token_ids if params.eos_token_ids is not None else self.eos_ids
        req = Request(request_id or f"ar-{next(_ids)}", list(prompt), params, tuple(eos), drafts,
                      make_generator(params.seed, self.model.device))
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> None:
        for req in self.waiting + ([self.current[0]] if self.current else []):
            if req.id == request_id and not req.finished:
                req.finish("abort")

    def has_work(self) -> bool:
        return bool(self.waiting) or self.current is not None

    @property
    def num_running(self) -> int:
        return int(self.current is not None)

    def stream(self) -> Iterator[Event]:
        while self.has_work():
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
        reqs = [self.add_request(p, params) for p in prompts]
        for _ in self.stream():
            pass
        return reqs

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """One token of the current request (starting the next waiting one first if none runs)."""
        self.waiting = [r for r in self.waiting if not r.finished]
        if self.current is None or self.current[0].finished:
            self.current = self._start(self.waiting.pop(0)) if self.waiting else None
        if self.current is None:
            return []
        req, cache, hidden = self.current
        token = int(sample_next(self.model.head(hidden), req.params.ar_temperature, req.generator)[0])
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
        if req.finished:
            self.current = None
        else:
            self.current = (req, cache, self.model.encode(torch.tensor([[token]], device=self.model.device), cache)[:, -1])
        return events

    def _start(self, req: Request) -> tuple[Request, KVCache, torch.Tensor]:
        req.stats.t_start = time.perf_counter()
        cache = self.model.new_cache(1, len(req.prompt) + req.params.max_new_tokens + 1)
        hidden = self.model.encode(torch.tensor([req.prompt], device=self.model.device), cache)
        return req, cache, hidden[:, -1]
