"""The one path from engine events to what users see, for the Python API, the CLI and the server: committed
text deltas (never a split character, stop strings held back and honoured), drafts of the current canvas, and
the final flush with the finish reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dgemma.engine.request import Event
from dgemma.textstream import TextStream
from dgemma.tokenizer import Tokenizer


@dataclass
class StreamEvent:
    """draft: the current canvas (text and ids; `canvas` counts committed canvases, `step` the denoising steps
    of this one); text: newly committed text and ids; done: the request ended (`finish_reason`; the API adds
    its `result`)."""

    kind: Literal["draft", "text", "done"]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    canvas: int = 0
    step: int = 0
    result: Any = None


class OutputStream:
    """One request's engine events in, StreamEvents out. When `stopped` turns True (a stop string was seen) the
    caller aborts the engine request; later events are ignored."""

    def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.text_stream = TextStream(tokenizer, stops) if tokenizer is not None else None
        self.ids: list[int] = []
        self.canvases = self.steps = 0
        self.finish_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self.text_stream is not None and self.text_stream.stopped

    @property
    def text(self) -> str | None:
        return None if self.text_stream is None else self.text_stream.text

    def kept_ids(self) -> list[int]:
        """The committed ids, cut after a stop string."""
        return self.ids if self.text_stream is None else self.text_stream.kept_ids()

    def feed(self, event: Event) -> list[StreamEvent]:
        if self.finish_reason is not None:
            return []
        if event.kind == "draft":
            self.steps += 1
            text = self.tokenizer.decode(event.token_ids) if self.tokenizer is not None else ""
            return [StreamEvent("draft", text, event.token_ids, canvas=self.canvases, step=self.steps)]
        if event.kind == "commit":
            return self._commit(event.token_ids)
        reason = event.finish_reason
        out = []
        if reason in ("stop", "length") and self.text_stream is not None:
            tail = self.text_stream.push([], final=True)  # may complete a stop string held back until now
            out = [StreamEvent("text", tail)] if tail else []
            reason = "stop" if self.stopped else reason
        return out + [self._done(reason)]

    def _commit(self, ids: list[int]) -> list[StreamEvent]:
        self.canvases, self.steps = self.canvases + 1, 0
        self.ids.extend(ids)
        delta = self.text_stream.push(ids) if self.text_stream is not None else ""
        out = [StreamEvent("text", delta, ids)]
        return out + [self._done("stop")] if self.stopped else out

    def _done(self, reason: str) -> StreamEvent:
        self.finish_reason = reason
        return StreamEvent("done", finish_reason=reason)
