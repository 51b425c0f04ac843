"""Terminal output for `dgemma generate` and `dgemma chat`: streamed text, or the canvas refining in place."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterable

from dgemma.engine import Result, StreamEvent


def print_stream(events: Iterable[StreamEvent], visual: bool = False, show_ids: bool = False) -> Result | None:
    """Committed text as it arrives; with `visual` on a terminal, committed text plus the current canvas,
    redrawn in place at every denoising step, then the final text; a statistics line on stderr. Returns the
    Result."""
    out, err = sys.stdout, sys.stderr
    live = visual and out.isatty()
    drawn, committed, result = 0, "", None
    thought = _Thought(out, not visual)
    for ev in events:
        shown = " ".join(map(str, ev.token_ids)) + " " if show_ids else ev.text
        if ev.kind == "draft" and live:
            drawn = _redraw(out, committed + shown, drawn)
        elif ev.kind == "text":
            thought.show(ev.reasoning, shown)
            committed += shown
            if not visual:
                out.write(shown)
                out.flush()
        elif ev.kind == "done":
            result = ev.result
            thought.show("", "", end=True)
    if visual:
        if live:
            _redraw(out, "", drawn)
        out.write(committed)
    out.write("\n")
    if result is not None:
        s = result.stats
        cached = f", {s['cached_tokens']} prompt tokens from the prefix cache" if s.get("cached_tokens") else ""
        first = f"first token {1000 * s['ttft_seconds']:.0f} ms, " if s.get("ttft_seconds") is not None else ""
        err.write(f"[{len(result.token_ids)} tokens, {s['seconds']:.2f} s, {first}"
                  f"{s['tokens_per_second']:.1f} tok/s, steps per canvas {s['steps_per_canvas']}, "
                  f"{s['tokens_per_forward']:.2f} tokens/forward"
                  f"{cached}, finish: {result.finish_reason}]\n")
    return result


class _Thought:
    """A reply's thought as Ollama's CLI shows it: "Thinking...", the thought, "...done thinking.", then the answer."""

    def __init__(self, out, stream: bool):
        self.out, self.stream, self.state = out, stream, "before"

    def show(self, reasoning: str, answer: str, end: bool = False) -> None:
        if reasoning and self.state == "before":
            self.state = "thinking"
            self._write("Thinking...\n")
        self._write(reasoning)
        if self.state == "thinking" and (answer or end):
            self.state = "done"
            self._write("\n...done thinking.\n\n")

    def _write(self, text: str) -> None:
        if text and self.stream:
            self.out.write(text)
            self.out.flush()


def _redraw(out, text: str, drawn: int) -> int:
    """Replace the previously drawn block of `drawn` lines with `text`; returns the lines now drawn."""
    width = max(20, shutil.get_terminal_size().columns)
    lines = []
    for para in text.replace("\r", "").split("\n"):
        lines.extend([para[i:i + width] for i in range(0, len(para), width)] or [""])
    if drawn:
        out.write(f"\x1b[{drawn - 1}A\r" if drawn > 1 else "\r")
        out.write("\x1b[J")
    out.write("\n".join(lines))
    out.flush()
    return len(lines)
