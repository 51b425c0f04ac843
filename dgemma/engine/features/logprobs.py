"""Log-probabilities of committed tokens: for each row that asks, computed at the step its canvas ends, from that
step's hidden states (what they mean: sampling/logprobs.py); `Request.commit` attaches them to the commit."""

from __future__ import annotations

from dgemma.engine.features.base import Feature, Step
from dgemma.sampling.logprobs import canvas_logprobs


class Logprobs(Feature):
    def settle(self, s: Step) -> None:
        if not any(r.params.logprobs is not None for r in s.rows):
            return
        ending, inv_temp = s.ending(), s.inv_temp.tolist()
        for i, r in enumerate(s.rows):
            if r.params.logprobs is not None and ending[i] and r.canvas_logprobs is None and not r.finished:
                r.canvas_logprobs = canvas_logprobs(s.hidden[i], s.canvas.argmax[i].tolist(), s.head, inv_temp[i],
                                                    r.params.logprobs)
