"""The engines' base class, `EngineBase` (Engine, AutoregressiveEngine, SpeculativeEngine, ReferenceEngine): making a
request (its EOS ids, else the model's; a generator on the model's device; each feature's counters from 0 and its
state, `Feature.attach`), aborting one, and driving `step()` to the end."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from dgemma.engine.features import FEATURES, Feature, bind, counters
from dgemma.engine.request import Event, Request, Stats
from dgemma.model import DiffusionGemma
from dgemma.sampling import SamplingParams, make_generator
from dgemma.sampling.constraints import GrammarVocab

_ids = itertools.count()


class EngineBase:
    mode, sampling = "diffusion", "fast"  # what a request may ask of it: SamplingParams.check_decoding

    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...], features: tuple[Feature, ...] = FEATURES):
        self.model, self.features = model, bind(features)
        self.counters = tuple(k.name for k in counters(features))
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
                     own_generator: bool = True) -> Request:
        """`own_generator=False`: the reference draws from the global RNG."""
        eos = tuple(params.eos_token_ids if params.eos_token_ids is not None else self.eos_ids)
        params.check_decoding(self.mode, self.sampling, eos, self.grammar_vocab is not None)
        generator = make_generator(params.seed, self.model.device) if own_generator else None
        self.model.soft_tokens.check(prompt)  # an image's features held by the prompt, or still cached
        req = Request(request_id or f"req-{next(_ids)}", list(prompt), params, eos, drafts, generator,
                      stats=Stats(counts=dict.fromkeys(self.counters, 0)), image_features=getattr(prompt, "held", ()))
        for f in self.features:
            f.attach(req, self)
        return req

    def requests(self) -> list[Request]:
        """The requests this engine holds (waiting or running)."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Finish a request now (client gone, stop string seen); the engine drops it at its next step."""
        for req in self.requests():
            if req.id == request_id and not req.finished:
                req.finish("abort")
        self.waiting = [r for r in self.waiting if r.id != request_id]

    def step(self) -> list[Event]:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def tidy(self) -> bool:
        """A piece (about a step's worth) of the work that waits until there is nothing else to do; True while
        some is left. The server calls it once idle, a piece at a time, and serves a request that comes between
        two pieces first."""
        return False

    def stream(self) -> Iterator[Event]:
        while self.has_work():
            yield from self.step()
        while self.tidy():
            pass

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
        """Decode these prompts to the end; returns their finished requests."""
        reqs = [self.add_request(p, params) for p in prompts]
        for _ in self.stream():
            pass
        return reqs
