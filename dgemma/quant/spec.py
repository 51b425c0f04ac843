"""What `--quantize` asks for: a scheme name parsed once into a `QuantSpec` (no torch import: --help stays fast).

Grammar: `int8` | `int4`, optionally `:GROUP` (columns per scale, default 32), optionally `+emb8` (the tied
embedding / LM head in int8 instead of the body's scheme) or `+embfp` (kept in the model's float dtype).
Examples: `int4`, `int4:64`, `int4+emb8`, `int8:128+embfp`. `nvfp4` (E2M1 codes, float8 scales per 16, a global
scale per tensor) keeps the embedding in float unless `+emb8` / `+emb4` asks otherwise.
A final `+a8` adds int8 activations (quant/a8.py: x86 CPUs); `a8` alone adds them to a checkpoint's own quantized
weights (a GGUF or pre-quantized file) without re-quantizing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dgemma.errors import ConfigError

SCHEMES = ("int8", "int4", "nvfp4")
_GRAMMAR = re.compile(r"(?:int(8|4)(?::(\d+))?|(nvfp4))(?:\+emb(8|4|fp))?(\+a8)?|(a8)")


@dataclass(frozen=True)
class QuantSpec:
    bits: int  # 8 or 4: every projection, dense MLP, expert stack and self-conditioning matrix; 0: as stored
    group_size: int = 32
    embedding_bits: int | None = None  # 8, 4 (integer), or None: keep the embedding in float
    nvfp4: bool = False  # the body in NVFP4 (bits 4, group 16) instead of integers
    int8_activations: bool = False  # `+a8`: 2D quantized weights multiply int8 activations (quant/a8.py)

    @property
    def name(self) -> str:
        a8 = "+a8" if self.int8_activations else ""
        if not self.bits:
            return "a8"
        if self.nvfp4:
            return "nvfp4" + ("" if self.embedding_bits is None else f"+emb{self.embedding_bits}") + a8
        emb = "" if self.embedding_bits == self.bits else f"+emb{self.embedding_bits or 'fp'}"
        group = "" if self.group_size == 32 else f":{self.group_size}"
        return f"int{self.bits}{group}{emb}{a8}"

    @property
    def requantizes(self) -> bool:
        """False for a bare `a8`: the checkpoint's weights stay as stored."""
        return self.bits != 0


def parse_quantize(text: str | QuantSpec | None) -> QuantSpec | None:
    """'int4', 'int8:128+emb8', ... -> QuantSpec; None -> None; anything else is a one-line ConfigError."""
    if text is None or isinstance(text, QuantSpec):
        return text
    m = _GRAMMAR.fullmatch(str(text).strip().lower())
    group = int(m.group(2)) if m and m.group(2) else 32
    if not m or group < 2 or group % 2:
        raise ConfigError(f"quantize={text!r}: expected int8, int4 or nvfp4, optionally :GROUP (int: an even "
                          "number of columns per scale), +emb8 / +emb4 / +embfp and +a8; or a8 alone")
    emb, a8 = m.group(4), bool(m.group(5))
    if m.group(6):
        return QuantSpec(0, int8_activations=True)
    if m.group(3):
        return QuantSpec(4, 16, None if emb in (None, "fp") else int(emb), nvfp4=True, int8_activations=a8)
    bits = int(m.group(1))
    embedding = bits if emb is None else (None if emb == "fp" else int(emb))
    return QuantSpec(bits, group, embedding, int8_activations=a8)
