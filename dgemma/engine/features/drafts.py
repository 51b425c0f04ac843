"""Drafts: after each step, the visible part of the canvas of each row that asked for drafts and moved."""

from __future__ import annotations

from dgemma.engine.features.base import Feature, Step


class Drafts(Feature):
    name = "drafts"

    def after_step(self, s: Step) -> None:
        s.canvas.drafts(s.rows, s.events)
