"""Scheduler state as plain dataclasses: a request, its statistics, and the events the engine emits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from dgemma.sampling import SamplingParams
from dgemma.sampling.constraints import RowGrammar
from dgemma.sampling.logprobs import Entry
from dgemma.sampling.seeded import SeedState


@dataclass
class Stats:
    steps_per_canvas: list[int] = field(default_factory=list)
    decoder_passes: int = 0
    eos_tokens: int = 0  # counted in tokens_per_forward, as transformers does
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of encoded
    # opt-in savings (bench/flops.py counts them): canvas positions left out of the head / soft embedding, and
    # soft embeddings computed sparse (top-k) instead of over the whole vocabulary
    skipped_head_rows: int = 0
    skipped_soft_rows: int = 0
    sparse_soft_rows: int = 0
    skipped_body_rows: int = 0  # canvas positions left out of the body (settled_kv_reuse, early_commit_cache)
    encoded_early: int = 0  # ids of a last canvas encoded into the cache (early_commit_cache): extra work
    first_token_rows: int = 0  # LM head rows of the prompt's last position (early_first_token): extra work
    # speculative decoding, one entry a step: (slots cached before it, ids it encoded, whether a draft was checked)
    cycles: list[tuple[int, int, bool]] = field(default_factory=list)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_start: float | None = None
    t_first_commit: float | None = None
    t_end: float | None = None

    def to_dict(self, n_tokens: int) -> dict:
        seconds = (self.t_end or time.perf_counter()) - (self.t_start or self.t_arrival)
        return {
            "steps_per_canvas": self.steps_per_canvas,
            "decoder_passes": self.decoder_passes,
            "cached_tokens": self.cached_tokens,
            "skipped_head_rows": self.skipped_head_rows,
            "skipped_soft_rows": self.skipped_soft_rows,
            "sparse_soft_rows": self.sparse_soft_rows,
            "skipped_body_rows": self.skipped_body_rows,
            "encoded_early": self.encoded_early,
            "first_token_rows": self.first_token_rows,
            "cycles": [list(v) for v in self.cycles],
            "tokens_per_forward": (n_tokens + self.eos_tokens) / self.decoder_passes if self.decoder_passes else 0.0,
            "seconds": seconds,
            "queue_seconds": (self.t_start or self.t_arrival) - self.t_arrival,
            "ttft_seconds": (self.t_first_commit - self.t_arrival) if self.t_first_commit else None,
            "tokens_per_second": n_tokens / seconds if seconds > 0 else 0.0,
        }


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
    grammar: RowGrammar | None = None  # the request's grammar state, when its params carry a grammar
    seeded: SeedState | None = None  # its progress through a seeded layout (fixed tokens and holes)
    canvas_logprobs: list[Entry] | None = None  # this canvas's, when params.logprobs is set (sampling/logprobs.py)
    sent: int = 0  # ids of this canvas committed early (params.early_commit), ahead of its commit
    moved: int = 0  # of those, ids already encoded into the cache (params.early_commit_cache)
    first: tuple[int, list[Entry] | None] | None = None  # the prefill's first token, not yet committed (FirstToken)
    early: Any = None  # early commit's history of this canvas (engine/features/early_commit.py)
    latency: Any = None  # a latency target's state: the request's own step cap (engine/features/latency.py)
    settled: Any = None  # per-position settled runs, when params.skip_settled is set (engine/features/settled.py)

    @property
    def budget(self) -> int:
        return self.params.max_new_tokens - len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible(self, ids: list[int]) -> list[int]:
        """The part of a canvas this request shows: up to its first EOS and within its token budget (a seeded
        request: its layout's rule)."""
        if self.seeded is not None:
            return self.seeded.preview(ids)
        cut = next((i for i, t in enumerate(ids) if t in self.eos), len(ids))
        return ids[:min(cut, self.budget)]

    def take(self, ids: list[int]) -> tuple[list[int], bool]:
        """What committing `ids` appends (`visible`), and whether an end-of-sequence id within the budget ends the
        request ("stop"; one past the budget, the budget ends it first: "length")."""
        return self.visible(ids), any(t in self.eos for t in ids[:self.budget])

    def commit(self, canvas: list[int], steps: int, events: list[Event]) -> None:
        """Append a finished canvas's visible tokens (its event carries those not `send`-ed early); finish on EOS
        ("stop") or an exhausted budget ("length")."""
        self.stats.steps_per_canvas.append(steps)
        if self.seeded is not None:
            new, complete = self.seeded.take(canvas)
            self.output.extend(new)
            self.stats.t_first_commit = self.stats.t_first_commit or time.perf_counter()
            events.append(Event(self.id, "commit", new))
            if complete:
                self.finish("stop", events)
            return
        new, hit_eos = self.take(canvas)
        self.output.extend(new)
        self.stats.t_first_commit = self.stats.t_first_commit or time.perf_counter()
        logprobs, self.canvas_logprobs = self.canvas_logprobs, None
        sent, self.sent = self.sent, 0  # the first `sent` ids went out already (`send`)
        events.append(Event(self.id, "commit", new[sent:],
                            logprobs=None if logprobs is None else logprobs[sent:len(new)]))
        if hit_eos:
            self.stats.eos_tokens += 1
            self.finish("stop", events)
        elif self.budget <= 0:
            self.finish("length", events)

    def send(self, ids: list[int], logprobs: list[Entry] | None, events: list[Event]) -> None:
        """Commit the next `ids` of the current canvas before it ends (early commit); the canvas's own commit
        appends them to `output` with the rest and sends only the rest."""
        self.sent += len(ids)
        self.stats.t_first_commit = self.stats.t_first_commit or time.perf_counter()
        events.append(Event(self.id, "commit", ids, logprobs=logprobs, ends_canvas=False))

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
