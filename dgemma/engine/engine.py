"""The block-diffusion engine: `add_request` / `step` / `generate` / `stream` on token ids, with continuous
batching.

Each `step()` is three calls: the scheduler decides which rows and positions run (`Scheduler.schedule`: rows leave,
go on and join; the request features shape the pass), the model runner runs the pass (`ModelRunner.run`: the decoder
and the fused vocabulary step), and postprocessing hands its results to the features and the requests (their step
and after_step hooks, the canvas's bookkeeping, the commit of the rows the scheduler's policy ends). Rows are on their
own clocks by default (`RowClocks`: a row whose canvas is done commits it at once, its next canvas starts beside
the others at the next step); `row_clocks=False` selects the batch-wide policy kept to compare (`BatchWide`). A
committed canvas is encoded lazily, so a request's last canvas never is. Each request has its own generator and
positions, so its output does not depend on the rest of the batch. transformers' draw-for-draw sampling is
`ReferenceEngine`'s job.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from dgemma.cache import PrefixCache
from dgemma.engine.base import EngineBase
from dgemma.engine.batch import Canvas
from dgemma.engine.features import FEATURES, Feature, Step
from dgemma.engine.request import Event, Request
from dgemma.engine.runner import ModelRunner, Pass, Ran
from dgemma.engine.scheduler import Batch, BatchWide, RowClocks, Scheduler, prefill_groups
from dgemma.model import DiffusionGemma
from dgemma.sampling.target_canvas_ms import measured

__all__ = ["Engine", "EngineStats", "prefill_groups"]


@dataclass
class EngineStats:
    passes: int = 0  # decoder passes
    rows: int = 0  # rows summed over passes
    done_rows: int = 0  # of those, rows already done (frozen: work thrown away); 0 with row clocks

    def to_dict(self) -> dict:
        return asdict(self) | {"rows_per_pass": self.rows / self.passes if self.passes else 0.0}


class Engine(EngineBase):
    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...], pad_id: int = 0, max_batch: int = 16,
                 prefix_cache: PrefixCache | None = None, features: tuple[Feature, ...] = FEATURES,
                 row_clocks: bool = True):
        policy = RowClocks() if row_clocks else BatchWide()
        self.scheduler = Scheduler(model, pad_id, max_batch, prefix_cache, features, policy)
        super().__init__(model, eos_ids, features)
        self.runner = ModelRunner(model)
        self.pad_id, self.max_batch, self.prefix_cache = pad_id, max_batch, prefix_cache
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

    def requests(self) -> list[Request]:
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
        p = self.scheduler.schedule(events)
        if p is not None:
            self._count(p.canvas)
            self._postprocess(p, self.runner.run(p), events)
            self.step_seconds = measured(self.step_seconds, time.perf_counter() - p.t_start)
        return events

    # ---- postprocessing ---------------------------------------------------------------------------------
    def _postprocess(self, p: Pass, ran: Ran, events: list[Event]) -> None:
        """The features see the step (`step`), the canvas takes it, the features act on the canvas (`after_step`), rows
        out of steps are done, and the rows the policy ends commit."""
        cv = p.canvas
        s = Step(p.rows, cv, ran.hidden, self.model.lm_head, ran.inv_temp, ran.out, events, self.step_seconds)
        for f in self.features:
            f.step(s)
        cv.advance(p.rows, s.out, ran.signal)
        for f in self.features:
            f.after_step(s)
        cv.mark_done([i for i, e in enumerate(s.done_now()) if e and not cv.done[i]])  # out of steps
        self._commit(self.batch, events)

    def _commit(self, b: Batch, events: list[Event]) -> None:
        """Commit the rows the policy ends now; each committed canvas, less what its row's features moved into its
        cache already, is encoded at the next turnover."""
        ended, whole = self.scheduler.policy.to_commit(b.rows, b.canvas)
        if ended:
            rows = [b.rows[i] for i in ended]
            canvases = b.canvas.commit(b.rows, self.pad_id, events, ended)
            b.pending = [(r, ids[r.cached_early:]) for r, ids in zip(rows, canvases)]
        if whole:
            b.canvas = None

    def _count(self, cv: Canvas) -> None:
        self.stats.passes += 1
        self.stats.rows += len(cv.done)
        self.stats.done_rows += sum(cv.done)
