"""Tokenizer and chat template (the edges of the engine, which works on token ids)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from dgemma.errors import CheckpointError, DgemmaError
from dgemma.jsonfile import read_json  # noqa: F401 (also imported from here)


class Tokenizer:
    def __init__(self, directory: Path):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise CheckpointError(f"{directory / 'tokenizer.json'}: cannot load tokenizer ({e})") from None
        config = read_json(directory / "tokenizer_config.json")
        template = config.get("chat_template")
        if template is None and (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        self._set(tok, template, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")),
                  bool(config.get("add_bos_token", True)))

    @classmethod
    def from_parts(cls, tok, chat_template: str | None, bos_token: str | None, eos_token: str | None,
                   add_bos: bool = True) -> Tokenizer:
        """From a built `tokenizers.Tokenizer` (a GGUF file's vocabulary, for instance)."""
        self = cls.__new__(cls)
        self._set(tok, chat_template, bos_token, eos_token, add_bos)
        return self

    def _set(self, tok, chat_template: str | None, bos_token: str | None, eos_token: str | None,
             add_bos: bool) -> None:
        self.tok = tok
        self.chat_template: str | None = chat_template
        self.bos_token = bos_token or "<bos>"
        self.eos_token = eos_token or "<eos>"
        self.add_bos = add_bos
        self._pieces: dict[int, str] = {}

    @classmethod
    def maybe_load(cls, directory: Path) -> Tokenizer | None:
        return cls(directory) if (directory / "tokenizer.json").is_file() else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters: a text of C characters has at least C / this many tokens."""
        return max((len(t) for t in self.tok.get_vocab()), default=1)

    def token_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a huge prompt tokenized in a
        # worker thread does not stall the server's event loop
        ids = self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.token_id(self.bos_token)
        if (self.add_bos if add_bos is None else add_bos) and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def pieces(self, ids: list[int]) -> list[str]:
        """Each id's own text (special tokens by name), to show a canvas position by position. Remembered per id
        (at most the vocabulary): drafts repeat most ids from step to step."""
        if missing := list({i for i in ids if i not in self._pieces}):
            self._pieces.update(zip(missing, self.tok.decode_batch([[i] for i in missing], skip_special_tokens=False)))
        return [self._pieces[i] for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The template's text; `tools` (OpenAI tool objects) is passed to templates that declare tools."""
        if not self.chat_template:
            raise DgemmaError("this checkpoint has no chat template; send a plain prompt instead")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **({"tools": tools} if tools else {}))
        except TemplateError as e:
            raise DgemmaError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.encode(self.apply_chat_template(messages, tools=tools), add_bos=False)


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas that never split a multi-byte character or repeat text. Each
    push decodes a window (the ids of the previous delta as context, then the new ones), not the whole output, so
    decoding n tokens costs O(n) however they arrive (one canvas or one token at a time)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.length = 0  # characters decoded so far
        self._context = 0  # ids[_context:_read]: the window's context (decoded again for its length only)
        self._read = 0  # ids whose text was given out

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        decode = self.tokenizer.decode
        window = decode(self.ids[self._context:])
        if not final and window.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next tokens
        before = decode(self.ids[self._context:self._read])
        if not window.startswith(before):
            return ""  # the new ids changed the context's text: wait until it settles
        delta = window[len(before):]
        self._context, self._read = self._read, len(self.ids)
        self.length += len(delta)
        return delta


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value

