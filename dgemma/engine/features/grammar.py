"""Grammar-constrained rows (`SamplingParams.grammar`): the row's matcher in its slot, a fresh locked prefix per
canvas, the valid-prefix rule after each step, and the greedy completion of a row whose canvas ends (the rule:
sampling/constrained.py); the token-by-token engines follow the same matcher (`Request.grammar`, `next_token`)."""

from __future__ import annotations

from torch import Tensor

from dgemma.engine.features.base import Feature, Step
from dgemma.engine.request import Event, Request
from dgemma.sampling.constrained import complete_rows, constrain_step, start_canvas
from dgemma.sampling.processing import Processor


class GrammarFeature(Feature):
    name = "grammar"

    def attach(self, req: Request, engine) -> None:
        if req.params.grammar is not None:  # what it needs: SamplingParams.check_decoding
            self.put(req, engine.grammar_vocab().matcher(req.params.grammar, req.eos))

    def start(self, rows: list[Request], tokens: Tensor, events: list[Event]) -> None:
        start_canvas([self.of(r) for r in rows], [r.budget for r in rows], tokens.shape[1])

    def start_sequence(self, req: Request) -> None:
        if (g := self.of(req)) is not None:
            g.start_canvas(req.params.max_new_tokens + 1, req.params.max_new_tokens)  # one prefix

    def step(self, s: Step) -> None:
        grammars = self._live(s)
        if any(grammars):
            s.out = constrain_step(grammars, s.out, s.hidden, s.head, s.inv_temp, [r.generator for r in s.rows],
                                   s.canvas.done, s.fail, [self._knobs(r, s.head.vocab_size) for r in s.rows])

    def after_step(self, s: Step) -> None:
        grammars = self._live(s)
        if any(grammars):
            s.canvas.mark_done(complete_rows(grammars, s.canvas.argmax, s.hidden, s.head, s.done_now(), s.fail))

    @staticmethod
    def _knobs(req: Request, vocab: int):
        """The row's sampling knobs over its prompt, output and the canvas's locked ids (the frontier's draw)."""
        return lambda locked: Processor.of(req.params, req.prompt, req.output, vocab, locked)

    def _live(self, s: Step) -> list:
        return [None if r.finished else self.of(r) for r in s.rows]
