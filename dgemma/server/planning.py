"""OpenAI request -> engine work: the request-level checks, each choice of a prompt as a `Plan` (ids and
SamplingParams, validated by `Model.check_request`; the temperature rule is sampling/temperature.py's), and the
client's own field names in the errors SamplingParams raises."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from dgemma.api import Model
from dgemma.sampling import MAX_SEED, SamplingParams, SamplingParamsError
from dgemma.sampling.temperature import GREEDY_T, is_greedy, temperature_fields
from dgemma.server.config import ServerConfig
from dgemma.server.errors import ApiError, bad_request, unsupported
from dgemma.server.formats import LAYOUT_PARAMS
from dgemma.server.protocol import CompletionRequest, OpenAIRequest


@dataclass
class Plan:
    """One engine request: a choice of a prompt."""

    ids: list[int]
    params: SamplingParams


def check(body: OpenAIRequest, config: ServerConfig, prompts: int) -> None:
    """The checks that need neither the model nor a prompt's ids (before admission: cheap)."""
    if (feature := body.unsupported()) is not None:
        raise unsupported(*feature)
    for name in ("stream_options", "dgemma_drafts"):
        if getattr(body, name) and not body.stream:
            raise bad_request(f"{name} needs stream=true", name)
    if config.mode != "diffusion" and body.dgemma_drafts:
        raise unsupported("dgemma_drafts", f"dgemma_drafts in {config.mode} mode (--mode {config.mode})")
    if body.temperature is not None and {"t_min", "t_max"} & overrides(body).keys():
        raise bad_request("temperature and dgemma_sampling.t_min / t_max both set the schedule; send one",
                          "dgemma_sampling")
    choices = body.n * prompts
    if choices > config.max_n:
        raise bad_request(f"n x prompts = {choices} choices; this server allows at most {config.max_n} "
                          "per request", "n")


def prompts(body: CompletionRequest) -> list[Any]:
    """A completion request's prompts: a text or an id list is one prompt ([] too: refused as empty with the
    others)."""
    prompt = body.prompt
    return [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else list(prompt)


def prepare(model: Model, config: ServerConfig, body: OpenAIRequest, prompt: Any, limit: int,
            partition: str | None) -> tuple[list[int], list[SamplingParams]]:
    """A prompt's ids and its choices' SamplingParams (in a worker thread: it tokenizes, compiles a grammar and
    builds a layout)."""
    ids = model.encode_prompt(prompt, limit, body.turn(), partition)
    return ids, choice_params(model, config, body, ids, partition)


def choice_params(model: Model, config: ServerConfig, body: OpenAIRequest, ids: list[int],
                  partition: str | None) -> list[SamplingParams]:
    """The n choices of a prompt: choice i has seed + i. The starting canvas and the renoising are random
    even when sampling is near-greedy, so temperature 0 without a seed uses seed 0 (reproducible)."""
    new = getattr(body, body.renamed()["max_new_tokens"])
    room = max(1, model.max_context - len(ids))
    new = min(model.defaults.max_new_tokens, room, config.max_tokens or room) if new is None else new
    base = 0 if body.seed is None and is_greedy(body.temperature) else body.seed
    sampling = temperature_fields(body.temperature, config.mode)
    first = model.params(config.mode, max_new_tokens=new, seed=base, stop=body.stop, grammar=body.grammar(),
                         logprobs=body.logprob_count(), **sampling, **overrides(body), **body.knobs(),
                         cache_salt=partition, thought_budget=body.thought_budget(),
                         layout_limit=min(room, config.max_tokens or room),
                         **body.layout_options())
    model.check_request(ids, first, config.limits, config.mode)
    if base is None:
        return [first] * body.n
    return [first] + [first.replace(seed=(base + i) % (MAX_SEED + 1)) for i in range(1, body.n)]


def client_error(e: SamplingParamsError, body: OpenAIRequest, param: str) -> ApiError:
    """A 400 naming the field as the client named it (`param`: the prompt's field, prompt or messages)."""
    renamed = body.renamed()
    names = {"prompt": param, "t_max": "temperature", "ar_temperature": "temperature"} | renamed
    names |= {k: f"dgemma_sampling.{k}" for k in overrides(body)} | LAYOUT_PARAMS
    message = re.sub(rf"\b{e.param}\b", renamed[e.param], str(e)) if e.param in renamed else str(e)
    return bad_request(message, names.get(e.param, e.param))


def overrides(body: OpenAIRequest) -> dict[str, Any]:
    """The dgemma_sampling fields set; temperatures in [0, GREEDY_T / 2) count as GREEDY_T / 2, the floor
    `schedule` gives `temperature` (sampling is greedy there; 1 / T stays finite). Negative ones stay refused."""
    out, floor = body.dgemma_sampling.overrides() if body.dgemma_sampling is not None else {}, GREEDY_T / 2
    return out | {k: floor for k, v in out.items() if k in ("t_min", "t_max") and 0 <= v < floor}


def partition(key: int | None, salt: str | None) -> str | None:
    """The prefix-cache partition of a request: its API key's position and its cache_salt (None: the shared one,
    for a server without keys and a request without a salt)."""
    return None if key is None and salt is None else json.dumps([key, salt])
