"""The block-diffusion engine: `add_request` / `step` / `generate` / `stream` on token ids, with continuous
batching.

`step()` runs one decoder pass over the batch's rows. Rows are on their own clocks (`row_clocks`, the default): a
row whose canvas is done (stable and confident, grammar complete, or out of steps) commits it at once; at the next
step its canvas is encoded into its cache and its next canvas starts while the other rows keep denoising, and
waiting requests join (`Scheduler`) at every step, so done rows never ride along in a pass. With
`row_clocks=False` the batch moves from canvas to canvas together (the earlier behaviour, kept to compare): done
rows stay frozen in the pass until every row is done, and requests join only at that boundary. Either way a
committed canvas is encoded lazily, so a request's last canvas never is. Request features (grammar, seeded
canvases, logprobs, drafts) are parts called at fixed points of a canvas (`features/`). Each request has its own
generator and positions, so its output does not depend on the rest of the batch. transformers' draw-for-draw
sampling is `ReferenceRunner`'s job.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from dgemma.cache import PrefixCache
from dgemma.engine.batch import Canvas
from dgemma.engine.features import FEATURES, Feature, Step, early_cache, settled
from dgemma.engine.request import Event, Request
from dgemma.engine.runner import Runner
from dgemma.engine.scheduler import Batch, Scheduler, prefill_groups
from dgemma.model import DiffusionGemma
from dgemma.model.diffusion_gemma import PREFILL_CHUNK
from dgemma.sampling import random_tokens
from dgemma.sampling.fused import fast_step
from dgemma.sampling.latency import measured

__all__ = ["Engine", "EngineStats", "prefill_groups"]


@dataclass
class EngineStats:
    passes: int = 0  # decoder passes
    rows: int = 0  # rows summed over passes
    done_rows: int = 0  # of those, rows already done (frozen: work thrown away); 0 with row clocks

    def to_dict(self) -> dict:
        return asdict(self) | {"rows_per_pass": self.rows / self.passes if self.passes else 0.0}


class Engine(Runner):
    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...], pad_id: int = 0, max_batch: int = 16,
                 prefix_cache: PrefixCache | None = None, features: tuple[Feature, ...] = FEATURES,
                 row_clocks: bool = True):
        self.scheduler = Scheduler(model, pad_id, max_batch, prefix_cache, PREFILL_CHUNK if row_clocks else None,
                                   self._prefilled)
        super().__init__(model, eos_ids, features)
        self.pad_id, self.max_batch, self.prefix_cache, self.row_clocks = pad_id, max_batch, prefix_cache, row_clocks
        self.canvas_length = model.cfg.canvas_length
        self.stats = EngineStats()
        self.step_seconds: float | None = None  # measured wall time of a denoising step (latency targets)

    # ---- public API -------------------------------------------------------------------------------------
    @property
    def waiting(self) -> list[Request]:
        return self.scheduler.waiting

    @waiting.setter
    def waiting(self, rows: list[Request]) -> None:
        self.scheduler.waiting = rows

    @property
    def batch(self) -> Batch | None:
        return self.scheduler.batch

    def held(self) -> list[Request]:
        running = [] if self.batch is None else self.batch.rows
        return self.waiting + [r for r, _ in self.scheduler.prefilling] + running

    def has_work(self) -> bool:
        return bool(self.waiting or self.scheduler.prefilling) or self.batch is not None

    @torch.inference_mode()
    def tidy(self) -> bool:
        return self.scheduler.tidy()

    @property
    def num_running(self) -> int:
        return 0 if self.batch is None else sum(not r.finished for r in self.batch.rows)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        events: list[Event] = []
        if self.row_clocks or self.batch is None or self.batch.canvas is None:
            self._turnover(events)
        if events:  # a starting canvas committed ids already (early_first_token): they leave before the pass
            return events
        if self.batch is not None:
            t, passes = time.perf_counter(), self.stats.passes
            self._denoise_step(events)
            if self.stats.passes > passes:  # a call that only dropped aborted rows ran no step: not a step time
                self.step_seconds = measured(self.step_seconds, time.perf_counter() - t)
        return events

    # ---- between steps ----------------------------------------------------------------------------------
    def _turnover(self, events: list[Event]) -> None:
        """Rows that committed a canvas go on (finished ones leave; the others' canvases are encoded and their
        next ones start), and waiting requests join with a fresh canvas."""
        b = self.batch
        going_on = self._encode_pending(b) if b is not None and b.pending and self.scheduler.prune() else []
        joined = self.scheduler.admit()
        if (b := self.batch) is None:
            return
        if b.canvas is None:  # a new batch, or the batch-wide boundary: every row starts
            b.canvas = self._fresh(b.rows, events)
            return
        if going_on:
            b.canvas.put(going_on, self._fresh([b.rows[i] for i in going_on], events))
        if joined:
            b.canvas.extend(self._fresh(joined, events))

    def _encode_pending(self, b: Batch) -> list[int]:
        """Encode the committed canvases of the rows still in the batch (what early commit did not move into their
        caches already), rows with as many ids together; returns their indices."""
        at = {id(r): i for i, r in enumerate(b.rows)}
        going = [(at[id(r)], ids) for r, ids in b.pending if id(r) in at]
        b.pending = []
        for n in sorted({len(ids) for _, ids in going}):
            group = [(i, ids) for i, ids in going if len(ids) == n]
            self.model.encode(torch.stack([ids for _, ids in group]), [b.caches[i] for i, _ in group])
        return [i for i, _ in going]

    def _fresh(self, rows: list[Request], events: list[Event]) -> Canvas:
        """A new canvas for these rows: noise from each row's generator, then the features' start."""
        tokens = random_tokens((len(rows), self.canvas_length), self.model.cfg.text.vocab_size, self.model.device,
                               [r.generator for r in rows])
        for f in self.features:
            f.start(rows, tokens, events)
        return Canvas.start(rows, tokens)

    def _prefilled(self, rows: list[Request], hidden: torch.Tensor) -> None:
        for f in self.features:
            f.prefilled(rows, hidden, self.model.lm_head)

    # ---- one denoising step -----------------------------------------------------------------------------
    def _denoise_step(self, events: list[Event]) -> None:
        b = self.batch
        if any(r.finished for r in b.rows) and not self.scheduler.prune():
            return  # aborted rows leave mid-canvas, so they stop costing compute
        cv, model = b.canvas, self.model
        self._count(cv)
        early_cache.move(model, b.rows, cv, b.caches)
        reuse = settled.reuse(b.rows, cv)
        moved = early_cache.denoise(model, b.rows, cv, b.caches, reuse)
        hidden, reuse = moved or (settled.denoise(model, b.rows, cv, b.caches, reuse), reuse)
        inv_temp = 1.0 / cv.temperature()
        out, signal = fast_step(hidden, model.lm_head, inv_temp, cv.entropy_bound, [r.generator for r in b.rows],
                                cv.done, want_signal=not cv.last_step(b.rows),
                                top_k=[r.params.soft_top_k for r in b.rows], reuse=reuse)
        s = Step(b.rows, cv, hidden, model.lm_head, inv_temp, out, events, self.step_seconds)
        for f in self.features:
            f.step(s)
        cv.advance(b.rows, s.out, signal)
        for f in self.features:
            f.settle(s)
        cv.mark_done([i for i, e in enumerate(s.ending()) if e and not cv.done[i]])  # out of steps
        self._commit(b, events)

    def _commit(self, b: Batch, events: list[Event]) -> None:
        """Commit the rows whose canvas is done (with row clocks), or every row once all are (batch-wide)."""
        cv = b.canvas
        if self.row_clocks:
            ended = [i for i, (d, r) in enumerate(zip(cv.done, b.rows)) if d and not r.finished]
            if ended:
                b.pending = _unmoved([b.rows[i] for i in ended], cv.commit(b.rows, self.pad_id, events, ended))
        elif cv.all_done(b.rows, finished_rows_count=False):
            b.pending, b.canvas = _unmoved(b.rows, cv.commit(b.rows, self.pad_id, events)), None

    def _count(self, cv: Canvas) -> None:
        self.stats.passes += 1
        self.stats.rows += len(cv.done)
        self.stats.done_rows += sum(cv.done)


def _unmoved(rows: list[Request], canvases: torch.Tensor) -> list[tuple[Request, torch.Tensor]]:
    """Each committed canvas [C] less what early commit moved into its row's cache; a row that finished with it
    counts those as encoded early (an encoder pass the defaults never run on a last canvas)."""
    for r in rows:
        r.stats.encoded_early += r.moved if r.finished else 0
    return [(r, ids[r.moved:]) for r, ids in zip(rows, canvases)]
