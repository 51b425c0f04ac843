"""What a request option declares, once: its SamplingParams field, the `dgemma generate` flag and the server's
request field made from it, its validation, and the decoding modes it applies to (no torch import here: `--help`
stays fast)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MODES = ("diffusion", "autoregressive", "speculative")
DIFFUSION = MODES[:1]
PACINGS = ("counted", "timed")  # speculative decoding: when to draft, from counts of ids (reproducible) or the clock


@dataclass(frozen=True)
class Option:
    """`wire`: the top-level request field of that name (OpenAI's or vLLM's); None: a field of the server's
    `dgemma_sampling`. `check(value, vocab_size)` raises SamplingParamsError (vocab_size None: the value alone);
    `normalize` turns a caller's value into the stored, hashable one; `parse` reads a command-line word (its flag is
    then repeatable, its values a list); `wire_type`: the request field's type (default `type`); `opt_in`: changes
    outputs and is off unless asked for."""

    name: str
    type: type
    metavar: str
    help: str
    modes: tuple[str, ...] = DIFFUSION
    wire: str | None = None
    check: Callable[[Any, int | None], None] | None = None
    normalize: Callable[[Any], Any] | None = None
    parse: Callable[[str], Any] | None = None
    wire_type: Any = None
    opt_in: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")
