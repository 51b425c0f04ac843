"""The OpenAI wire format in: the request models (strict pydantic: no string-to-number coercion, no NaN), which
check types, shapes and OpenAI's own ranges (SamplingParams checks the rest). Field descriptions end up in
/openapi.json; the response shapes are in responses.py."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo,
                      WrapValidator, create_model, field_validator)
from pydantic_core import PydanticCustomError

from dgemma.chat import tools as tool_calls
from dgemma.chat.turn import ChatTurn
from dgemma.options import OPTIONS
from dgemma.sampling import Grammar, SamplingParamsError
from dgemma.sampling.params import MAX_LOGPROBS
from dgemma.sampling.thinking import ThoughtBudget
from dgemma.server.formats import LAYOUT_FIELDS, as_layout_options, response_grammar
from dgemma.server.responses import chat_logprobs, completion_logprobs

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _valid_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise PydanticCustomError("string_unicode", "text must be valid Unicode (no lone surrogates)") from None
    return value


def _one_of(message: str) -> WrapValidator:
    """Turn a union's pile of per-member errors into one readable message (keeping text-encoding errors)."""

    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError as e:
            for err in e.errors():
                if err["type"] == "string_unicode":
                    raise PydanticCustomError("string_unicode", err["msg"]) from None
            raise PydanticCustomError("union_type", message) from None

    return WrapValidator(validate)


Text = Annotated[str, AfterValidator(_valid_text)]
Prompt = Annotated[Text | list[Text] | list[int] | list[list[int]], _one_of(
    "must be a string, a list of strings, a list of token ids, or a list of token-id lists")]
Stop = Annotated[Text | list[Text], _one_of("must be a string or a list of strings")]
Renoise = Annotated[float | list[Annotated[list[int], Field(min_length=2, max_length=2)]], _one_of(
    "must be a fraction in (0, 1] or a list of [start, end] character spans")]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="send a last chunk with usage and empty choices")


class DgemmaSampling(_Strict):
    """dgemma extension: the denoising options OpenAI has no field for (SamplingParams checks the ranges). Ours,
    so an unknown field is a mistake, not a newer OpenAI field: refused."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    max_denoising_steps: int | None = Field(None, description="most denoising steps per canvas")
    entropy_bound: float | None = Field(None, description="entropy budget of the positions one step accepts")
    t_min: float | None = Field(None, description="temperature at the last step (instead of `temperature`)")
    t_max: float | None = Field(None, description="temperature at the first step (instead of `temperature`)")

    def overrides(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


DgemmaSampling = create_model("DgemmaSampling", __base__=DgemmaSampling, **{  # the opt-in options, declared once
    o.name: (o.type | None, Field(None, description=f"opt-in (changes outputs): {o.help}; omitted: off"))
    for o in OPTIONS if o.wire is None})
_Knobs = create_model("_Knobs", __base__=_Strict, **{  # the sampling knobs, OpenAI's and vLLM's names, declared once
    o.wire: ((o.wire_type or o.type) | None, Field(None, description=f"{o.help}; omitted: off"))
    for o in OPTIONS if o.wire is not None})


class OpenAIRequest(_Knobs):
    """Fields shared by /v1/completions and /v1/chat/completions. Fields OpenAI does not define are kept aside
    (`ignored_fields`) and named in the response's X-Dgemma-Ignored-Fields header."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    model: Text | None = Field(None, description="the served model's id (GET /v1/models); may be omitted")
    max_tokens: int | None = Field(None, description="exact cap on generated tokens per choice (>= 1)")
    n: int = Field(1, ge=1, description="choices per prompt; choice i uses seed + i")
    stop: Stop | None = Field(None, description="stop string(s); the text ends before the first one")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2, description=(
        "denoising temperature schedule from T down to T/2; T < 0.001 (0 included): near-greedy, and without a "
        "seed the seed is 0; omitted: the checkpoint's schedule"))
    seed: int | None = Field(None, description="same seed, same output (0 to 2^64 - 1)")
    user: Text | None = None
    cache_salt: Text | None = Field(None, max_length=256, description=(
        "prefix-cache partition (as vLLM's): a request reuses only prompts cached with the same salt (and the same "
        "API key)"))
    dgemma_timeout: float | None = Field(None, gt=0, description=(
        "dgemma extension: seconds from arrival after which the request is aborted (408, or an error chunk when "
        "streaming) and its batch row freed; capped by the server's --request-timeout"))
    dgemma_drafts: bool = Field(False, description=(
        "dgemma extension (stream only): also send each denoising step's draft canvas per choice, as chunks "
        "with an empty delta and a `dgemma_draft` field that standard clients ignore: the canvas's `token_ids`, "
        "`text`, each position's own text (`tokens`) and whether the step accepted it (`accepted`)"))
    dgemma_sampling: DgemmaSampling | None = Field(None, description=(
        "dgemma extension: denoising steps, entropy bound, the temperature schedule, early commit and early stop; "
        "omitted fields keep the checkpoint's (GET /v1/models shows them)"))

    def renamed(self) -> dict[str, str]:
        """SamplingParams fields this request sets under another name (max_new_tokens: the one it sets now)."""
        return {"max_new_tokens": "max_tokens"}

    def unsupported(self) -> tuple[str, str] | None:
        """The first field that asks for a feature this server does not have: (param, what)."""
        return None

    def knobs(self) -> dict[str, Any]:
        """The sampling knobs set (dgemma/knobs/), as SamplingParams fields."""
        set_ = {o.name: getattr(self, o.wire) for o in OPTIONS if o.wire is not None}
        return {name: value for name, value in set_.items() if value is not None}

    def grammar(self) -> Grammar | None:
        """The grammar the output must match (chat's response_format); None: free text."""
        return None

    def layout_options(self) -> dict[str, Any]:
        """Layout options for `Model.params` (a completion's suffix, template or edit)."""
        return {}

    def logprob_count(self) -> int | None:
        """Alternatives per token for `SamplingParams.logprobs`; None: no logprobs."""
        return None

    def turn(self, tokenizer: Any = None) -> ChatTurn | None:
        """A chat's turn: its tools, template arguments and thought channel (chat/turn.py); None: not a chat."""
        return None

    def thought_budget(self) -> ThoughtBudget | None:
        """`max_thinking_tokens` as the engine follows it (chat with thinking only)."""
        return None

    def format_logprobs(self, entries: list, token_bytes: Any, offset: int) -> dict[str, Any]:
        """`entries` (token, logprob, alternatives) in this request's logprobs shape (responses.py); `offset`:
        characters of the choice's text before these tokens."""
        raise NotImplementedError

    def ignored_fields(self) -> list[str]:
        """Names of the ignored fields, as safe header text: plain names (at most 16), then "+N others"."""
        names = sorted(self.model_extra or ())
        plain = [n for n in names if _PLAIN_NAME.fullmatch(n)][:16]
        return plain + ([f"+{len(names) - len(plain)} others"] if len(names) > len(plain) else [])


class CompletionRequest(OpenAIRequest):
    prompt: Prompt = Field(description="text, several texts, token ids, or several token-id lists")
    echo: bool = False
    logprobs: int | None = Field(None, description=f"alternatives per token, 0 to {MAX_LOGPROBS}")
    best_of: int | None = Field(None, ge=1)
    suffix: Text | None = Field(None, description=(
        "infill: the text after the completion, held fixed in the canvas while the text between prompt and suffix "
        "(at most max_tokens tokens) is generated; the response holds that middle text"))
    dgemma_template: Text | None = Field(None, description="dgemma extension: the completion as a text with "
                                         "holes ([[hole]], [[hole:N]]), its fixed text frozen; returns it filled")
    dgemma_edit: Text | None = Field(None, description="dgemma extension: a draft to edit in place (with "
                                     "dgemma_renoise); returns the edited draft")
    dgemma_renoise: Renoise | None = Field(None, description="dgemma extension: the fraction in (0, 1] "
                                                      "of the draft's tokens to renoise, or [start, end] spans")

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1"
        return super().unsupported()

    def layout_options(self) -> dict[str, Any]:
        return as_layout_options({k: getattr(self, k) for k in LAYOUT_FIELDS})

    def logprob_count(self) -> int | None:
        return self.logprobs

    def format_logprobs(self, entries: list, token_bytes: Any, offset: int) -> dict[str, Any]:
        return completion_logprobs(entries, token_bytes, offset)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ImageUrl(_Strict):
    url: str = Field(description="data:image/...;base64,... (http(s) URLs only with --fetch-image-urls)")
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the soft-token budget is the server's


class ImageUrlPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


Content = Annotated[Text | list[TextPart | ImageUrlPart], _one_of(
    "must be a string or a list of text and image_url parts")]


class CalledFunction(_Strict):
    name: Text
    arguments: Text | dict[str, Any] = Field("{}", description="the arguments as JSON text (or an object)")


class ToolCall(_Strict):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant message's earlier calls")
    content: Content | None = Field(None, validate_default=True, description="null only with tool_calls")
    name: Text | None = None
    tool_call_id: Text | None = Field(None, validate_default=True, description="a tool message: the call it answers")
    reasoning_content: Text | None = Field(None, description="an assistant message's thought (the template decides "
                                           "whether to show it again)")
    reasoning: Text | None = Field(None, description="the newer name of reasoning_content")

    @field_validator("content", "tool_call_id")
    @classmethod
    def _needed(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and (why := tool_calls.missing(info.field_name, info.data)):
            raise PydanticCustomError("missing", why)
        return value

    @field_validator("content")
    @classmethod
    def _images_from_users(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, list) and info.data.get("role") != "user" and any(
                isinstance(p, ImageUrlPart) for p in value):
            raise PydanticCustomError("image_role", "image_url parts go in user messages")
        return value

    def thought(self) -> str | None:
        return self.reasoning_content or self.reasoning

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content if isinstance(p, TextPart))

    def template_content(self) -> str | list[dict[str, Any]]:
        """The text, or with images the parts as `Model.encode_prompt` takes them."""
        if isinstance(self.content, list) and any(isinstance(p, ImageUrlPart) for p in self.content):
            return [p.model_dump(exclude_none=True) for p in self.content]
        return self.text()


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, description="preferred over max_tokens when both are set")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, description=f"alternatives per token, 0 to {MAX_LOGPROBS}")
    tools: list[dict[str, Any]] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(None, description="several calls in one reply (default true)")
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='the chat template\'s own arguments (vLLM\'s field), e.g. {"enable_thinking": true}')
    max_thinking_tokens: int | None = Field(None, description="thinking on: the thought closes within this many "
                                            "tokens and the answer follows in the same canvas")
    include_reasoning: bool = Field(True, description="return the thought as reasoning_content (false: drop it)")
    # defined by OpenAI, not done here: refused when they ask for something
    functions: list[dict[str, Any]] | None = None
    function_call: Text | dict[str, Any] | None = None
    modalities: list[Text] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: Text | None = None
    web_search_options: dict[str, Any] | None = None

    _turn: ChatTurn | None = PrivateAttr(None)

    def unsupported(self) -> tuple[str, str] | None:
        return self._unsupported_extras() or super().unsupported()

    def renamed(self) -> dict[str, str]:
        tokens = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        return {"max_new_tokens": tokens} | ({"logprobs": "top_logprobs"} if self.top_logprobs is not None else {})

    def turn(self, tokenizer: Any = None, defaults: dict[str, Any] | None = None) -> ChatTurn:
        """The request's tool calls and template arguments (laid over the server's `defaults`), checked on the first
        call (SamplingParamsError naming the field); `tokenizer` picks the checkpoint's own call syntax and thought
        channel."""
        if self._turn is None:
            tools = tool_calls.ToolUse.of(self.tools or [], self.tool_choice, self.parallel_tool_calls,
                                          self.response_format, self.logprobs, tokenizer)
            self._turn = ChatTurn.of(tools, with_defaults(self.chat_template_kwargs, defaults), tokenizer)
            self._turn.budget(self.max_thinking_tokens)  # refused without thinking: a 400 before model work
        return self._turn

    def thought_budget(self) -> ThoughtBudget | None:
        return self.turn().budget(self.max_thinking_tokens)

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def format_logprobs(self, entries: list, token_bytes: Any, offset: int) -> dict[str, Any]:
        return chat_logprobs(entries, token_bytes)

    def grammar(self) -> Grammar | None:
        """The tools' grammar when they may be called, else response_format's (formats.response_grammar); after
        the thought when thinking."""
        return self.turn().grammar(response_grammar(self.response_format), self.max_thinking_tokens)

    def _unsupported_extras(self) -> tuple[str, str] | None:
        asks = {
            "functions": bool(self.functions), "function_call": self.function_call not in (None, "none", "auto"),
            "modalities": self.modalities not in (None, ["text"]), "audio": self.audio is not None,
            "prediction": self.prediction is not None, "reasoning_effort": self.reasoning_effort is not None,
            "web_search_options": self.web_search_options is not None,
        }
        return next(((name, name.replace("_", " ")) for name, asked in asks.items() if asked), None)

    def chat(self) -> list[dict[str, Any]]:
        """The messages as `Model.encode_prompt` takes them (rendered there by `turn()`)."""
        return chat_messages(self.messages)


def with_defaults(kwargs: Any, defaults: dict[str, Any] | None) -> Any:
    """A request's chat_template_kwargs over the server's --default-chat-template-kwargs (a non-object is left for
    the check to refuse)."""
    return {**(defaults or {}), **(kwargs or {})} if isinstance(kwargs, dict) or kwargs is None else kwargs


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as `Model.encode_prompt` takes them (the chat routes' and /tokenize's)."""
    return [{"role": m.role, "content": m.template_content(), "tool_calls": [c.model_dump() for c in
             m.tool_calls or ()] or None, "tool_call_id": m.tool_call_id}
            | ({"reasoning_content": m.thought()} if m.thought() else {}) for m in messages]


class TokenizeRequest(_Strict):
    """vLLM's POST /tokenize: a `prompt` (as /v1/completions encodes it) or chat `messages` (as
    /v1/chat/completions renders them, `tools` included): routers ask it for the ids they route on, clients to
    count tokens. Fields vLLM has and dgemma does not use (mm_processor_kwargs) are ignored."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    model: Text | None = Field(None, description="the served model's id; may be omitted")
    prompt: Text | None = Field(None, description="a text, encoded as /v1/completions encodes it")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description=(
        "chat messages, rendered as /v1/chat/completions renders them"))
    tools: list[dict[str, Any]] | None = Field(None, description="the chat's tools, rendered into its prompt")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="the chat template's own arguments, as "
                                                        "/v1/chat/completions takes them")
    add_special_tokens: bool | None = Field(None, description=(
        "a prompt: start with the BOS token (default true); chat messages: the template's own tokens only"))
    add_generation_prompt: bool = Field(True, description="end the chat with the assistant's turn opening")
    continue_final_message: bool = Field(False, description="not supported: must be false")
    return_token_strs: bool = Field(False, description="also return each token's vocabulary entry")

    def input(self) -> tuple[str, Any]:
        """(the field given, its value): exactly one of prompt and messages; chat options it cannot honour refused."""
        if (self.prompt is None) == (self.messages is None):
            raise SamplingParamsError("give one of prompt and messages", "prompt" if self.messages is None else
                                      "messages")
        if self.prompt is not None:
            return "prompt", self.prompt
        for name, value, wanted in (("add_generation_prompt", self.add_generation_prompt, True),
                                    ("continue_final_message", self.continue_final_message, False)):
            if value != wanted:
                raise SamplingParamsError(f"{name}={str(value).lower()} is not supported (the chat routes always "
                                          "open the assistant's turn)", name)
        if any(isinstance(m.content, list) and any(isinstance(p, ImageUrlPart) for p in m.content)
               for m in self.messages):
            raise SamplingParamsError("image parts are not tokenized here; a chat completion's usage counts an "
                                      "image's tokens", "messages")
        return "messages", chat_messages(self.messages)


class DetokenizeRequest(_Strict):
    """vLLM's POST /detokenize: token ids -> their text (special tokens spelled out)."""

    model: Text | None = Field(None, description="the served model's id; may be omitted")
    tokens: list[int] = Field(description="token ids of this model's vocabulary")
