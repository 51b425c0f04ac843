"""Autoregressive decoding of the same weights: the encoder as a plain next-token model. Same interface and events
as `Engine`, so the API and the server drive either. Up to `max_batch` requests run together, one token each per
`step()` (one encoder pass over their last tokens, each row its own cache); a waiting request starts at the next
step while there is room, from a copy of the longest prefix of its prompt a `PrefixCache` holds if given one (a
finished request leaves its prompt and answer there: what its cache holds, a copy). `next_token` and `emit` are
the token rule and the commit rule it shares with the speculative engine (`speculative.py`), whose output is this
one's."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from dgemma.cache import KVCache, PrefixCache
from dgemma.engine.base import EngineBase
from dgemma.engine.request import Event, Request
from dgemma.model import DiffusionGemma
from dgemma.sampling import sample_next
from dgemma.sampling.processing import Processor


def next_token(req: Request, logits: torch.Tensor, pending: list[int] = ()) -> int:
    """The request's next token from next-token logits [1, V]: masked by its grammar, processed by its sampling
    knobs (over its prompt, output and the `pending` ids chosen before this one), greedy or drawn at
    `ar_temperature` from its generator (one draw per token), then locked into the grammar's prefix."""
    if req.grammar is not None:
        logits = logits.masked_fill(~req.grammar.allowed().to(logits.device), -math.inf)
    t = req.params.ar_temperature
    process = Processor.of(req.params, req.prompt, req.output, logits.shape[-1], pending)
    if process is not None:  # the temperature is the processor's: after the penalties, before the truncations
        logits, t = process(logits, 1 / t if t else None), 1.0 if t else 0.0
    token = int(sample_next(logits, t, req.generator)[0])
    budget = req.params.thought_budget
    if budget is not None and (forced := budget.forced(req.output, pending)) is not None:
        token = forced
    if req.grammar is not None and not req.grammar.extend([token]):
        req.grammar.give_up()
        token = req.grammar.locked[-1]
    return token


def emit(req: Request, tokens: list[int], events: list[Event]) -> None:
    """Commit `tokens` in order until an end-of-sequence id ("stop") or the token budget ("length") ends it, as
    `Request.commit` ends a canvas."""
    req.stats.t_first_commit = req.stats.t_first_commit or time.perf_counter()
    new, hit_eos = req.take(tokens)
    req.output.extend(new)
    if new:
        events.append(Event(req.id, "commit", new))
    if hit_eos:
        req.finish("stop", events)
    elif req.budget <= 0:
        req.finish("length", events)


@dataclass
class Row:
    req: Request
    cache: KVCache  # its own: rows join and leave without copying each other's
    token: int  # its last committed token, not yet in the cache
    state: Any = None  # what a subclass keeps per row (speculative: its drafts' noise and pace)


class AutoregressiveEngine(EngineBase):
    mode = "autoregressive"

    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...], max_batch: int = 1,
                 prefix_cache: PrefixCache | None = None):
        super().__init__(model, eos_ids)
        self.max_batch = max(1, max_batch)
        self.prefix_cache = prefix_cache
        self.rows: list[Row] = []

    def requests(self) -> list[Request]:
        return self.waiting + [r.req for r in self.rows]

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.rows)

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Start the waiting requests there is room for (each first token comes from its prompt's prefill), else
        commit every running request's next tokens (`_advance`)."""
        events: list[Event] = []
        self.rows = [r for r in self.rows if not r.req.finished]
        if self.waiting and len(self.rows) < self.max_batch:
            while self.waiting and len(self.rows) < self.max_batch:
                self.rows.append(self._start(self.waiting.pop(0), events))
        elif self.rows:
            for row, tokens in zip(self.rows, self._advance(self.rows, events)):
                emit(row.req, tokens, events)
                row.token = tokens[-1]
        self._remember([r for r in self.rows if r.req.finish_reason in ("stop", "length")])
        self.rows = [r for r in self.rows if not r.req.finished]
        return events

    def _remember(self, finished: list[Row]) -> None:
        """Keep finished requests' prompts and answers in the prefix cache, as far as their caches hold them (all
        but the last token, or all)."""
        if self.prefix_cache is None:
            return
        for r in finished:
            tokens = r.req.prompt + r.req.output
            self.prefix_cache.store(tokens[:r.cache.length], r.cache, r.req.params.cache_salt)

    def _advance(self, rows: list[Row], events: list[Event]) -> list[list[int]]:
        """Cache each row's token in one encoder pass; the token after it, per row."""
        ids = torch.tensor([[r.token] for r in rows], device=self.model.device)
        logits = self.model.head(self.model.encode(ids, [r.cache for r in rows])[:, -1])
        for r in rows:
            r.req.stats.decoder_passes += 1
        return [[next_token(r.req, logits[i:i + 1])] for i, r in enumerate(rows)]

    def _start(self, req: Request, events: list[Event]) -> Row:
        """Prefill the prompt into a new cache and commit the first token."""
        req.stats.t_start = time.perf_counter()
        for f in self.features:
            f.start_sequence(req)
        cache, n = self._prompt_cache(req)
        hidden = self.model.prefill(torch.tensor([req.prompt[n:]], device=self.model.device), cache)
        if self.prefix_cache is not None:
            self.prefix_cache.store(req.prompt, cache, req.params.cache_salt)
        req.stats.decoder_passes += 1  # the prompt's last position gives the first token
        token = next_token(req, self.model.head(hidden))
        emit(req, [token], events)
        return Row(req, cache, token)

    def _prompt_cache(self, req: Request) -> tuple[KVCache, int]:
        """A cache for the prompt: a copy of the longest prefix of it the prefix cache holds (all but its last
        token at most, whose pass gives the first token) and that prefix's length, or a new one and 0."""
        if self.prefix_cache is not None:
            cache, n = self.prefix_cache.lookup(req.prompt[:-1], req.params.cache_salt)
            if cache is not None:
                req.stats.cached_tokens = n
                return cache, n
        return self.model.new_cache(1, len(req.prompt) + req.params.max_new_tokens + 1), 0
