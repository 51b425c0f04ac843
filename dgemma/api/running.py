"""Running prompts for the Python API: the engine of a decoding mode, and the loop that submits a batch of prompts
and turns the engine's events into drafts, text deltas and Results (through `OutputStream`, as the server does)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dgemma.api.prompts import Prompt, is_chat
from dgemma.chat.turn import ChatTurn
from dgemma.engine import (AutoregressiveEngine, Engine, OutputStream, PrefixCache, ReferenceEngine, Result,
                           SpeculativeEngine, StreamEvent)
from dgemma.options import MODES, SAMPLINGS
from dgemma.sampling import SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    from dgemma.api import Model


CHAT_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "think")


def engine_for(model: Model, mode: str, sampling: str, max_batch: int, prefix_cache: PrefixCache | None):
    """`Model.runner`: the engine of `mode` and `sampling` for `model`'s module."""
    eos = model.defaults.eos_token_ids or ()
    if mode not in MODES or sampling not in SAMPLINGS:
        bad, name, names = (("mode", mode, MODES) if mode not in MODES else ("sampling", sampling, SAMPLINGS))
        raise SamplingParamsError(f"{bad}={name!r} must be one of {', '.join(names)}", bad)
    if mode == "autoregressive":
        engine = AutoregressiveEngine(model.module, eos, max_batch, prefix_cache)
    elif mode == "speculative":
        engine = SpeculativeEngine(model.module, eos, max_batch, prefix_cache, model.speculative_pacing)
    elif sampling == "reference":
        engine = ReferenceEngine(model.module, eos, model.pad_id)
    else:
        engine = Engine(model.module, eos, model.pad_id, max_batch, prefix_cache)
    if model.tokenizer is not None:
        engine.grammar_vocab = model.grammar_vocab
    return engine


def results(model: Model, prompt: Prompt | list[Prompt], mode: str, sampling: str,
            options: dict[str, Any]) -> Result | list[Result]:
    """`Model.generate`: one prompt's Result, or a list of prompts' Results (decoded as one batch), in order."""
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if batch else [prompt]
    done = {i: ev.result for i, ev in run(model, prompts, mode, sampling, options, False) if ev.kind == "done"}
    ordered = [done[i] for i in range(len(prompts))]
    return ordered if batch else ordered[0]


def run(model: Model, prompts: list[Prompt], mode: str, sampling: str, options: dict[str, Any],
        drafts: bool) -> Iterator[tuple[int, StreamEvent]]:
    """(prompt index, StreamEvent) for each prompt, decoded as one batch with `options` (SamplingParams fields,
    layout options and chat's tools)."""
    ids, params, turn = _prepare(model, prompts, mode, sampling, options)
    engine = model.runner(mode, sampling, max(1, len(ids)), model.prefix_cache)  # through Model: it may be wrapped
    reqs = {}
    for i, x in enumerate(ids):
        req = engine.add_request(x, params, drafts=drafts)
        reqs[req.id] = (i, req, OutputStream(model.tokenizer, params.stop, turn if is_chat(prompts[i]) else None))
    for ev in engine.stream():
        i, req, out = reqs[ev.request_id]
        for item in out.feed(ev):
            if item.kind == "done":
                engine.abort(req.id)  # a stop string ends the request before the engine knows
                req.stats.t_end = req.stats.t_end or time.perf_counter()
                item.result = out.result(len(req.prompt), params.logprobs is not None, req.stats)
            yield i, item


def _prepare(model: Model, prompts: list[Prompt], mode: str, sampling: str,
             options: dict[str, Any]) -> tuple[list[list[int]], SamplingParams, ChatTurn]:
    """The prompts' ids, their SamplingParams (tools that may be called set the grammar, thinking moves it after
    the thought) and the chat's turn, all checked (`Model.check_request`)."""
    chat = {k: options.pop(k, None) for k in CHAT_OPTIONS}
    budget = options.pop("max_thinking_tokens", None)
    turn = model.prompts.turn(chat["tools"], chat["tool_choice"], chat["parallel_tool_calls"], options.get("grammar"),
                              options.get("logprobs") is not None, chat["chat_template_kwargs"], chat["think"])
    asked = [k for k, v in chat.items() if v is not None] + ["max_thinking_tokens"] * (budget is not None)
    if asked and not all(is_chat(p) for p in prompts):
        raise SamplingParamsError(f"{asked[0]} needs a prompt of chat messages", asked[0])
    options["grammar"] = turn.grammar(options.get("grammar"), budget)
    params = model.params(mode, sampling, **options, thought_budget=turn.budget(budget))
    ids = [model.encode_prompt(p, tools=turn) for p in prompts]
    for x in ids:
        model.check_request(x, params, mode=mode, sampling=sampling)
    return ids, params, turn
