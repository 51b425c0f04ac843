"""The one path from engine events to what users see, for the Python API, the CLI and the server: committed
text deltas (never a split character, stop strings held back and honoured), drafts of the current canvas, the
final flush with the finish reason and, in a chat with tools, the reply's tool calls; in a chat whose checkpoint has
a thought channel, the thought apart from the answer (`reasoning`) wherever text leaves; and the `Result` of it."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from dgemma.chat.thinking import Label, ThoughtSplit
from dgemma.chat.turn import ChatTurn
from dgemma.engine.request import Event, Stats
from dgemma.sampling import stop_holdback, truncate_at_stop_strings
from dgemma.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class StreamEvent:
    """draft: the current canvas (text and ids, each position's own text in `pieces`, the positions the step
    kept in `accepted`; `canvas` counts committed canvases, `step` the denoising steps of this one); text: newly
    committed text and ids; done: the request ended (`finish_reason`; its `result`, a Result, when it ended
    normally); start (the server's only): the request entered the batch. In a chat with a thought channel,
    `reasoning` is the thought's part (new thought text; a draft's thought), `text` the answer's."""

    kind: Literal["draft", "text", "done", "start"]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    canvas: int = 0
    step: int = 0
    result: Any = None
    logprobs: list | None = None  # text: (id, logprob, [(id, logprob)] alternatives) per committed id, when asked
    pieces: list[str] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    reasoning: str = ""


@dataclass
class Result:
    """One finished request. With tools, a reply of calls has `tool_calls` (OpenAI's shape: id, type, function
    {name, arguments as JSON text}), text None and finish reason "tool_calls", as the server reports them.
    `reasoning`: the thought of a reply that opened the checkpoint's thought channel (None: no thought); `text` is
    then the answer after it."""

    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0
    logprobs: list | None = None  # with logprobs=k: (id, logprob, [(id, logprob)] * k) per token (sampling/logprobs.py)
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class OutputStream:
    """One request's engine events in, StreamEvents out. Committed ids are detokenized incrementally; text that
    may still become a stop string is held back. When `stopped` turns True (a stop string was seen) the caller
    aborts the engine request; later events are ignored. Each event costs time linear in its own ids and text
    (the held-back text is at most the longest stop string), never in the whole output. With `tools` that may be
    called, the text is held back to the end, where it becomes either the reply's calls or one text delta. With a
    thought channel (`turn.channel`), stop strings and tool calls apply to the answer only."""

    def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...] = (), turn: ChatTurn | None = None):
        self.tokenizer, self.stops = tokenizer, stops
        tools = turn.tools if turn is not None else None
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self.tool_calls: list[dict[str, Any]] | None = None
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        channel = turn.channel if turn is not None and tokenizer is not None else None
        self.split = ThoughtSplit(channel) if channel is not None else None
        self.thought = _Thought(tokenizer) if channel is not None else None
        self.ids: list[int] = []
        self.answer: list[int] = []  # the ids after the thought (all of them without one)
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
        """The committed ids; after a stop string, those up to the shortest answer prefix whose text covers what was
        emitted (a binary search: O(n log n) decoding, once)."""
        if not self.stopped:
            return self.ids
        if self._kept is None:
            decode, lo, hi = self.tokenizer.decode, 0, len(self.answer)
            while lo < hi:  # text length grows with the prefix (up to a few replacement characters)
                mid = (lo + hi) // 2
                lo, hi = (mid + 1, hi) if len(decode(self.answer[:mid])) < self.emitted_chars else (lo, mid)
            self._kept = self.ids[:len(self.ids) - len(self.answer) + lo]
        return self._kept

    def kept_answer(self) -> list[int]:
        """The answer's part of `kept_ids`."""
        return self.kept_ids()[len(self.ids) - len(self.answer):]

    def feed(self, event: Event) -> list[StreamEvent]:
        if self.finish_reason is not None:
            return []
        if event.kind == "draft":
            self.steps += 1
            tok, ids = self.tokenizer, event.token_ids
            thought, answer = self.split.peek(ids) if self.split is not None else ([], ids)
            text, pieces = (tok.decode(answer), tok.pieces(ids)) if tok is not None else ("", [])
            reasoning = self.thought.draft(thought) if self.thought is not None else ""
            return [StreamEvent("draft", text, ids, canvas=self.canvases, step=self.steps, pieces=pieces,
                                accepted=event.accepted, reasoning=reasoning)]
        if event.kind == "commit":
            if event.ends_canvas:
                self.canvases, self.steps = self.canvases + 1, 0
            self.ids.extend(event.token_ids)
            self.logprobs.extend(event.logprobs or [])
            thought, answer = self.split.push(event.token_ids) if self.split is not None else ([], event.token_ids)
            reasoning = self.thought.push(thought) if self.thought is not None else ""
            self.answer.extend(answer)
            delta = self._push(answer)
            out = [StreamEvent("text", "" if self.tools else delta, event.token_ids, logprobs=event.logprobs,
                               reasoning=reasoning)]
            return out + self._end("stop") if self.stopped else out
        reason = event.finish_reason
        if reason not in ("stop", "length"):
            return [self._done(reason)]
        return self._end(reason)

    def result(self, prompt_tokens: int, logprobs: bool, stats: Stats | None = None) -> Result:
        """The finished request's Result (`logprobs`: whether they were asked for)."""
        ids = self.kept_ids()
        return Result(ids, None if self.tool_calls else self.text, self.finish_reason,
                      stats.to_dict(len(ids)) if stats is not None else {}, prompt_tokens,
                      self.logprobs[:len(ids)] if logprobs else None, self.tool_calls,
                      self.thought.text if self.split is not None and self.split.opened else None)

    def _end(self, reason: str) -> list[StreamEvent]:
        """A normal end: the text held back (a stop string may complete it), or with tools the reply's calls."""
        thought_tail = self.thought.push([], final=True) if self.thought is not None else ""
        tail = self._push([], final=True)
        reason = "stop" if self.stopped else reason
        if self.tools is not None:
            message, reason = self.tools.reply(self.text, self.kept_answer(), reason, self.tokenizer.decode)
            self.tool_calls, tail = message.get("tool_calls"), message["content"] or ""
        out = [StreamEvent("text", tail, reasoning=thought_tail)] if tail or thought_tail else []
        return out + [self._done(reason)]

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


class _Thought:
    """A reply's thought as text: deltas of its ids, UTF-8 safe, without the channel's label."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.decoder, self.label = IncrementalDecoder(tokenizer), Label()
        self.parts: list[str] = []

    def push(self, ids: list[int], final: bool = False) -> str:
        delta = self.label.strip(self.decoder.push(ids, final=final), final) if ids or final else ""
        self.parts.append(delta)
        return delta

    def draft(self, ids: list[int]) -> str:
        """A draft's thought text after what was committed (the label dropped if still ahead)."""
        return copy.copy(self.label).strip(self.tokenizer.decode(ids), final=True) if ids else ""

    @property
    def text(self) -> str:
        return "".join(self.parts)
