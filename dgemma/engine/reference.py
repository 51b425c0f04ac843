"""transformers' `generate`, draw for draw: a fixed batch with one set of sampling parameters, one global RNG
(seeded once), positions shared by the batch, full float32 logits. For exact comparisons; `Engine` is the fast
path. Rows that finish (EOS, budget, abort) keep being denoised as transformers does; their tokens are dropped."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dgemma.engine.base import EngineBase
from dgemma.engine.batch import Canvas, prefill
from dgemma.engine.request import Event, Request
from dgemma.errors import ConfigError
from dgemma.model import DiffusionGemma
from dgemma.sampling import SamplingParams, reference_step


class ReferenceEngine(EngineBase):
    sampling = "reference"
    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...], pad_id: int = 0):
        super().__init__(model, eos_ids)
        self.pad_id = pad_id
        self.rows: list[Request] = []
        self.started = False

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    drafts: bool = False) -> Request:
        if self.started:
            raise ConfigError("reference sampling runs a fixed batch: requests cannot join once it has started")
        if self.rows and params != self.rows[0].params:
            raise ConfigError("reference sampling uses one set of sampling parameters for the whole batch")
        req = self.make_request(prompt, params, request_id, drafts, own_generator=False)
        self.rows.append(req)
        return req

    def requests(self) -> list[Request]:
        return self.rows

    @torch.inference_mode()
    def stream(self) -> Iterator[Event]:
        if not self.rows:
            return
        self.started = True
        params, c = self.rows[0].params, self.model.cfg.canvas_length
        if params.seed is not None:
            torch.manual_seed(params.seed)
        cache, _, _ = prefill(self.model, self.rows, self.pad_id, params.max_new_tokens + 2 * c, own_positions=False)
        while True:
            padded = yield from self._canvas(cache)
            if all(r.finished for r in self.rows):
                return
            self.model.encode(padded, cache)

    def _canvas(self, cache) -> Iterator[Event]:
        """Denoise one canvas to the end, yielding drafts and the commit; returns the padded canvas."""
        model, rows = self.model, self.rows
        tokens = torch.randint(0, model.cfg.text.vocab_size, (len(rows), model.cfg.canvas_length),
                               device=model.device)
        cv = Canvas.start(rows, tokens)
        while not cv.all_done(rows, finished_rows_count=True):
            hidden = model.denoise(cv.tokens, cache, cv.signal)
            processed = model.head(hidden) / cv.temperature(shared_step=True)[:, None, None]
            cv.advance(rows, reference_step(processed, rows[0].params.entropy_bound), model.soft_embed(processed))
            events: list[Event] = []
            cv.drafts(rows, events)
            yield from events
        events = []
        padded = cv.commit(rows, self.pad_id, events)
        yield from events
        return padded
