"""The row-feature protocol: what a request asks beyond plain denoising (a grammar, a seeded canvas, logprobs,
drafts) is one `Feature`, called by the engine when a row's prompt is prefilled and at three points of each of its
canvases: when it starts (`start` may already commit), after each denoising step (`step` rewrites the step's output
before the canvas takes it, `settle` acts on the canvas after), and, through `settle`, when it ends (`Step.ending`).
Hooks act only on the rows that carry the feature; a new feature is one module here and one entry in `FEATURES`
(features/__init__.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import Tensor

from dgemma.engine.batch import Canvas
from dgemma.engine.request import Event, Request
from dgemma.model.head import Head
from dgemma.sampling import StepOutput

log = logging.getLogger("dgemma.engine")


@dataclass
class Step:
    """One denoising step of a canvas as the features see it."""

    rows: list[Request]
    canvas: Canvas
    hidden: Tensor  # [B, C, H] the decoder's normed hidden states
    head: Head
    inv_temp: Tensor  # [B] this step's 1 / temperature per row
    out: StepOutput  # the fused step's output (features may rewrite it in `step`)
    events: list[Event]
    step_seconds: float | None = None  # the engine's measured wall time of a step so far (None: none measured)

    def fail(self, i: int, error: BaseException) -> None:
        """Row i failed in its own work (its grammar, its layout): it ends with "error" and leaves the batch at the
        next step; the other rows go on."""
        log.error("request %s failed and was ended: %s: %s", self.rows[i].id, type(error).__name__, error,
                  exc_info=error)
        self.rows[i].finish("error", self.events)

    def ending(self) -> list[bool]:
        """Rows whose canvas ends at this step: done, or out of denoising steps."""
        cv = self.canvas
        return [d or n >= r.params.max_denoising_steps for d, n, r in zip(cv.done, cv.row_steps, self.rows)]


class Feature:
    """Every hook defaults to nothing; `attach` sets a new request's state up (or refuses it)."""

    def attach(self, req: Request, runner) -> None:
        pass

    def prefilled(self, rows: list[Request], hidden: Tensor, head: Head) -> None:
        """These rows' prompts are in their caches: hidden [B, H] is each prompt's last normed hidden state."""

    def start(self, rows: list[Request], tokens: Tensor, events: list[Event]) -> None:
        """A canvas starts for these rows: tokens [B, C] holds their fresh noise (edit it in place)."""

    def step(self, s: Step) -> None:
        """After the fused step, before the canvas takes `s.out`."""

    def settle(self, s: Step) -> None:
        """After the canvas took the step: end rows (`s.canvas.mark_done`), report (`s.events`)."""
