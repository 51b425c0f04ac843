"""Seeded canvases (infill before a suffix, templates with holes, edits): the layout's fixed tokens are written
into each canvas at its start and kept after every step (the layout itself: sampling/seeded.py)."""

from __future__ import annotations

from torch import Tensor

from dgemma.engine.features.base import Feature, Step
from dgemma.engine.request import Event, Request
from dgemma.sampling.seeded import SeedState, seed_canvas, seed_step


class Infill(Feature):
    def attach(self, req: Request, runner) -> None:
        if req.params.seeded is not None:  # what it needs: SamplingParams.check_decoding
            req.seeded = SeedState(req.params.seeded, req.eos)

    def start(self, rows: list[Request], tokens: Tensor, events: list[Event]) -> None:
        seed_canvas([r.seeded for r in rows], tokens)

    def step(self, s: Step) -> None:
        s.out = seed_step([None if r.finished else r.seeded for r in s.rows], s.out)
