"""Gemma 4's thought channel. A chat template that reads `enable_thinking` puts `<|think|>` at the top of the system
turn, and the model writes `<|channel>thought\\n ... <channel|>` before its answer (the template strips the thoughts
of earlier turns; with thinking off it writes an empty channel after the generation prompt). `Channel`: a
checkpoint's channel ids; `ThoughtSplit`: a reply's ids, as they are committed, split into its thought and its
answer, by the rule of vLLM's gemma4 reasoning parser (a thought only when the reply opens with the channel; the
`thought\\n` label is not part of it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPEN, CLOSE, LABEL = "<|channel>", "<channel|>", "thought\n"
THINKING = "enable_thinking"  # the template argument that turns thinking on


@dataclass(frozen=True)
class Channel:
    open: int
    close: int

    @classmethod
    def of(cls, tokenizer: Any) -> Channel | None:
        """The channel of a tokenizer whose chat template writes it and whose vocabulary has its tokens."""
        template = getattr(tokenizer, "chat_template", None) or ""
        if OPEN not in template:
            return None
        ids = [tokenizer.token_id(t) for t in (OPEN, CLOSE)]
        return None if None in ids else cls(*ids)


class ThoughtSplit:
    """One reply's committed ids -> (thought ids, answer ids) of each push; the channel's own ids are in neither."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.state = "start"  # start -> thought -> answer, or start -> answer
        self.opened = False  # the reply opened the channel (its thought may be empty or cut short)

    def push(self, ids: list[int]) -> tuple[list[int], list[int]]:
        ids = list(ids)
        if ids and self.state == "start":
            self.opened = ids[0] == self.channel.open
            self.state, ids = ("thought", ids[1:]) if self.opened else ("answer", ids)
        if self.state != "thought":
            return [], ids
        if self.channel.close not in ids:
            return ids, []
        k = ids.index(self.channel.close)
        self.state = "answer"
        return ids[:k], ids[k + 1:]

    def peek(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """`push` without moving on (a draft of the canvas after the committed ids)."""
        state, opened = self.state, self.opened
        try:
            return self.push(ids)
        finally:
            self.state, self.opened = state, opened


class Label:
    """Thought text deltas without the channel's leading `thought\\n` label (held back while they may still be it)."""

    def __init__(self):
        self.head: str | None = ""  # the text held back; None: the label is behind us

    def strip(self, delta: str, final: bool = False) -> str:
        if self.head is None:
            return delta
        self.head += delta
        if LABEL.startswith(self.head) and self.head != LABEL and not final:
            return ""
        out, self.head = self.head.removeprefix(LABEL), None
        return out
