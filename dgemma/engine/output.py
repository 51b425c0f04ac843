"""The one path from engine events to what users see, for the Python API, the CLI and the server: committed
text deltas (never a split character, stop strings held back and honoured), drafts of the current canvas, and
the final flush with the finish reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dgemma.engine.request import Event
from dgemma.sampling import stop_holdback, truncate_at_stop_strings
from dgemma.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class StreamEvent:
    """draft: the current canvas (text and ids, each position's own text in `pieces`, the positions the step
    kept in `accepted`; `canvas` counts committed canvases, `step` the denoising steps of this one); text: newly
    committed text and ids; done: the request ended (`finish_reason`; the API adds its `result`)."""

    kind: Literal["draft", "text", "done"]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    canvas: int = 0
    step: int = 0
    result: Any = None
    logprobs: list | None = None  # text: (id, logprob, [(id, logprob)] alternatives) per committed id, when asked
    pieces: list[str] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)


class OutputStream:
    """One request's engine events in, StreamEvents out. Committed ids are detokenized incrementally; text that
    may still become a stop string is held back. When `stopped` turns True (a stop string was seen) the caller
    aborts the engine request; later events are ignored. Each event costs time linear in its own ids and text
    (the held-back text is at most the longest stop string), never in the whole output."""

    def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.ids: list[int] = []
        self._emitted: list[str] = []  # text given out, in pieces
        self.emitted_chars = 0
        self._held = ""  # decoded text not given out yet: it may still begin a stop string
        self._kept: list[int] | None = None  # kept_ids once stopped
        self.stopped = False
        self.canvases = self.steps = 0
        self.finish_reason: str | None = None
        self.logprobs: list = []

    @property
    def text(self) -> str | None:
        return None if self.decoder is None else "".join(self._emitted)

    def kept_ids(self) -> list[int]:
        """The committed ids; after a stop string, the shortest prefix whose text covers what was emitted (a
        binary search: O(n log n) decoding, once)."""
        if not self.stopped:
            return self.ids
        if self._kept is None:
            decode, lo, hi = self.tokenizer.decode, 0, len(self.ids)
            while lo < hi:  # text length grows with the prefix (up to a few replacement characters)
                mid = (lo + hi) // 2
                lo, hi = (mid + 1, hi) if len(decode(self.ids[:mid])) < self.emitted_chars else (lo, mid)
            self._kept = self.ids[:lo]
        return self._kept

    def feed(self, event: Event) -> list[StreamEvent]:
        if self.finish_reason is not None:
            return []
        if event.kind == "draft":
            self.steps += 1
            tok, ids = self.tokenizer, event.token_ids
            text, pieces = (tok.decode(ids), tok.pieces(ids)) if tok is not None else ("", [])
            return [StreamEvent("draft", text, ids, canvas=self.canvases, step=self.steps, pieces=pieces,
                                accepted=event.accepted)]
        if event.kind == "commit":
            if event.ends_canvas:
                self.canvases, self.steps = self.canvases + 1, 0
            self.ids.extend(event.token_ids)
            self.logprobs.extend(event.logprobs or [])
            out = [StreamEvent("text", self._push(event.token_ids), event.token_ids, logprobs=event.logprobs)]
            return out + [self._done("stop")] if self.stopped else out
        reason = event.finish_reason
        if reason not in ("stop", "length"):
            return [self._done(reason)]
        tail = self._push([], final=True)  # may complete a stop string held back until now
        return ([StreamEvent("text", tail)] if tail else []) + [self._done("stop" if self.stopped else reason)]

    def _push(self, ids: list[int], final: bool = False) -> str:
        """Newly committed ids -> the text now safe to show. A stop string not seen yet starts in the held-back
        text (any earlier start would have held its beginning back), so only that text is searched."""
        if self.decoder is None or self.stopped:
            return ""
        held = self._held + self.decoder.push(ids, final=final)
        if self.stops:
            cut, self.stopped = truncate_at_stop_strings(held, self.stops)
            delta = cut if self.stopped or final else held[:len(held) - stop_holdback(held, self.stops)]
        else:
            delta = held
        self._held = held[len(delta):]
        self._emitted.append(delta)
        self.emitted_chars += len(delta)
        return delta

    def _done(self, reason: str) -> StreamEvent:
        self.finish_reason = reason
        return StreamEvent("done", finish_reason=reason)
