"""The block-diffusion engine: `add_request` / `step` / `generate` / `stream` on token ids, with continuous
batching.

One batch is decoded at a time. `step()` runs one denoising step for every row; when every row's canvas is done
(stable and confident, grammar complete, or out of steps) the canvas is committed, finished requests leave,
waiting requests join (`Scheduler`), and the next canvas starts. A canvas is encoded into the cache lazily, at the
start of the next one, so the last canvas of a request is never encoded. Request features (grammar, seeded
canvases, logprobs, drafts) are parts called at fixed points of a canvas (`features/`). Each request has its own
generator and positions, so its output does not depend on the rest of the batch. transformers' draw-for-draw
sampling is `ReferenceRunner`'s job.
"""

from __future__ import annotations

import torch

from dgemma.cache import PrefixCache
from dgemma.engine.batch import Canvas
from dgemma.engine.features import FEATURES, Feature, Step
from dgemma.engine.request import Event
from dgemma.engine.runner import Runner
from dgemma.engine.scheduler import Batch, Scheduler, prefill_groups
from dgemma.model import DiffusionGemma
from dgemma.sampling import random_tokens
from dgemma.sampling.fused import fast_step

__all__ = ["Engine", "prefill_groups"]


class Engine(Runner):
    constrains = seeds = True

    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...], pad_id: int = 0, max_batch: int = 16,
                 prefix_cache: PrefixCache | None = None, features: tuple[Feature, ...] = FEATURES):
        self.scheduler = Scheduler(model, pad_id, max_batch, prefix_cache)
        super().__init__(model, eos_ids, features)
        self.pad_id, self.max_batch, self.prefix_cache = pad_id, max_batch, prefix_cache
        self.canvas_length = model.cfg.canvas_length

    # ---- public API -------------------------------------------------------------------------------------
    @property
    def waiting(self):
        return self.scheduler.waiting

    @waiting.setter
    def waiting(self, rows) -> None:
        self.scheduler.waiting = rows

    @property
    def batch(self) -> Batch | None:
        return self.scheduler.batch

    def held(self) -> list:
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
        """Encode the last canvas of the rows that go on, admit waiting requests, start the next canvas."""
        b = self.batch
        if b is not None and b.pending is not None and self.scheduler.prune():
            self.model.encode(b.pending, b.caches)
            b.pending = None
        self.scheduler.admit()
        if (b := self.batch) is not None:
            tokens = random_tokens((len(b.rows), self.canvas_length), self.model.cfg.text.vocab_size,
                                   self.model.device, [r.generator for r in b.rows])
            for f in self.features:
                f.start(b.rows, tokens)
            b.canvas = Canvas.start(b.rows, tokens)

    # ---- one denoising step -----------------------------------------------------------------------------
    def _denoise_step(self, events: list[Event]) -> None:
        b = self.batch
        if any(r.finished for r in b.rows) and not self.scheduler.prune():
            return  # aborted rows leave mid-canvas, so they stop costing compute
        cv, model = b.canvas, self.model
        hidden = model.denoise(cv.tokens, b.caches, cv.signal)
        inv_temp = 1.0 / cv.temperature()
        out, signal = fast_step(hidden, model.lm_head, inv_temp, cv.entropy_bound, [r.generator for r in b.rows],
                                cv.done, want_signal=not cv.last_step(b.rows))
        s = Step(b.rows, cv, hidden, model.lm_head, inv_temp, out, events)
        for f in self.features:
            f.step(s)
        cv.advance(b.rows, s.out, signal)
        for f in self.features:
            f.settle(s)
        cv.mark_done([i for i, e in enumerate(s.ending()) if e and not cv.done[i]])  # out of steps
        if cv.all_done(b.rows, finished_rows_count=False):
            b.pending, b.canvas = cv.commit(b.rows, self.pad_id, events), None
