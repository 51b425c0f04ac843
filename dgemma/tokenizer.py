"""Tokenizer and chat template (the edges of the engine, which works on token ids)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from dgemma.errors import CheckpointError, DgemmaError
from dgemma.jsonfile import read_json  # noqa: F401 (also imported from here)
from dgemma.template_spans import caller_spans


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

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_strs(self, ids: list[int]) -> list[str | None]:
        """Each id's vocabulary entry as the tokenizer stores it (byte-level BPE: "Ġhello")."""
        return [self.tok.id_to_token(i) for i in ids]

    def pieces(self, ids: list[int]) -> list[str]:
        """Each id's own text (special tokens by name), to show a canvas position by position. Remembered per id
        (at most the vocabulary): drafts repeat most ids from step to step."""
        if missing := list({i for i in ids if i not in self._pieces}):
            self._pieces.update(zip(missing, self.tok.decode_batch([[i] for i in missing], skip_special_tokens=False)))
        return [self._pieces[i] for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, extra: dict[str, Any] | None = None) -> str:
        """The template's text; `tools` (OpenAI tool objects) is passed to templates that declare tools, `extra`
        (checked `chat_template_kwargs`, such as `enable_thinking`) to every template."""
        if not self.chat_template:
            raise DgemmaError("this checkpoint has no chat template; send a plain prompt instead")
        from jinja2 import TemplateError

        try:
            return _compiled(self.chat_template).render(
                **(extra or {}), messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **({"tools": tools} if tools else {}))
        except TemplateError as e:
            raise DgemmaError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    extra: dict[str, Any] | None = None) -> list[int]:
        """The rendered chat's ids. Control tokens come from the template only: text in a message that spells one
        (`<start_of_turn>`, `<eos>`) stays text, as OpenAI's API keeps it, so content cannot close its turn."""
        return self.encode_chat_pieces(messages, tools, extra=extra)[0]

    def encode_chat_pieces(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                           cut: str | None = None, extra: dict[str, Any] | None = None) -> list[list[int]]:
        """The rendered chat's ids in pieces, cut at each `cut` in it (an image's place), control tokens from the
        template only. A chat whose strings make no control token encodes as its whole text, as before. `extra`:
        the template's own arguments (`apply_chat_template`)."""
        text = self.apply_chat_template(messages, tools=tools, extra=extra)
        pieces, hits = self._encode_cut(text, cut)
        spans = self._caller_spans(text, messages, tools, extra) if hits else []
        forged = [(a, b) for a, b in spans if any(a < y and x < b for x, y in hits)]  # also a token across an edge
        return self._encode_spans(text, forged, cut) if forged else pieces

    def encode_text(self, text: str):
        """`text` as plain text, a control token's spelling included: its `tokenizers.Encoding` (ids, offsets)."""
        return self._text_only.encode_batch([text], add_special_tokens=False)[0]

    def _encode_cut(self, text: str, cut: str | None) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """The ids of `text`'s pieces between the `cut`s, and where in `text` they hold control tokens."""
        pieces = _cut(text, cut)
        hits, at = [], 0
        encodings = self.tok.encode_batch(pieces, add_special_tokens=False)
        for piece, enc in zip(pieces, encodings):
            hits += [(at + a, at + b) for t, (a, b) in zip(enc.ids, enc.offsets) if t in self._special_ids]
            at += len(piece) + len(cut or "")
        return [enc.ids for enc in encodings], hits

    def _caller_spans(self, text: str, messages: Any, tools: Any, extra: dict[str, Any] | None
                      ) -> list[tuple[int, int]]:
        """Where the caller's strings lie in `text`: all of them when the template writes them as they are
        (trimmed at most), else those that would make a control token; such a one that the template changes
        cannot be kept as text: refused."""
        for every in (True, False):
            render = functools.partial(self.apply_chat_template, extra=extra)
            spans = caller_spans(render, text, messages, tools, self.forges, every)
            if spans is not None:
                return spans
        raise DgemmaError("a message holds a control token's text where the chat template changes it, so it "
                          "cannot be kept as text; remove it")

    def forges(self, text: str) -> bool:
        """Whether `text` holds a control token's spelling (found as the tokenizer finds it: O(length))."""
        return not self._special_ids.isdisjoint(self._encode_plain(text, self.tok))

    def _encode_spans(self, text: str, spans: list[tuple[int, int]], cut: str | None) -> list[list[int]]:
        """`text` in pieces cut at each `cut`: the template's text with its control tokens, `spans` as text."""
        pieces, ids, at = [], [], 0
        for a, b in [*spans, (len(text), len(text))]:
            for tok, part in ((self.tok, text[at:a]), (self._text_only, text[a:b])):
                for k, piece in enumerate(_cut(part, cut)):
                    if k:  # an image's place
                        pieces.append(ids)
                        ids = []
                    ids += self._encode_plain(piece, tok)
            at = b
        return [*pieces, ids]

    @staticmethod
    def _encode_plain(text: str, tok) -> list[int]:
        return tok.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        """Control tokens; not the unknown token, which text the vocabulary lacks becomes either way."""
        unk = getattr(self.tok.model, "unk_token", None)
        return frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special and t.content != unk)

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


def _cut(text: str, cut: str | None) -> list[str]:
    return text.split(cut) if cut else [text]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """A chat template compiled once (compiling costs ~400x a render: it dominated reading chat training data)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)
