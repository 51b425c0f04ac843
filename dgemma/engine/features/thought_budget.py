"""The thinking budget in a denoising canvas (`SamplingParams.thought_budget`; the rule: sampling/thinking.py): after
each step, the close id is pinned at the position the budget reaches, unless the canvas settled a close before it;
the decoder sees it at the next step, so the answer after it is denoised around it. It runs before the grammar, which
then locks the pinned close as an accepted sample."""

from __future__ import annotations

from dgemma.engine.features.base import Feature, Step
from dgemma.engine.request import Request


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
            first = int(out.canvas[i, 0]) if not r.output and bool(out.accepted[i, 0]) else None
            p = budget.position(r.output, first)
            if p is None or p >= width:
                continue
            if bool(((out.canvas[i, :p] == budget.close) & out.accepted[i, :p]).any()):
                continue  # the model closed the thought on its own
            out.canvas[i, p] = out.argmax[i, p] = budget.close
            out.accepted[i, p] = True
            out.entropy[i, p] = 0.0
