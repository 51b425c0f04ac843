"""The block-diffusion engine: `add_request` / `step` / `generate` / `stream` on token ids, with continuous
batching.

One batch is decoded at a time. `step()` runs one denoising step for every row; when every row's canvas is done
(stable and confident, or out of steps) the canvas is committed, finished requests leave, waiting requests
join, and the next canvas starts. A canvas is encoded into the cache lazily, at the start of the next one, so
the last canvas of a request is never encoded. Each request has its own generator and positions, so its output
does not depend on the rest of the batch. transformers' draw-for-draw sampling is `ReferenceRunner`'s job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dgemma.cache import KVCache, PrefixCache
from dgemma.engine.batch import Canvas, prefill
from dgemma.engine.request import Event, Request
from dgemma.engine.runner import Runner
from dgemma.model import DiffusionGemma
from dgemma.sampling import random_tokens
from dgemma.sampling.constrained import Head, constrain_step, finish_rows, start_canvas
from dgemma.sampling.logprobs import canvas_logprobs
from dgemma.sampling.seeded import seed_canvas, seed_step
from dgemma.sampling.fused import fast_step


@dataclass
class _Batch:
    rows: list[Request]
    caches: list[KVCache]  # one per row: a request joins and leaves without touching the others' caches
    pending: torch.Tensor | None = None  # [B, C] committed canvas not yet encoded into the caches
    canvas: Canvas | None = None


def prefill_groups(rows: list[Request], waste: float = 0.25) -> list[list[Request]]:
    """Rows admitted together, grouped for batched prefill: by prompt length, so that left padding adds at
    most `waste` of the group's real tokens."""
    rows = sorted(rows, key=lambda r: len(r.prompt))
    groups: list[list[Request]] = []
    for r in rows:
        g = groups[-1] if groups else None
        if g and len(r.prompt) * (len(g) + 1) <= (1 + waste) * (sum(len(q.prompt) for q in g) + len(r.prompt)):
            g.append(r)
        else:
            groups.append([r])
    return groups


class Engine(Runner):
    constrains = seeds = True

    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...], pad_id: int = 0, max_batch: int = 16,
                 prefix_cache: PrefixCache | None = None):
        super().__init__(model, eos_ids)
        self.pad_id = pad_id
        self.max_batch = max_batch
        self.prefix_cache = prefix_cache
        self.canvas_length = model.cfg.canvas_length
        self.batch: _Batch | None = None

    # ---- public API -------------------------------------------------------------------------------------
    def held(self) -> list[Request]:
        return self.waiting + ([] if self.batch is None else self.batch.rows)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.batch is not None

    @property
    def num_running(self) -> int:
        return 0 if self.batch is None else sum(not r.finished for r in self.batch.rows)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        events: list[Event] = []
        if self.batch is None or self.batch.canvas is None:
            self._boundary()
        if self.batch is not None:
            self._denoise_step(events)
        return events

    # ---- canvas boundaries ------------------------------------------------------------------------------
    def _boundary(self) -> None:
        b = self.batch
        if b is not None and b.pending is not None:
            self._commit(b)
        self._admit()
        if self.batch is not None:
            b = self.batch
            tokens = random_tokens((len(b.rows), self.canvas_length), self.model.cfg.text.vocab_size,
                                   self.model.device, [r.generator for r in b.rows])
            seed_canvas([r.seeded for r in b.rows], tokens)
            b.canvas = Canvas.start(b.rows, tokens)
            start_canvas([r.grammar for r in b.rows], [r.budget for r in b.rows], self.canvas_length)

    def _commit(self, b: _Batch) -> None:
        """Encode the last canvas of the rows that go on."""
        if not self._keep_live_rows(b):
            return
        self.model.encode(b.pending, b.caches)
        b.pending = None

    def _keep_live_rows(self, b: _Batch) -> bool:
        """Drop finished rows from the batch (their caches go with them; no other row's is touched); False, and
        no batch, if none is left."""
        keep = [i for i, r in enumerate(b.rows) if not r.finished]
        if self.prefix_cache is not None:
            self._remember([(r, c) for r, c in zip(b.rows, b.caches) if r.finish_reason in ("stop", "length")])
        if not keep:
            self.batch = None
            return False
        if len(keep) < len(b.rows):
            index = torch.tensor(keep, device=self.model.device)
            b.rows, b.caches = [b.rows[i] for i in keep], [b.caches[i] for i in keep]
            b.pending = None if b.pending is None else b.pending[index]
            if b.canvas is not None:
                b.canvas.select(index, keep)
        return True

    def _admit(self) -> None:
        """Give each joining request its own cache: a copy of its longest cached prefix and the rest of its prompt
        encoded after it, or a prefill of all of it (grouped by length)."""
        room = self.max_batch - (0 if self.batch is None else len(self.batch.rows))
        rows, self.waiting = self.waiting[:room], self.waiting[room:]
        if not rows:
            return
        caches = {r.id: self._from_prefix(r) for r in rows} if self.prefix_cache is not None else {}
        for group in prefill_groups([r for r in rows if caches.get(r.id) is None]):
            cache, pads = prefill(self.model, group, self.pad_id, 2 * self.canvas_length, own_positions=True)
            caches.update((r.id, cache.extract(i, pad, cache.length)) for i, (r, pad) in enumerate(zip(group, pads)))
        if self.prefix_cache is not None:
            for r in rows:
                self.prefix_cache.store(r.prompt, caches[r.id], r.params.cache_salt)
        if self.batch is None:
            self.batch = _Batch([], [])
        self.batch.rows += rows
        self.batch.caches += [caches[r.id] for r in rows]

    def _from_prefix(self, r: Request) -> KVCache | None:
        cache, n = self.prefix_cache.lookup(r.prompt, r.params.cache_salt)
        if cache is not None:
            r.stats.t_start, r.stats.cached_tokens = time.perf_counter(), n
            if n < len(r.prompt):
                self.model.prefill(torch.tensor([r.prompt[n:]], device=self.model.device), cache)
        return cache

    def _remember(self, finished: list[tuple[Request, KVCache]]) -> None:
        """Keep finished requests' prompts and answers for later turns: the answer's last canvas (never encoded
        while decoding) is encoded first, up to the answer's end."""
        for r, cache in finished:
            tokens = r.prompt + r.output
            if len(tokens) > cache.length:
                self.model.encode(torch.tensor([tokens[cache.length:]], device=self.model.device), cache)
            self.prefix_cache.store(tokens, cache, r.params.cache_salt)

    # ---- one denoising step -----------------------------------------------------------------------------
    def _denoise_step(self, events: list[Event]) -> None:
        b = self.batch
        if any(r.finished for r in b.rows) and not self._keep_live_rows(b):
            return  # aborted rows leave mid-canvas, so they stop costing compute
        cv, model = b.canvas, self.model
        hidden = model.denoise(cv.tokens, b.caches, cv.signal)
        inv_temp = 1.0 / cv.temperature()
        out, signal = fast_step(hidden, model.embed_tokens.weight, model.cfg.text.final_logit_softcapping,
                                model.embed_scale, inv_temp, cv.entropy_bound,
                                [r.generator for r in b.rows], cv.frozen, want_signal=not cv.last_step(b.rows))
        out = seed_step([None if r.finished else r.seeded for r in b.rows], out)
        grammars = [None if r.finished else r.grammar for r in b.rows]
        if any(grammars):
            out = constrain_step(grammars, out, hidden, self._head(), inv_temp,
                                 [r.generator for r in b.rows], cv.frozen)
        cv.advance(b.rows, out, signal)
        if any(grammars):
            cv.mark_done(finish_rows(grammars, cv.argmax, hidden, self._head(), self._ending(b.rows)))
        ending = self._ending(b.rows)  # with the rows whose grammar prefix just completed
        if any(r.params.logprobs is not None for r in b.rows):
            self._logprobs(b.rows, hidden, inv_temp.tolist(), ending)
        cv.mark_done([i for i, e in enumerate(ending) if e and not cv.frozen[i]])  # out of steps: stop this row
        cv.drafts(b.rows, events)
        if cv.over(b.rows, finished_rows_count=False):
            b.pending, b.canvas = cv.commit(b.rows, self.pad_id, events), None

    def _head(self) -> Head:
        return Head(self.model.embed_tokens.weight, self.model.cfg.text.final_logit_softcapping)

    def _ending(self, rows) -> list[bool]:
        """Rows whose canvas ends at this step: done, or out of denoising steps."""
        cv = self.batch.canvas
        return [f or n >= r.params.max_denoising_steps for f, n, r in zip(cv.frozen, cv.row_steps, rows)]

    def _logprobs(self, rows, hidden: torch.Tensor, inv_temp: list[float], ending: list[bool]) -> None:
        """Rows that asked for logprobs and whose canvas ends now: their draft's log-probabilities at this step."""
        cv = self.batch.canvas
        for i, r in enumerate(rows):
            if r.params.logprobs is not None and ending[i] and r.canvas_logprobs is None and not r.finished:
                r.canvas_logprobs = canvas_logprobs(hidden[i], cv.argmax[i].tolist(), self._head(), inv_temp[i],
                                                    r.params.logprobs)
