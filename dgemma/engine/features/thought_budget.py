"""The thinking budget in a denoising canvas (`SamplingParams.thought_budget`; the rule: sampling/thinking.py): after
each step, the close id is pinned at the position the budget reaches, unless the canvas settled a close before it;
the decoder sees it at the next step, so the answer after it is denoised around it. It runs before the grammar, which
then locks the pinned close as an accepted sample."""

from __future__ import annotations

from dgemma.engine.features.base import Feature, Step
from dgemma.engine.request import Request


def _settled(s: Step, i: int):
    """settled(positions, id): row i holds `id` at one of `positions`, kept by this step or locked before it (a
    grammar's prefix, which this step's samples do not show)."""
    out, cv = s.out, s.canvas

    def settled(at, token: int) -> bool:
        now = (out.canvas[i, at] == token) & out.accepted[i, at]
        before = (cv.tokens[i, at] == token) & cv.accepted[i, at] if cv.accepted is not None else now
        return bool((now | before).any())

    return settled


class ThoughtBudgetFeature(Feature):
    name = "thought_budget"

    def attach(self, req: Request, engine) -> None:
        if req.params.thought_budget is not None:
            self.put(req, req.params.thought_budget)

    def step(self, s: Step) -> None:
        out = s.out
        width = out.canvas.shape[1]
        for i, r in enumerate(s.rows):
            budget = self.of(r)
            if budget is None or r.finished:
                continue
            settled = _settled(s, i)
            p = budget.position(r.output, budget.open if settled(0, budget.open) else None)
            if p is None or p >= width or settled(slice(0, p), budget.close):
                continue  # no thought, the budget lies past this canvas, or the model closed the thought itself
            out.canvas[i, p] = out.argmax[i, p] = budget.close
            out.accepted[i, p] = True
            out.entropy[i, p] = 0.0
