"""What a sampling knob is: its option and its rule on a row's logits, and the range checks the knobs share."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dgemma.errors import SamplingParamsError
from dgemma.option import MODES, Option

LOGITS, PROBS = "logits", "probs"  # a rule runs on the logits before the temperature, or on them after it


@dataclass(frozen=True)
class Knob:
    """`apply(logits [N, V] float32, value, history)` returns the processed logits (in place allowed); `history`
    has the row's `prompt` and `output` ids (sampling/processing.History). `off`: values that change nothing."""

    option: Option
    stage: str
    apply: Callable[[Any, Any, Any], Any]
    off: tuple[Any, ...] = ()

    def active(self, value: Any) -> bool:
        return value is not None and value not in self.off


def knob_option(name: str, type: type, metavar: str, help: str, check: Callable[[Any, int | None], None],
                **more: Any) -> Option:
    """A knob's option: every decoding mode, the fast sampler, the request field of the same name."""
    return Option(name, type, metavar, help, modes=MODES, wire=name, check=check, **more)


def number_in(name: str, lo: float, hi: float, lo_open: bool = False) -> Callable[[Any, int | None], None]:
    """A check: a finite number in [lo, hi] (lo excluded with `lo_open`)."""

    def check(value: Any, vocab_size: int | None = None) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value > hi or value < lo or (lo_open and value == lo):
            raise SamplingParamsError(f"{name}={value!r} must be a number in {'(' if lo_open else '['}{lo}, {hi}]",
                                      name)

    return check
