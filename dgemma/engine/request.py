"""Scheduler state as plain dataclasses: a request (each feature's state in its slot, `state`), its statistics, the
commit of one of its canvases, and the events the engine emits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from dgemma.sampling import SamplingParams
from dgemma.sampling.logprobs import Entry

if TYPE_CHECKING:
    from dgemma.engine.features.base import Feature


@dataclass
class Stats:
    steps_per_canvas: list[int] = field(default_factory=list)
    decoder_passes: int = 0
    eos_tokens: int = 0  # counted in tokens_per_forward, as transformers does
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of encoded
    # the features' counts of work left out or added (their `counters`; bench/flops.py prices them), each from 0
    counts: dict[str, int] = field(default_factory=dict)
    # speculative decoding, one entry a step: (slots cached before it, ids it encoded, whether a draft was checked)
    cycles: list[tuple[int, int, bool]] = field(default_factory=list)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_start: float | None = None
    t_first_commit: float | None = None
    t_end: float | None = None

    def __getattr__(self, name: str) -> int:
        """A feature's count read as an attribute (`stats.skipped_head_rows`)."""
        counts = self.__dict__.get("counts", {})
        if name in counts:
            return counts[name]
        raise AttributeError(name)

    def add(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def to_dict(self, n_tokens: int) -> dict:
        seconds = (self.t_end or time.perf_counter()) - (self.t_start or self.t_arrival)
        return {
            "steps_per_canvas": self.steps_per_canvas,
            "decoder_passes": self.decoder_passes,
            "cached_tokens": self.cached_tokens,
            **self.counts,
            "cycles": [list(v) for v in self.cycles],
            "tokens_per_forward": (n_tokens + self.eos_tokens) / self.decoder_passes if self.decoder_passes else 0.0,
            "seconds": seconds,
            "queue_seconds": (self.t_start or self.t_arrival) - self.t_arrival,
            "ttft_seconds": (self.t_first_commit - self.t_arrival) if self.t_first_commit else None,
            "tokens_per_second": n_tokens / seconds if seconds > 0 else 0.0,
        }


@dataclass
class Commit:
    """One row's commit of a canvas: what the request's rule makes of it (up to its first EOS, within its budget),
    as its features reshape it (`Feature.commit`)."""

    canvas: list[int]
    new: list[int]  # the ids the output gains
    eos: bool  # an end-of-sequence id within the budget ends the request (counted in tokens_per_forward)
    finish: str | None  # the request ends with this commit: "stop" or "length"
    logprobs: list[Entry] | None = None  # one entry per id of `new`, when the request asked
    cut: bool = True  # the canvas is encoded up to its first end-of-sequence id, padding after it


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    eos: tuple[int, ...]
    drafts: bool = False
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stats: Stats = field(default_factory=Stats)
    image_features: tuple[torch.Tensor, ...] = ()  # its prompt's images' features, kept until the prompt is encoded
    state: dict[Feature, Any] = field(default_factory=dict)  # each feature's per-row state (features/base.py)

    @property
    def budget(self) -> int:
        return self.params.max_new_tokens - len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def grammar(self) -> Any:
        """The request's grammar matcher (the grammar feature's state), or None: what `next_token` follows."""
        return next((st for f, st in self.state.items() if f.name == "grammar"), None)

    @property
    def committed_early(self) -> int:
        """Ids of the current canvas committed ahead of its end (early commit), which its commit does not repeat."""
        return sum(f.committed_early(self) for f in list(self.state))

    @property
    def cached_early(self) -> int:
        """Of those, ids already in the request's cache: the canvas's commit encodes only the rest."""
        return sum(f.cached_early(self) for f in list(self.state))

    def visible(self, ids: list[int]) -> list[int]:
        """The part of a canvas this request shows: up to its first EOS and within its token budget, unless a
        feature's rule decides it (a layout)."""
        for f in list(self.state):
            shown = f.visible(self, ids)
            if shown is not None:
                return shown
        return self._plain(ids)

    def _plain(self, ids: list[int]) -> list[int]:
        cut = next((i for i, t in enumerate(ids) if t in self.eos), len(ids))
        return ids[:min(cut, self.budget)]

    def take(self, ids: list[int]) -> tuple[list[int], bool]:
        """What committing `ids` appends (`visible`), and whether an end-of-sequence id within the budget ends the
        request ("stop"; one past the budget, the budget ends it first: "length")."""
        return self.visible(ids), any(t in self.eos for t in ids[:self.budget])

    def commit(self, canvas: list[int], steps: int, events: list[Event]) -> Commit:
        """Append a finished canvas's new ids (its event carries those not committed early); finish on EOS ("stop") or
        an exhausted budget ("length"), or as the features' rule says."""
        self.stats.steps_per_canvas.append(steps)
        new, eos = self._plain(canvas), any(t in self.eos for t in canvas[:self.budget])
        full = len(self.output) + len(new) >= self.params.max_new_tokens
        c = Commit(canvas, new, eos, "stop" if eos else "length" if full else None)
        for f in list(self.state):
            f.commit(self, c)
        early = self.committed_early  # the first `early` ids went out already
        self.output.extend(c.new)
        self.stats.t_first_commit = self.stats.t_first_commit or time.perf_counter()
        events.append(Event(self.id, "commit", c.new[early:],
                            logprobs=None if c.logprobs is None else c.logprobs[early:len(c.new)]))
        if c.eos:
            self.stats.eos_tokens += 1
        if c.finish is not None:
            self.finish(c.finish, events)
        return c

    def finish(self, reason: str, events: list[Event] | None = None) -> None:
        self.finish_reason = reason
        self.stats.t_end = time.perf_counter()
        if events is not None:
            events.append(Event(self.id, "finish", finish_reason=reason))


@dataclass
class Event:
    """draft: the visible part of the current canvas not committed yet (`accepted`: which of its positions the
    step kept); commit: newly committed ids (`ends_canvas` False: an early commit, its canvas goes on); finish:
    the request ended."""

    request_id: str
    kind: Literal["draft", "commit", "finish"]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[Entry] | None = None  # commit: one entry per committed id, when the request asked
    accepted: list[bool] = field(default_factory=list)
    ends_canvas: bool = True
