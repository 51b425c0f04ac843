"""Layout canvases (`SamplingParams.layout`: infill before a suffix, templates with holes, edits): the row's progress
through its layout in its slot; the layout's fixed tokens are written into each canvas at its start and kept after
every step, and the layout decides what a canvas shows and commits (the layout itself: sampling/layout.py)."""

from __future__ import annotations

from torch import Tensor

from dgemma.engine.features.base import Feature, Step
from dgemma.engine.request import Commit, Event, Request
from dgemma.sampling.layout import LayoutState, layout_start, layout_step


class LayoutFeature(Feature):
    name = "layout"

    def attach(self, req: Request, engine) -> None:
        if req.params.layout is not None:  # what it needs: SamplingParams.check_decoding
            self.put(req, LayoutState(req.params.layout, req.eos))

    def start(self, rows: list[Request], tokens: Tensor, events: list[Event]) -> None:
        layout_start([self.of(r) for r in rows], tokens)

    def step(self, s: Step) -> None:
        s.out = layout_step([None if r.finished else self.of(r) for r in s.rows], s.out)

    def visible(self, req: Request, ids: list[int]) -> list[int] | None:
        return self.of(req).preview(ids)

    def commit(self, req: Request, c: Commit) -> None:
        """The layout's ids of the canvas; an EOS ends a hole only (it neither ends the request nor cuts the canvas)
        and the request ends with its layout."""
        c.new, finished = self.of(req).take(c.canvas)
        c.eos, c.cut, c.finish = False, False, "stop" if finished else None
