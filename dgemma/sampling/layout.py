"""Layout canvases: an output layout of fixed tokens and holes (infill before a suffix, templates with holes,
edits of a draft). Fixed positions are kept in the canvas (the decoder attends to them; they are never
renoised and count as certain for the stopper); holes are denoised. A hole ends at its first EOS (the rest of
the hole is dropped from the output), so a hole of n tokens yields at most n. Positions past the layout's end in
its last canvas are fixed EOS, as the model saw after every answer in training.

Template syntax: `[[hole]]` (DEFAULT_HOLE tokens) or `[[hole:N]]` (at most N tokens); everything else is fixed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from dgemma.errors import SamplingParamsError
from dgemma.sampling.samplers import StepOutput

HOLE = re.compile(r"\[\[hole(?::(\d+))?\]\]")
DEFAULT_HOLE = 16
MAX_HOLE = 4096


@dataclass(frozen=True)
class Layout:
    """The output, position by position: `tokens[i]` is a fixed id, or -1 in a hole; `holes[i]` numbers the hole
    (-1 at fixed positions). `echo`: fixed tokens are part of the output (templates, edits) or only context
    (an infill's suffix)."""

    tokens: tuple[int, ...]
    holes: tuple[int, ...]
    echo: bool = True
    param: str = "template"

    @classmethod
    def from_parts(cls, parts: list[list[int] | int], echo: bool = True, param: str = "template",
                   limit: int | None = None) -> Layout:
        """parts: fixed id lists and hole lengths, in order. `limit`: the most positions the layout may have,
        checked before it is built (its tuples cost memory per position)."""
        for part in parts:
            if isinstance(part, int) and not 1 <= part <= MAX_HOLE:
                raise SamplingParamsError(f"a hole has {part} tokens; it must have 1 to {MAX_HOLE}", param)
        size = sum(p if isinstance(p, int) else len(p) for p in parts)
        if limit is not None and size > limit:
            raise SamplingParamsError(f"the {param} has {size} tokens; at most {limit} are allowed (the room left in "
                                      "the context, or the server's cap)", param)
        tokens: list[int] = []
        holes: list[int] = []
        for k, part in enumerate(parts):
            if isinstance(part, int):
                tokens += [-1] * part
                holes += [k] * part
            else:
                tokens += part
                holes += [-1] * len(part)
        return cls(tuple(tokens), tuple(holes), echo, param)

    def check(self, vocab_size: int | None = None) -> None:
        if not self.tokens or all(h < 0 for h in self.holes):
            raise SamplingParamsError("a layout canvas needs at least one hole", self.param)
        if vocab_size is not None and any(t >= vocab_size for t in self.tokens):
            raise SamplingParamsError("a fixed token is outside the vocabulary", self.param)


def parse_template(text: str, limit: int | None = None) -> list[str | int]:
    """A template -> fixed strings and hole lengths, e.g. "a [[hole:3]] b" -> ["a ", 3, " b"]. `limit`: the most
    tokens its holes may total; a template over it is refused at the first hole that passes it, before any
    tokenizing or building (so its cost is bounded by the limit, not by its length)."""
    parts: list[str | int] = []
    at = total = 0
    for m in HOLE.finditer(text):
        if m.start() > at:
            parts.append(text[at:m.start()])
        parts.append(_hole_length(m.group(1)))
        total += parts[-1]
        if limit is not None and total > limit:
            raise SamplingParamsError(f"the template's holes total more than {limit} tokens, the most allowed (the "
                                      "room left in the context, or the server's cap)", "template")
        at = m.end()
    if at < len(text):
        parts.append(text[at:])
    if not any(isinstance(p, int) for p in parts):
        raise SamplingParamsError("the template has no hole ([[hole]] or [[hole:N]])", "template")
    return parts


def _hole_length(digits: str | None) -> int:
    if digits is None:
        return DEFAULT_HOLE
    if len(digits) > len(str(MAX_HOLE)) or not 1 <= int(digits) <= MAX_HOLE:
        shown = digits if len(digits) <= 12 else f"{digits[:12]}... ({len(digits)} digits)"
        raise SamplingParamsError(f"a hole has {shown} tokens; it must have 1 to {MAX_HOLE}", "template")
    return int(digits)


def edit_parts(ids: list[int], renoised: set[int]) -> list[list[int] | int]:
    """A draft with some positions renoised -> parts: kept runs fixed, each renoised run one hole (linear)."""
    parts: list[list[int] | int] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (i in renoised) != (start in renoised):
            parts.append(i - start if start in renoised else ids[start:i])
            start = i
    return parts


def renoised_positions(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> set[int]:
    """The tokens (by their [start, end) character offsets, in text order) that overlap any [start, end) span:
    one sweep over the spans sorted by start, O((tokens + spans) log spans). More spans than tokens: refused."""
    if len(spans) > max(1, len(offsets)):
        raise SamplingParamsError(f"{len(spans)} renoise spans for a draft of {len(offsets)} tokens", "renoise")
    spans = sorted(spans)
    chosen, reach, k = set(), -1, 0
    for i, (a, b) in sorted(enumerate(offsets), key=lambda item: item[1][1]):
        while k < len(spans) and spans[k][0] < b:  # spans starting before this token ends
            reach = max(reach, spans[k][1])
            k += 1
        if reach > a:
            chosen.add(i)
    return chosen


class LayoutState:
    """One request's progress through its layout: the output offset of the current canvas, the holes already
    ended by an EOS, and this canvas's fixed positions."""

    def __init__(self, layout: Layout, eos: tuple[int, ...]):
        self.layout, self.eos = layout, eos
        self.offset = 0
        self.closed: set[int] = set()
        self.fixed: Tensor | None = None  # [C] bool
        self.ids: Tensor | None = None  # [C] long

    def start_canvas(self, canvas_length: int, device) -> None:
        lay, end = self.layout, self.offset + canvas_length
        ids = [lay.tokens[i] if i < len(lay.tokens) else self.eos[0] for i in range(self.offset, end)]
        self.fixed = torch.tensor([t >= 0 for t in ids], device=device)
        self.ids = torch.tensor([max(t, 0) for t in ids], device=device)

    def take(self, canvas: list[int]) -> tuple[list[int], bool]:
        """A done canvas -> the ids it adds to the output, and whether the layout is finished (every position
        taken)."""
        lay, kept = self.layout, []
        for j, t in enumerate(canvas[:len(lay.tokens) - self.offset]):
            hole = lay.holes[self.offset + j]
            if hole < 0:
                kept += [t] if lay.echo else []
            elif hole not in self.closed:
                if t in self.eos:
                    self.closed.add(hole)
                else:
                    kept.append(t)
        self.offset += len(canvas)
        return kept, self.offset >= len(lay.tokens)

    def preview(self, canvas: list[int]) -> list[int]:
        """What `take` would add, without moving on (drafts)."""
        offset, closed = self.offset, set(self.closed)
        kept, _ = self.take(canvas)
        self.offset, self.closed = offset, closed
        return kept


def layout_step(states: list[LayoutState | None], out: StepOutput) -> StepOutput:
    """Keep the fixed positions of the layout rows (in place): their ids in the canvas and the draft, accepted,
    entropy 0."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if rows:
        fixed = torch.stack([states[i].fixed for i in rows])
        ids = torch.stack([states[i].ids for i in rows])
        index = torch.tensor(rows, device=out.canvas.device)
        out.canvas[index] = torch.where(fixed, ids, out.canvas[index])
        out.argmax[index] = torch.where(fixed, ids, out.argmax[index])
        out.accepted[index] = out.accepted[index] | fixed
        out.entropy[index] = out.entropy[index].masked_fill(fixed, 0.0)
    return out


def layout_start(states: list[LayoutState | None], tokens: Tensor) -> None:
    """The first input of a canvas: fixed ids where the layout has them, noise elsewhere (in place)."""
    for i, s in enumerate(states):
        if s is not None:
            s.start_canvas(tokens.shape[1], tokens.device)
            tokens[i] = torch.where(s.fixed, s.ids, tokens[i])
