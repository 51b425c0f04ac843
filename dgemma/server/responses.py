"""The OpenAI wire format out: the response, chunk, model-card and error shapes (pydantic models for /openapi.json
and tests), `Shapes`, which builds them, and the two logprobs shapes (completions' and chat's)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from dgemma.chat.tools import assistant_message
from dgemma.options import OPTIONS

FinishReason = Literal["stop", "length", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = Field(None, description="the thought, with thinking on (vLLM's field)")
    reasoning: str | None = Field(None, description="the same, under vLLM's newer name")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class SamplingDefaults(BaseModel):
    """What a request gets when it leaves a field out (dgemma extension of the model card)."""

    max_tokens: int
    max_denoising_steps: int
    entropy_bound: float
    t_min: float
    t_max: float
    canvas_length: int


class KnobCard(BaseModel):
    """A sampling knob a request may set (dgemma/knobs/): its request field, value type and what it does."""

    name: str
    type: Literal["int", "float", "map"]
    help: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None
    dgemma_defaults: SamplingDefaults | None = None
    dgemma_knobs: list[KnobCard] = Field(default_factory=list, description="the sampling knobs, in the order they run")


def knob_cards() -> list[dict[str, str]]:
    """The sampling knobs as the model card lists them (the playground makes its inputs from these)."""
    kinds = {int: "int", float: "float", dict: "map"}
    return [{"name": o.wire, "type": kinds[o.type], "help": o.help} for o in OPTIONS if o.wire is not None]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class RenderedRequest(BaseModel):
    """vLLM's token-in GenerateRequest (what its /render routes answer)."""

    request_id: str
    token_ids: list[int]
    features: None = None
    sampling_params: dict[str, Any]
    model: str
    stream: bool
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0


class DetokenizeResponse(BaseModel):
    prompt: str


class Load(BaseModel):
    load: int
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int


class ServerInfo(BaseModel):
    model_path: str
    served_model_name: str
    tp_size: int
    dp_size: int
    version: str
    max_concurrency: int
    context_length: int | None


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str | None
    is_generation: bool
    model_type: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


# ---- builders ----------------------------------------------------------------------------------------------
class Shapes:
    """Builds one response's objects, whole (`response`, `answer`) or streamed (`choice`, `usage`): one id,
    `created` and model for all of them, and one choice shape for both (the models above document them)."""

    def __init__(self, chat: bool, id: str, created: int, model: str, include_usage: bool = False):
        self.chat, self.include_usage = chat, include_usage
        self.id, self.created, self.model = id, created, model

    def response(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        return self._head("chat.completion" if self.chat else "text_completion", choices) | {"usage": usage}

    def answer(self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None,
               message: dict[str, Any] | None = None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        """A choice: a completion's `text`, or chat's `message` (a whole response) or `delta` (a chunk)."""
        body = {"delta": delta} if delta is not None else {"message": message} if self.chat else {"text": text}
        return {"index": index} | body | {"logprobs": logprobs, "finish_reason": finish_reason}

    def choice(self, index: int, text: str | None = None, finish_reason: str | None = None, role: bool = False,
               call: tuple[int, dict[str, Any]] | None = None, logprobs: dict[str, Any] | None = None,
               reasoning: str | None = None, **extra: Any) -> dict[str, Any]:
        """A chunk of one choice. `call`: (its index in the reply, an OpenAI tool call), sent whole as one delta;
        `reasoning`: new thought text (chat)."""
        delta = None
        if self.chat:
            if role:
                delta = {"role": "assistant", "content": ""}
            else:
                delta = {"content": text} if text or (text is not None and not reasoning) else {}
            delta |= thought(reasoning)
            if call is not None:
                delta = {"tool_calls": [{"index": call[0]} | call[1]]}
        return self._chunk([self.answer(index, text or "", logprobs, finish_reason, delta=delta) | extra])

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        return self._chunk([]) | {"usage": usage}

    def _head(self, object: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = self._head("chat.completion.chunk" if self.chat else "text_completion", choices)
        if self.include_usage:
            chunk["usage"] = None
        return chunk


def message(text: str | None, calls: list[dict[str, Any]] | None, reasoning: str | None) -> dict[str, Any]:
    """A whole reply's assistant message: its calls or its text, and its thought (the content is null when a
    thought has no answer after it, as vLLM's reasoning parsers give it; an empty thought is no thought)."""
    body = assistant_message(text if text or not reasoning else None, calls)
    return body | thought(reasoning)


def thought(reasoning: str | None) -> dict[str, str]:
    """The thought's fields, under both of vLLM's names (`reasoning_content`, and the newer `reasoning`)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}


# ---- logprobs ----------------------------------------------------------------------------------------------
def completion_logprobs(entries: list, token_bytes: Any, offset: int) -> dict[str, Any]:
    """The legacy completions shape; `offset`: characters of this choice's text before these tokens."""
    tokens = [_text(token_bytes(t)) for t, _, _ in entries]
    offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "text_offset": offsets,
            "top_logprobs": [_best_first({_text(token_bytes(a)): v for a, v in reversed(alts)})
                             for _, _, alts in entries]}


def chat_logprobs(entries: list, token_bytes: Any) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def item(t: int, lp: float) -> dict[str, Any]:
        raw = token_bytes(t)
        return {"token": _text(raw), "logprob": lp, "bytes": list(raw)}

    return {"content": [item(t, lp) | {"top_logprobs": [item(a, v) for a, v in alts]} for t, lp, alts in entries]}


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _best_first(top: dict[str, float]) -> dict[str, float]:
    """Alternatives by text, best first; tokens with the same text (pieces of characters) keep the best value
    (the dict was built worst first, so the best overwrote the rest)."""
    return dict(sorted(top.items(), key=lambda kv: -kv[1]))
