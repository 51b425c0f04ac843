"""Where the caller's strings lie in a rendered chat template. The template is rendered a second time with each
string swapped for a sentinel; lining that render up with the real one gives the exact characters each string
became, whatever else in the chat spells the same text (a content that repeats the template's turn markers,
another message, a template piece)."""

from __future__ import annotations

import re
import secrets
from typing import Any, Callable

from dgemma.errors import DgemmaError

STRUCTURAL = frozenset({"role", "type", "required"})  # values templates compare with their own literals


def caller_spans(render: Callable[..., str], text: str, messages: Any, tools: Any, forging: Callable[[str], bool],
                 every: bool) -> list[tuple[int, int]] | None:
    """(start, end) in `text` (`render(messages, tools=tools)`) of the strings that would make a control token
    (`forging`) and, with `every`, of all the others but dict keys and STRUCTURAL values; in order. None when the
    template does more with one of them than write it, trimmed or not (then its place cannot be known)."""
    nonce = secrets.randbelow(10**15)  # digits: a sentinel survives upper() and lower()
    strings: dict[str, int] = {}

    def swap(s: str, structural: bool) -> str:
        if not s or not (every and not structural or forging(s)):
            return s
        return f"\ue001{nonce}.{strings.setdefault(s, len(strings))}\ue002"  # equal strings stay equal

    try:
        skeleton = render(_swapped(messages, swap), tools=_swapped(tools, swap))
    except (DgemmaError, TypeError, ValueError, RecursionError):  # deep JSON: this render runs a few frames deeper
        return None
    return _align(re.split(f"\ue001{nonce}\\.(\\d+)\ue002", skeleton), text, list(strings))


def _swapped(value: Any, swap: Callable[[str, bool], str], structural: bool = False) -> Any:
    if isinstance(value, str):
        return swap(value, structural)
    if isinstance(value, dict):
        return {swap(k, True): _swapped(v, swap, k in STRUCTURAL) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_swapped(v, swap, structural) for v in value]
    return value


def _align(parts: list[str], text: str, strings: list[str]) -> list[tuple[int, int]] | None:
    """`parts`: the skeleton's pieces with sentinel indices between them. Each piece must be the text's next
    characters and each sentinel its string, as written or trimmed (the piece after it decides which)."""
    if not text.startswith(parts[0]):
        return None
    at, spans = len(parts[0]), []
    for index, piece in zip(parts[1::2], parts[2::2]):
        s = strings[int(index)]
        n = next((len(v) for v in dict.fromkeys((s, s.strip(), s.rstrip(), s.lstrip()))
                  if text.startswith(v, at) and text.startswith(piece, at + len(v))), None)
        if n is None:
            return None
        spans += [(at, at + n)] * (n > 0)
        at += n + len(piece)
    return spans if at == len(text) else None
