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
        """The rendered chat's ids. Control tokens come from the template only: text in a message that spells one
        (`<start_of_turn>`, `<eos>`) stays text, as OpenAI's API keeps it, so content cannot close its turn."""
        text = self.apply_chat_template(messages, tools=tools)
        enc = self.tok.encode_batch([text], add_special_tokens=False)[0]
        hits = [(a, b) for t, (a, b) in zip(enc.ids, enc.offsets) if t in self._special_ids]
        if not hits:
            return enc.ids
        spans = self._content_spans(text, [m.get("content") for m in messages], hits)
        if not spans:
            return enc.ids
        ids, at = [], 0
        for a, b in spans:  # the template's text with its control tokens, then the content as plain text
            ids += self._encode_plain(text[at:a], self.tok) + self._encode_plain(text[a:b], self._text_only)
            at = b
        return ids + self._encode_plain(text[at:], self.tok)

    def _content_spans(self, text: str, contents: list[Any], hits: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Where the messages' contents are in the rendered text (in order), for those that hold a control
        token's text; a content the template changed so that it cannot be found, holding one: refused."""
        spans, at = [], 0
        for content in (c for c in contents if isinstance(c, str) and c.strip()):
            a = text.find(content, at)
            a, n = (a, len(content)) if a >= 0 else (text.find(content.strip(), at), len(content.strip()))
            if a < 0:
                if any(control in content for control in {text[x:y] for x, y in hits}):
                    raise DgemmaError("a message holds a control token's text where the chat template changes "
                                      "it, so it cannot be kept as text; remove it")
                continue
            if any(a <= x and y <= a + n for x, y in hits):
                spans.append((a, a + n))
            at = a + n
        return spans

    @staticmethod
    def _encode_plain(text: str, tok) -> list[int]:
        return tok.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def _text_only(self):
        """A copy of the tokenizer that reads control-token text as plain text."""
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_str(self.tok.to_str())
        tok.encode_special_tokens = True
        return tok


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

