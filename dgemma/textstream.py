"""Committed ids -> text deltas for one request: no split characters, no repeated text, stop strings honoured."""

from __future__ import annotations

from dgemma.sampling import stop_holdback, truncate_at_stop_strings
from dgemma.tokenizer import IncrementalDecoder, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stops = stops
        self.decoder = IncrementalDecoder(tokenizer)
        self.emitted = ""
        self.stopped = False

    @property
    def text(self) -> str:
        return self.emitted

    def push(self, ids: list[int], final: bool = False) -> str:
        """Feed newly committed ids; returns the text that is now safe to show."""
        if self.stopped:
            return ""
        self.decoder.push(ids, final=final)
        full = self.decoder.text
        if self.stops:
            cut, hit = truncate_at_stop_strings(full, self.stops)
            if hit:
                self.stopped = True
                full = cut
            elif not final:
                full = full[:len(full) - stop_holdback(full, self.stops)]
        delta = full[len(self.emitted):]
        self.emitted = full if len(full) > len(self.emitted) else self.emitted
        return delta

    def kept_ids(self) -> list[int]:
        """The shortest prefix of the ids whose text covers what was emitted (ids past a stop string are cut)."""
        ids = self.decoder.ids
        if not self.stopped:
            return ids
        for n in range(len(ids) + 1):
            if len(self.tokenizer.decode(ids[:n])) >= len(self.emitted):
                return ids[:n]
        return ids
