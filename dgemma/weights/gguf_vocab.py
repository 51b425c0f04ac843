"""The tokenizer a diffusion-gemma GGUF file carries, rebuilt as dgemma's Tokenizer.

llama.cpp's converter stores the Gemma 4 vocabulary as `tokenizer.ggml.model = "gemma4"`: a BPE over raw UTF-8 with
`▁` for spaces, merges in rank order (`tokenizer.ggml.merges`, "left right"), `<0xXX>` byte-fallback tokens, token
types (control and user-defined tokens match as whole tokens), no space prefix, and the text split only at runs
of newlines. This module builds the same tokenizer with the `tokenizers` library.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dgemma.tokenizer import Tokenizer

if TYPE_CHECKING:
    from dgemma.weights.gguf import GGUFFile

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 5 unused, 6 byte)


def gguf_tokenizer(f: GGUFFile) -> Tokenizer | None:
    """The file's tokenizer, or None (with a warning) when it has none or one of another kind."""
    kind = f.value("tokenizer.ggml.model", None)
    if kind is None:
        return None
    if kind != "gemma4":
        log.warning("%s: tokenizer model %r is not the Gemma 4 BPE; loading without a tokenizer (pass token ids)",
                    f.path.name, kind)
        return None
    tokens = f.value("tokenizer.ggml.tokens")
    types = f.value("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    tok = _bpe(tokens, types, f.value("tokenizer.ggml.merges", None) or [],
               f.value("tokenizer.ggml.unknown_token_id", None), bool(f.value("tokenizer.ggml.add_space_prefix",
                                                                                False)))

    def text(key: str) -> str | None:
        i = f.value(f"tokenizer.ggml.{key}_token_id", None)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    return Tokenizer.from_parts(tok, f.value("tokenizer.chat_template", None), text("bos"), text("eos"),
                                bool(f.value("tokenizer.ggml.add_bos_token", True)))


def _bpe(tokens: list[str], types: list[int], merges: list[str], unk: int | None, space_prefix: bool):
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]  # llama.cpp splits at the first space after the first byte
    unk_token = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk_token, byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    special = [AddedToken(t, special=ty == CONTROL, normalized=False)
               for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens(special)
    return tok
