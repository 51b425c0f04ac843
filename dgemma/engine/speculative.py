"""Self-speculative decoding: the decoder drafts, the encoder checks, and the output is autoregressive decoding's.

The encoder is a next-token model (its training objective keeps it one), and committing a canvas already runs it
over every canvas position. So one cycle is: a denoising pass drafts a canvas after the next token (known from
the encoder), the encoder pass that writes the draft into the cache gives the next-token choice after each drafted
position, and the draft is kept up to its first position where that choice differs; the choice there is the next
token. Each token is chosen by `autoregressive.next_token` from the same logits autoregressive decoding would give
it (bit for bit where the check attends row by row, `rows_apart_exact`: bfloat16 on a CPU; elsewhere up to float
rounding, several positions per pass), with one draw per token from the request's generator,
so the ids are `AutoregressiveEngine`'s, greedy or sampled, with a grammar or not; what the draft gets right is
how many of them one cycle commits. Rejected slots leave the cache (`KVCache.truncate`). Where drafts seldom hold
(a weak or mismatched decoder), the engine falls back to plain autoregressive steps and tries a draft again now
and then. Rows run in one batch, each with its own draft noise.

Which steps draft changes the shapes of the encoder's passes, and where the check is not row-exact, the rounding of
the logits: the default pacing decides from counts of committed ids, so a seed gives the same passes, and ids, on
every run whatever the machine's load; `pacing="timed"` decides from measured wall time (opt-in; bit-reproducible
only where the check is row-exact)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dgemma.cache import PrefixCache
from dgemma.engine.autoregressive import AutoregressiveEngine, Row, next_token
from dgemma.engine.request import Event, Request
from dgemma.model import DiffusionGemma
from dgemma.option import PACINGS
from dgemma.quant import compute_dtype
from dgemma.sampling import make_generator
from dgemma.sampling.samplers import random_tokens


MAX_PLAIN = 64  # plain steps between two tries of a draft, at most
# A cycle's cost in plain steps (a denoising pass over the canvas, then an encoder pass over the draft): measured 3.1x
# at bfloat16 and 3.9x at float32 on a 2-core CPU with the bundled model; a cycle that commits fewer ids lost time
CYCLE_COST = 3


def rows_apart_exact(model: DiffusionGemma) -> bool:
    """Whether the check's encoder pass attends row by row (`DiffusionGemma.encode(rows_apart=True)`), so that its
    logits are the plain steps' bit for bit: where the GEMMs run in bfloat16 (or float16) on a CPU, which rounds a
    row alike however many rows there are, and only attention splits its work by the number of queries. float32
    GEMMs (and accelerators' kernels) pick their blocking by shape, so there the ids are equal up to float rounding
    and the row-by-row attention would cost time for nothing."""
    return model.device.type == "cpu" and compute_dtype(model.dtype, model.device) != torch.float32


@dataclass
class Drafting:
    noise: torch.Generator  # the drafts' own: the ids never depend on it
    wait: int = 0  # plain steps left before the row tries a draft again
    backoff: int = 0  # counted pacing: the row's current back-off (0: it drafts at every step)


class SpeculativeEngine(AutoregressiveEngine):
    """Pacing (the speed only; in exact arithmetic the ids are the same either way): a row whose cycle commits at
    least CYCLE_COST ids drafts again at the next step; a cycle that commits fewer doubles the row's back-off (1, 2,
    4, ... at most MAX_PLAIN) and the row takes that many plain steps before it tries again. Decided from the row's
    own counts (`pacing="counted"`, the default), so the passes a seed runs, and their rounding, never depend on
    the clock, and a row's pacing not on the other rows'. `pacing="timed"` (opt-in) compares the measured rates of
    cycles and plain steps instead, with an engine-wide back-off: it adapts to the machine, but which passes run
    depends on the load, and where the check is not row-exact (`rows_apart_exact`) the ids can too."""

    mode = "speculative"
    paced = True  # False: draft at every step (tests of the cycle itself)

    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...], max_batch: int = 1,
                 prefix_cache: PrefixCache | None = None, pacing: str = PACINGS[0]):
        super().__init__(model, eos_ids, max_batch, prefix_cache)
        if pacing not in PACINGS:
            raise ValueError(f"pacing={pacing!r} must be one of {', '.join(PACINGS)}")
        self.timed = pacing == "timed"
        self.rows_apart = rows_apart_exact(model)
        self.plain_rate: float | None = None  # timed: ids per second a row gets from plain steps (a running mean)
        self.backoff = 0  # timed: the engine's back-off

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
                self._pace_timed(r, len(out[id(r)]) / seconds) if self.timed else self._pace(r, len(out[id(r)]))
        return [out[id(r)] for r in rows]

    @staticmethod
    def _pace(row: Row, committed: int) -> None:
        """After a cycle that committed `committed` ids for this row (counted pacing)."""
        s = row.state
        s.backoff = 0 if committed >= CYCLE_COST else min(2 * s.backoff or 1, MAX_PLAIN)
        s.wait = s.backoff

    def _pace_timed(self, row: Row, rate: float) -> None:
        """After a cycle that committed `rate` ids per second for this row (timed pacing)."""
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
        hidden = self.model.encode(ids, [r.cache for r in rows], rows_apart=self.rows_apart)
        logits = self.model.head(hidden)  # [B, width, V]
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
