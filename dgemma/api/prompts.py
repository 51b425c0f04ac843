"""Prompts and layout canvases as ids: text, chat messages (with tools) and images -> checked ids; the length
checks that refuse a text too long for its limit before it is tokenized; the layouts (`suffix`,
`template`, `edit` with `renoise`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from dgemma import images
from dgemma.chat.tools import ToolUse
from dgemma.chat.turn import ChatTurn
from dgemma.errors import DgemmaError
from dgemma.image_limits import ImageLimits
from dgemma.sampling import Limits, SamplingParamsError
from dgemma.sampling.params import check_length
from dgemma.sampling.layout import Layout, edit_parts, parse_template, renoised_positions
from dgemma.tokenizer import Tokenizer

Prompt = str | list[int] | list[dict[str, Any]]
CHAR_MARGIN = 2  # a token can cover more characters than its own text after normalisation (NFKC): stay safe


class PromptEncoder:
    """A checkpoint's prompts and layout texts as ids: within its vocabulary (`module.cfg`), its context
    (`max_context`) and its tokenizer (None: ids only)."""

    def __init__(self, module, tokenizer: Tokenizer | None, max_context: int):
        self.module, self.tokenizer, self.max_context = module, tokenizer, max_context

    def encode(self, prompt: Prompt, max_tokens: int | None, chat: ChatTurn | list[dict[str, Any]] | None,
               partition: str | None, image_limits: ImageLimits) -> list[int]:
        """`Model.encode_prompt`, with the caller's caps on image inputs."""
        if isinstance(prompt, (str, list)) and not prompt:
            self.check_ids([])  # refused there: an empty text would still tokenize to a BOS
        if is_chat(prompt):
            turn = chat if isinstance(chat, ChatTurn) else self.turn(chat)
            prompt = turn.tools.messages(list(prompt))
        else:
            turn = None
        if max_tokens is not None:
            self.check_length(prompt, max_tokens)
        if isinstance(prompt, str):
            ids = self.require_tokenizer().encode(prompt)
        elif images.has_parts(prompt):  # checks its text ids itself: image soft tokens lie past the vocabulary
            return images.prompt_ids(self, prompt, turn.tools.declared, image_limits, partition, turn.template_kwargs)
        elif turn is not None:
            ids = self.require_tokenizer().encode_chat(prompt, turn.tools.declared, turn.template_kwargs)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise SamplingParamsError("a prompt is text, a list of chat messages, or a list of token ids", "prompt")
        return self.check_ids(ids)

    def turn(self, tools: list[dict[str, Any]] | None = None, tool_choice: Any = None, parallel: bool | None = None,
             constraint: Any = None, logprobs: bool = False, template_kwargs: dict[str, Any] | None = None,
             think: bool | None = None, constraint_param: str = "grammar") -> ChatTurn:
        """A chat request's turn (its tools, template arguments and thought channel), checked."""
        tool_use = ToolUse.of(tools, tool_choice, parallel, constraint, logprobs, self.tokenizer, constraint_param)
        return ChatTurn.of(tool_use, template_kwargs, self.tokenizer, think)

    def prompt_limit(self, limits: Limits = Limits()) -> int:
        """The most tokens a prompt may have: the context less one new token, and the deployment's cap."""
        return min(self.max_context - 1, limits.max_prompt_tokens or self.max_context)

    def check_length(self, prompt: Prompt, max_tokens: int | None = None, param: str = "prompt") -> None:
        """A prompt, or a layout canvas's text (suffix, template, draft), that cannot fit in `max_tokens` (default:
        the context) is refused untokenized."""
        max_tokens = max_tokens or self.max_context
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return check_length(param, len(prompt), max_tokens)
        per_token = self.tokenizer.max_token_chars if self.tokenizer is not None else 1
        check_length(param, _chars(prompt), max_tokens, "characters", max_tokens * per_token * CHAR_MARGIN)

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.module.cfg.text.vocab_size
        if not ids:
            raise SamplingParamsError("empty prompt", "prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise SamplingParamsError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
        if self.module.cfg.image_token_id in ids:
            raise SamplingParamsError(f"the prompt's ids contain the image token ({self.module.cfg.image_token_id}): "
                                      "send images as image parts of chat messages", "prompt")
        return ids

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise DgemmaError("this checkpoint has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer

    # ---- layout canvases ------------------------------------------------------------------------------------
    def layout(self, limit: int, hole: int, seed: int | None, suffix: str | None = None, template: str | None = None,
               edit: str | list[int] | None = None, renoise: float | list[tuple[int, int]] | None = None) -> Layout:
        """The layout canvas of one of `suffix` (its hole: `hole` tokens), `template` or `edit` with `renoise`
        (a fraction chosen by `seed`, or spans); `limit`: the most tokens a template or edit may have."""
        given = [k for k, v in (("suffix", suffix), ("template", template), ("edit", edit)) if v is not None]
        if len(given) != 1 or (renoise is None) != (edit is None):
            raise SamplingParamsError("give one of suffix, template, or edit with renoise", (given or ["edit"])[-1])
        if suffix is not None:
            return Layout.from_parts([hole, self._text_ids(suffix, "suffix")], echo=False, param="suffix")
        if template is not None:
            self.check_length(template, limit, "template")
            parts = parse_template(template, limit)
            return Layout.from_parts([p if isinstance(p, int) else self._text_ids(p, "template") for p in parts],
                                     limit=limit)
        ids, offsets = (edit, [(i, i + 1) for i in range(len(edit))]) if isinstance(edit, list) else \
            self._text_offsets(edit, limit)
        if isinstance(renoise, (int, float)):
            if not 0 < renoise <= 1:
                raise SamplingParamsError(f"renoise={renoise} must be a fraction in (0, 1]", "renoise")
            rng = random.Random(seed or 0)
            chosen = set(rng.sample(range(len(ids)), max(1, round(renoise * len(ids)))))
        else:
            chosen = renoised_positions(offsets, renoise)
        return Layout.from_parts(edit_parts(self.check_ids(list(ids)), chosen), param="edit", limit=limit)

    def _text_ids(self, text: str, param: str) -> list[int]:
        if not isinstance(text, str) or not text:
            raise SamplingParamsError(f"{param} must be a non-empty string", param)
        self.check_length(text, None, param)
        return self.require_tokenizer().encode_text(text).ids  # a control token's spelling stays text

    def _text_offsets(self, text: str, limit: int) -> tuple[list[int], list[tuple[int, int]]]:
        self.check_length(text, limit, "edit")
        enc = self.require_tokenizer().encode_text(text)  # GIL released; a control token's spelling stays text
        return enc.ids, enc.offsets


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _chars(value: Any) -> int:
    """Characters in every string of a text or of nested chat messages (keys excluded)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict) and value.get("type") in ("image", "image_url"):
        return 0  # an image's length is its soft tokens, counted once they are known
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    return 0
