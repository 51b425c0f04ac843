"""What every engine shares: making a request (the request's EOS ids, else the model's; a generator on the
model's device) and driving `step()` to the end."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from dgemma.engine.request import Event, Request
from dgemma.model import DiffusionGemma
from dgemma.sampling import SamplingParams, SamplingParamsError, make_generator
from dgemma.sampling.constraints import GrammarVocab
from dgemma.sampling.seeded import SeedState

_ids = itertools.count()


class Runner:
    constrains = False  # follows request grammars
    seeds = False  # follows seeded layouts (suffix, template, edit)

    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...]):
        self.model = model
        self.eos_ids = tuple(eos_ids)
        self.waiting: list[Request] = []
        self.grammar_vocab: Callable[[], GrammarVocab] | None = None  # set by whoever knows the tokenizer

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    drafts: bool = False) -> Request:
        """Queue a request; it starts at the engine's next opportunity."""
        req = self.make_request(prompt, params, request_id, drafts)
        self.waiting.append(req)
        return req

    def make_request(self, prompt: list[int], params: SamplingParams, request_id: str | None, drafts: bool,
                     seeded: bool = True) -> Request:
        """`seeded=False`: no generator of its own (the reference draws from the global RNG)."""
        eos = params.eos_token_ids if params.eos_token_ids is not None else self.eos_ids
        generator = make_generator(params.seed, self.model.device) if seeded else None
        req = Request(request_id or f"req-{next(_ids)}", list(prompt), params, tuple(eos), drafts, generator)
        if params.grammar is not None:
            if not self.constrains or self.grammar_vocab is None:
                raise SamplingParamsError("constrained output needs a tokenizer and fast diffusion or "
                                          "autoregressive decoding", params.grammar.param)
            req.grammar = self.grammar_vocab().matcher(params.grammar, req.eos)
        if params.seeded is not None:
            if not self.seeds or not req.eos:
                raise SamplingParamsError("a suffix, template or edit needs fast diffusion decoding and an "
                                          "end-of-sequence token", params.seeded.param)
            req.seeded = SeedState(params.seeded, req.eos)
        return req

    def held(self) -> list[Request]:
        """The requests this engine holds (waiting or running)."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Finish a request now (client gone, stop string seen); the engine drops it at its next step."""
        for req in self.held():
            if req.id == request_id and not req.finished:
                req.finish("abort")
        self.waiting = [r for r in self.waiting if r.id != request_id]

    def step(self) -> list[Event]:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def stream(self) -> Iterator[Event]:
        while self.has_work():
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
        """Decode these prompts to the end; returns their finished requests."""
        reqs = [self.add_request(p, params) for p in prompts]
        for _ in self.stream():
            pass
        return reqs
