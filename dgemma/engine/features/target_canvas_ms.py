"""Latency target (`target_canvas_ms`): once the engine has measured its step time (`Step.step_seconds`), each
canvas of a request that asks gets the step budget that fits it (`max_denoising_steps`, capped by the request's own,
which its slot keeps) and the temperature schedule of that budget (`Canvas.reschedule`), after its first step;
every schedule starts at t_max, so that first step is the same either way. The rule: sampling/target_canvas_ms.py.
The one diffusion option decided by the clock: its outputs follow the machine's load, not only the seed."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from dgemma.engine.features.base import Feature, Step
from dgemma.engine.request import Event, Request
from dgemma.sampling.target_canvas_ms import step_budget


@dataclass
class Budget:
    cap: int  # the request's own max_denoising_steps
    chosen: bool = False  # this canvas's budget is chosen


class TargetCanvasMs(Feature):
    name = "target_canvas_ms"

    def attach(self, req: Request, engine) -> None:
        if req.params.target_canvas_ms is not None:  # what it needs: SamplingParams.check_decoding
            self.put(req, Budget(req.params.max_denoising_steps))

    def start(self, rows: list[Request], tokens: Tensor, events: list[Event]) -> None:
        """A new canvas starts under the request's own cap (Canvas.start reads it), not the last canvas's budget:
        a budget of one would make its first step the last, its self-conditioning signal never computed."""
        for r in rows:
            if (b := self.of(r)) is not None:
                r.params, b.chosen = r.params.replace(max_denoising_steps=b.cap), False

    def after_step(self, s: Step) -> None:
        if s.step_seconds is None:
            return
        for i, r in enumerate(s.rows):
            b = self.of(r)
            if b is not None and not b.chosen and not r.finished and not s.canvas.done[i]:
                steps = step_budget(r.params.target_canvas_ms, s.step_seconds, b.cap)
                r.params, b.chosen = r.params.replace(max_denoising_steps=steps), True
                s.canvas.reschedule(i, r.params)
