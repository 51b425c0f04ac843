"""Self-speculative decoding: the decoder drafts, the encoder checks, and the output is autoregressive decoding's.

The encoder is a next-token model (its training objective keeps it one), and committing a canvas already runs it
over every canvas position. So one cycle is: a denoising pass drafts a canvas after the next token (known from
the encoder), the encoder pass that writes the draft into the cache gives the next-token choice after each drafted
position, and the draft is kept up to its first position where that choice differs; the choice there is the next
token. Each token is chosen by `autoregressive.next_token` from the same logits autoregressive decoding would give
it (up to float rounding: several positions per pass), with one draw per token from the request's generator,
so the ids are `AutoregressiveEngine`'s, greedy or sampled, with a grammar or not; what the draft gets right is
how many of them one cycle commits. Rejected slots leave the cache (`KVCache.truncate`). Where drafts seldom hold
(a weak or mismatched decoder), the engine falls back to plain autoregressive steps and tries a draft again now
and then. Rows run in one batch, each with its own draft noise."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dgemma.cache import PrefixCache
from dgemma.engine.autoregressive import AutoregressiveEngine, Row, next_token
from dgemma.engine.request import Event, Request
from dgemma.model import DiffusionGemma
from dgemma.sampling import make_generator
from dgemma.sampling.samplers import random_tokens


MAX_PLAIN = 64  # plain steps between two tries of a draft, at most


@dataclass
class Drafting:
    noise: torch.Generator  # the drafts' own: the ids never depend on it
    wait: int = 0  # plain steps left before the row tries a draft again


class SpeculativeEngine(AutoregressiveEngine):
    """Pacing (the speed only; the ids are the same either way): while cycles commit ids faster than a plain
    autoregressive step (both timed), every step drafts; a slower cycle doubles the engine's back-off (1, 2, 4, ...
    at most MAX_PLAIN), and its row takes that many plain steps before it tries again. Back-off and plain-step rate
    are the engine's: how often drafts hold is the model's, and a new request tries once and then waits as long."""

    mode = "speculative"
    paced = True  # False: draft at every step (tests of the cycle itself)

    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...], max_batch: int = 1,
                 prefix_cache: PrefixCache | None = None):
        super().__init__(model, eos_ids, max_batch, prefix_cache)
        self.plain_rate: float | None = None  # ids per second a row gets from plain steps (a running mean)
        self.backoff = 0

    def _start(self, req: Request, events: list[Event]) -> Row:
        row = super()._start(req, events)
        row.state = Drafting(make_generator(req.params.seed, self.model.device))
        return row

    def _advance(self, rows: list[Row], events: list[Event]) -> list[list[int]]:
        """The rows that may draft (all, unpaced) run a cycle (`_cycle`), the others a plain step, each group in
        passes of its own; per row, its next tokens."""
        plain = [r for r in rows if self.paced and r.state.wait]
        out = {}
        if plain:
            t0, starts = time.perf_counter(), [r.cache.length for r in plain]
            out |= {id(r): tokens for r, tokens in zip(plain, super()._advance(plain, events))}
            rate = 1 / (time.perf_counter() - t0)
            self.plain_rate = rate if self.plain_rate is None else (self.plain_rate + rate) / 2
            for r, start in zip(plain, starts):
                r.req.stats.cycles.append((start, 1, False))
                r.state.wait -= 1
        if cycling := [r for r in rows if id(r) not in out]:
            t0 = time.perf_counter()
            out |= {id(r): tokens for r, tokens in zip(cycling, self._cycle(cycling, events))}
            seconds = time.perf_counter() - t0
            for r in cycling:
                self._pace(r, len(out[id(r)]) / seconds)
        return [out[id(r)] for r in rows]

    def _pace(self, row: Row, rate: float) -> None:
        """After a cycle that committed `rate` ids per second for this row."""
        if self.plain_rate is None:
            row.state.wait = 1  # time a plain step before judging
        elif rate < self.plain_rate:
            self.backoff = row.state.wait = min(2 * self.backoff or 1, MAX_PLAIN)
        else:
            self.backoff = 0

    def _cycle(self, rows: list[Row], events: list[Event]) -> list[list[int]]:
        """One denoising pass drafts a canvas after each row's token; one encoder pass caches each row's token and
        drafted ids and checks them. Per row: the drafted ids that hold, then the next token."""
        drafts = self._drafts(rows)
        for r, seq in zip(rows, drafts):
            if r.req.drafts:
                events.append(Event(r.req.id, "draft", r.req.visible(seq[1:])))
        spans = [self._span(r.req, seq) for r, seq in zip(rows, drafts)]
        width = max(spans)  # shorter rows are padded at the end: the padding only follows them, and leaves
        ids = torch.tensor([seq[:n] + [seq[n - 1]] * (width - n) for seq, n in zip(drafts, spans)],
                           device=self.model.device)
        starts = [r.cache.length for r in rows]
        logits = self.model.head(self.model.encode(ids, [r.cache for r in rows]))  # [B, width, V]
        out = [self._check(r, seq, n, logits[i]) for i, (r, seq, n) in enumerate(zip(rows, drafts, spans))]
        for r, start, n, tokens in zip(rows, starts, spans, out):
            r.cache.truncate(start + len(tokens))  # `token` and the drafted ids kept; the rest leaves
            r.req.stats.decoder_passes += 2
            r.req.stats.cycles.append((start, n, True))
        return out

    @staticmethod
    def _check(row: Row, seq: list[int], span: int, logits: torch.Tensor) -> list[int]:
        """The row's next tokens: each chosen from the logits after the one before (logits[i] after seq[i]), as
        long as the choice is the drafted id; the first choice that is not ends them."""
        tokens = []
        for i in range(span):
            tokens.append(next_token(row.req, logits[i:i + 1], tokens))
            if i + 1 == span or tokens[-1] != seq[i + 1]:
                break
        return tokens

    def _drafts(self, rows: list[Row]) -> list[list[int]]:
        """One denoising pass over a canvas of noise per row that starts with its token: the argmax, the token
        first."""
        if not rows:
            return []
        c, vocab = self.model.cfg.canvas_length, self.model.cfg.text.vocab_size
        canvas = torch.cat([random_tokens((1, c), vocab, self.model.device, r.state.noise) for r in rows])
        canvas[:, 0] = torch.tensor([r.token for r in rows], device=self.model.device)
        ids = self.model.head(self.model.denoise(canvas, [r.cache for r in rows])).argmax(-1).tolist()
        return [[r.token, *row_ids[1:]] for r, row_ids in zip(rows, ids)]

    @staticmethod
    def _span(req: Request, seq: list[int]) -> int:
        """Positions to encode and check: those before the draft's first end-of-sequence id (the last of them
        predicts it), and no more than the budget can take."""
        end = next((i for i, t in enumerate(seq) if i and t in req.eos), len(seq))
        return max(1, min(end, req.budget))
