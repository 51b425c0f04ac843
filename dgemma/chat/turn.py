"""One chat request as its template renders it and its reply is read: the tools that may be called (`ToolUse`), the
template's own arguments (`chat_template_kwargs`, vLLM's field: Gemma 4's `enable_thinking`) and the checkpoint's
thought channel. With thinking on, a constraint on the reply (a schema, tool calls) holds for the answer after the
thought, and `max_thinking_tokens` bounds the thought."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dgemma.chat.thinking import THINKING, Channel
from dgemma.chat.tools import ToolUse
from dgemma.sampling import Grammar, SamplingParamsError
from dgemma.sampling.thinking import ThoughtBudget

RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")  # the renderer's own arguments
MAX_KWARGS = 64


@dataclass
class ChatTurn:
    tools: ToolUse
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    channel: Channel | None = None  # the checkpoint's thought channel (None: it has none)

    @classmethod
    def of(cls, tools: ToolUse, template_kwargs: dict[str, Any] | None, tokenizer: Any,
           think: bool | None = None) -> ChatTurn:
        """`template_kwargs` checked (SamplingParamsError naming `chat_template_kwargs`); `think` (the Python API's
        and the CLI's switch) sets `enable_thinking`, and needs a checkpoint with a thought channel."""
        kwargs, channel = check_template_kwargs(template_kwargs or {}, tokenizer), Channel.of(tokenizer)
        if think is not None:
            if think and channel is None:
                raise SamplingParamsError("this checkpoint's chat template has no thinking mode (no thought channel)",
                                          "think")
            kwargs[THINKING] = bool(think)
        return cls(tools, kwargs, channel)

    @property
    def thinking(self) -> bool:
        """The template was asked to think and the checkpoint has a thought channel."""
        return self.channel is not None and bool(self.template_kwargs.get(THINKING))

    def grammar(self, answer: Grammar | None, max_thinking_tokens: int | None = None) -> Grammar | None:
        """What the reply must match: the tool calls' grammar, else `answer`; after the thought (of at most
        `max_thinking_tokens` tokens) when thinking."""
        g = self.tools.grammar() if self.tools.mode != "none" else answer
        if g is None or not self.thinking:
            return g
        return g.after_thought(self.channel.open, self.channel.close, max_thinking_tokens)

    def budget(self, max_thinking_tokens: int | None) -> ThoughtBudget | None:
        if max_thinking_tokens is None:
            return None
        if not self.thinking:
            raise SamplingParamsError("max_thinking_tokens needs a chat with thinking on (chat_template_kwargs "
                                      f'{{"{THINKING}": true}}, --think) and a checkpoint with a thought channel',
                                      "max_thinking_tokens")
        return ThoughtBudget(self.channel.open, self.channel.close, max_thinking_tokens)


def check_template_kwargs(kwargs: Any, tokenizer: Any) -> dict[str, Any]:
    """Template arguments a client may pass: names the renderer does not set itself, scalar values, strings that
    spell no control token (the template may write them where only it writes control tokens)."""
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_KWARGS:
        raise SamplingParamsError(f"chat_template_kwargs must be an object of at most {MAX_KWARGS} entries",
                                  "chat_template_kwargs")
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier() or key in RESERVED:
            raise SamplingParamsError(f"chat_template_kwargs: {key!r} is not an argument a request may set",
                                      "chat_template_kwargs")
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise SamplingParamsError(f"chat_template_kwargs.{key} must be a boolean, number, string or null",
                                      "chat_template_kwargs")
        if isinstance(value, str) and tokenizer is not None and tokenizer.forges(value):
            raise SamplingParamsError(f"chat_template_kwargs.{key} spells a control token", "chat_template_kwargs")
    return dict(kwargs)
