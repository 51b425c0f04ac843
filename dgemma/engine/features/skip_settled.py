"""Settled positions (`SamplingParams.skip_settled` = N): which positions of a row's canvas a step leaves out (its
slot keeps each position's settled run), with `settled_kv_reuse` the body pass over the others only; and the count
of the work the opt-in savings (settled positions, `soft_top_k`) spare, for bench/flops.py.

A position is settled once, for N consecutive denoising steps of its canvas, the step accepted it, its sample
equals the token it was given (the canvas did not change there) and its argmax equals the previous step's; the
first step of a canvas never counts (there is no previous step). A settled position stays settled until its
canvas ends: later steps leave it out of the head and soft-embedding work and reuse its previous argmax, token and
self-conditioning signal (`sampling/fused.py`, `Reuse`); it is accepted, so it counts on as settled. Its entropy
counts as 0 (certain) in the acceptance and the stopping rule: its last computed one was taken at an earlier,
higher temperature, and kept, it would hold the canvas's mean entropy above the confidence threshold forever.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dgemma.engine.batch import Canvas
from dgemma.engine.features.base import Counter, Feature, Step
from dgemma.engine.request import Event, Request
from dgemma.engine.runner import Pass
from dgemma.model import DiffusionGemma
from dgemma.sampling.early import stable_runs


@dataclass
class SettledState:
    run: Tensor  # [C] long: consecutive steps each position met the rule

    def skip(self, n: int) -> Tensor:
        return self.run >= n


class SkipSettled(Feature):
    name = "skip_settled"
    counters = (Counter("skipped_head_rows", "vocab_row"), Counter("skipped_soft_rows", "vocab_row"),
                Counter("sparse_soft_rows", "sparse_soft_row"), Counter("skipped_body_rows", "canvas_body_row"))

    def start(self, rows: list[Request], tokens: Tensor, events: list[Event]) -> None:
        for r, t in zip(rows, tokens):
            if r.params.skip_settled is not None:
                self.put(r, SettledState(torch.zeros(t.shape[0], dtype=torch.long, device=t.device)))

    def shape(self, p: Pass, model: DiffusionGemma) -> None:
        """Settled positions leave the head work; when every row asks `settled_kv_reuse`, the body runs on the
        positions that are not settled only (each row's, padded with settled ones to the batch's widest), their keys
        and values those of the last pass (`DiffusionGemma.denoise(keep=...)`)."""
        skip = self._skip(p.rows, p.canvas)
        if skip is None:
            return
        p.skip = skip if p.skip is None else p.skip | skip
        keep = _body_rows(p.rows, skip)
        if keep is not None:
            p.keep = keep
            for r in p.rows:
                r.stats.add("skipped_body_rows", skip.shape[1] - keep.shape[1])

    def _skip(self, rows: list[Request], cv: Canvas) -> Tensor | None:
        """[B, C] what this step leaves out of the batch's canvas, or None when no row has a settled position."""
        states = [self.of(r) for r in rows]
        if all(st is None for st in states):
            return None
        c, device = cv.tokens.shape[1], cv.tokens.device
        skip = torch.stack([torch.zeros(c, dtype=torch.bool, device=device) if st is None or cv.done[i]
                            else st.skip(r.params.skip_settled) for i, (r, st) in enumerate(zip(rows, states))])
        return skip if bool(skip.any()) else None

    def step(self, s: Step) -> None:
        """Count what the step saved, then advance each position's run (before the canvas takes the step, so its
        input tokens and previous draft are still there)."""
        cv, out = s.canvas, s.out
        wanted_signal = not cv.last_step(s.rows)
        for i, r in enumerate(s.rows):
            st, c = self.of(r), out.canvas.shape[1]
            if cv.done[i] or (st is None and r.params.soft_top_k is None):
                continue
            skipped = 0 if st is None else int(st.skip(r.params.skip_settled).sum())
            r.stats.add("skipped_head_rows", skipped)
            r.stats.add("skipped_soft_rows", skipped * wanted_signal)
            r.stats.add("sparse_soft_rows", (c - skipped) * wanted_signal * (r.params.soft_top_k is not None))
            if st is not None and cv.row_steps[i] > 0:
                kept = out.accepted[i] & (out.canvas[i] == cv.tokens[i])  # accepted, and the canvas did not move
                st.run = stable_runs(cv.argmax[i], out.argmax[i], kept, st.run)


def _body_rows(rows: list[Request], skip: Tensor) -> Tensor | None:
    """[B, m] the positions the body runs on, in order, or None for all of them."""
    if not all(r.params.settled_kv_reuse for r in rows):
        return None
    m = max(1, int((~skip).sum(1).max()))  # at least one position: a pass of none has no shape
    if m == skip.shape[1]:
        return None
    first = torch.sort(skip.to(torch.int8), dim=1, stable=True).indices[:, :m]  # unsettled ones first
    return first.sort(dim=1).values
