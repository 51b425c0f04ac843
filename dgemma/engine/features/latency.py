"""Latency target: when a row's canvas starts, its step budget (`max_denoising_steps`, so its temperature
schedule too) becomes what fits the request's `target_canvas_ms` at the engine's measured step time
(`Request.step_seconds`, set by the engine; the rule: sampling/latency.py). Before any step was measured a canvas
keeps the request's own budget."""

from __future__ import annotations

from torch import Tensor

from dgemma.engine.features.base import Feature
from dgemma.engine.request import Request
from dgemma.sampling import SamplingParamsError
from dgemma.sampling.latency import step_budget


class LatencyTarget(Feature):
    def attach(self, req: Request, runner) -> None:
        if req.params.target_canvas_ms is not None:
            if not runner.commits_early:
                raise SamplingParamsError("target_canvas_ms needs fast diffusion decoding", "target_canvas_ms")
            req.step_cap = req.params.max_denoising_steps

    def start(self, rows: list[Request], tokens: Tensor) -> None:
        for r in rows:
            if r.params.target_canvas_ms is not None and r.step_seconds is not None:
                steps = step_budget(r.params.target_canvas_ms, r.step_seconds, r.step_cap)
                r.params = r.params.replace(max_denoising_steps=steps)
