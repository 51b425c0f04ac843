"""The first token at once (`early_first_token`). The encoder is a next-token model, and the prefill already runs
it over the prompt: its last hidden state gives the distribution of the answer's first token. A row that asks
takes its most likely token (a canvas commits its draft's argmax too, and no draw is taken from the row's generator,
so its canvases see the noise they would see without it), keeps it in its slot, and commits it when its first canvas
starts, before any denoising pass; the canvas then denoises around it, keeping it as its first position (early
commit's early-committed prefix, which this feature requires), so the text sent never changes. An end-of-sequence
choice is left to the canvas. Its cost: one LM head row per request (`first_token_rows`)."""

from __future__ import annotations

import torch
from torch import Tensor

from dgemma.engine.features.base import Counter, Feature, Step
from dgemma.engine.request import Event, Request
from dgemma.model.head import Head
from dgemma.sampling.logprobs import canvas_logprobs


class EarlyFirstToken(Feature):
    name = "early_first_token"
    requires = ("early_commit",)
    counters = (Counter("first_token_rows", "vocab_row", saves=False),)

    def wants_prefill(self, req: Request) -> bool:
        return bool(req.params.early_first_token)

    def prefilled(self, rows: list[Request], hidden: Tensor, head: Head) -> None:
        asking = [i for i, r in enumerate(rows) if r.params.early_first_token]
        if not asking:
            return
        logits = head.logits(hidden[torch.tensor(asking, device=hidden.device)])
        for k, i in enumerate(asking):
            r, t = rows[i], rows[i].params.t_min
            r.stats.add("first_token_rows", 1)
            token = int(logits[k].argmax())
            if token not in r.eos:
                logprobs = None if r.params.logprobs is None else canvas_logprobs(
                    hidden[i:i + 1], [token], head, 1 / t if t > 0 else 1.0, r.params.logprobs)
                self.put(r, (token, logprobs))

    def start(self, rows: list[Request], tokens: Tensor, events: list[Event]) -> None:
        for i, r in enumerate(rows):
            if (first := self.of(r)) is not None and not r.finished:
                self.drop(r)
                token, logprobs = first
                tokens[i, 0] = token
                self.needs["early_commit"].begin_with(r, tokens[i], [token], logprobs, events)

    def after_step(self, s: Step) -> None:
        """A row whose budget the first token filled has nothing left to denoise."""
        committed = self.needs["early_commit"].committed_early
        s.canvas.mark_done([i for i, r in enumerate(s.rows) if committed(r) and committed(r) >= r.budget
                            and not r.finished and not s.canvas.done[i]])
