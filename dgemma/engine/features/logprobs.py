"""Log-probabilities of committed tokens (`SamplingParams.logprobs`): for each row that asks, computed at the step its
canvas ends, from that step's hidden states (what they mean: sampling/logprobs.py), kept in the row's slot until
its commit takes them."""

from __future__ import annotations

from dgemma.engine.features.base import Feature, Step
from dgemma.engine.request import Commit, Request
from dgemma.sampling.logprobs import canvas_logprobs


class Logprobs(Feature):
    name = "logprobs"

    def after_step(self, s: Step) -> None:
        if not any(r.params.logprobs is not None for r in s.rows):
            return
        done_now, inv_temp = s.done_now(), s.inv_temp.tolist()
        for i, r in enumerate(s.rows):
            if r.params.logprobs is not None and done_now[i] and self.of(r) is None and not r.finished:
                self.put(r, canvas_logprobs(s.hidden[i], s.canvas.argmax[i].tolist(), s.head, inv_temp[i],
                                            r.params.logprobs))

    def commit(self, req: Request, c: Commit) -> None:
        c.logprobs = self.of(req)
        self.drop(req)
