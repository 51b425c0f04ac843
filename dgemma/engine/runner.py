"""The model runner: one decoder pass over the batch's canvas as the scheduler and the request features shaped it
(`Pass`: the positions it runs on, those it hides, those whose outputs it reuses), then the fused vocabulary step
(LM head, sampling, the self-conditioning signal) over its rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dgemma.cache import KVCache
from dgemma.engine.batch import Canvas
from dgemma.engine.request import Request
from dgemma.model import DiffusionGemma
from dgemma.sampling import StepOutput
from dgemma.sampling.fused import Reuse, fast_step
from dgemma.sampling.processing import Processor


@dataclass
class Pass:
    """One decoder pass over the batch's rows. By default it runs on every position of the canvas; features narrow
    it (`Feature.shape`)."""

    rows: list[Request]
    canvas: Canvas
    caches: list[KVCache]  # one per row
    t_start: float  # when its scheduling began: the step's measured time counts from here
    start: int = 0  # the first position it runs on (those before it are in every row's cache)
    hide: list[int] | None = None  # per row: positions from `start` on hidden from its canvas (in its cache already)
    keep: Tensor | None = None  # [B, m] the positions the body runs on, the others' keys and values reused
    skip: Tensor | None = None  # [B, C] bool: positions left out of the head work, their last outputs reused


@dataclass
class Ran:
    """What a pass gives the features and the canvas."""

    hidden: Tensor  # [B, C, H] the decoder's normed hidden states (zeros where the body did not run)
    inv_temp: Tensor  # [B] the step's 1 / temperature per row
    out: StepOutput
    signal: Tensor | None  # the next step's self-conditioning signal (None: no row takes another step)


class ModelRunner:
    def __init__(self, model: DiffusionGemma):
        self.model = model

    def run(self, p: Pass) -> Ran:
        cv, rows, model = p.canvas, p.rows, self.model
        hidden = self._body(p)
        inv_temp = 1.0 / cv.temperature()
        reuse = None if p.skip is None else Reuse(p.skip, cv.argmax, cv.tokens, cv.signal)
        out, signal = fast_step(hidden, model.lm_head, inv_temp, cv.entropy_bound, [r.generator for r in rows],
                                cv.done, want_signal=not cv.last_step(rows),
                                top_k=[r.params.soft_top_k for r in rows], reuse=reuse,
                                process=[Processor.of(r.params, r.prompt, r.output, model.cfg.text.vocab_size)
                                         for r in rows])
        return Ran(hidden, inv_temp, out, signal)

    def _body(self, p: Pass) -> Tensor:
        """The decoder pass [B, C, H]: from `start` with `hide`, or over the `keep` positions, or over the whole
        canvas; zeros where it did not run (the fused step does not read them)."""
        cv, model = p.canvas, self.model
        if p.hide is not None:
            signal = None if cv.signal is None else cv.signal[:, p.start:]
            hidden = model.denoise(cv.tokens[:, p.start:], p.caches, signal, hide=p.hide)
            return torch.nn.functional.pad(hidden, (0, 0, p.start, 0))
        if p.keep is None:
            return model.denoise(cv.tokens, p.caches, cv.signal)
        hidden = model.denoise(cv.tokens, p.caches, cv.signal, keep=p.keep)
        b, c = cv.tokens.shape
        return hidden.new_zeros(b, c, hidden.shape[-1]).scatter(1, p.keep[..., None].expand_as(hidden), hidden)
