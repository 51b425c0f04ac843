"""The row-feature contract: what a request asks beyond plain denoising (a grammar, a layout canvas, logprobs,
early commit, a saving) is one `Feature`. A feature declares, in its one module:
- its per-row state: a slot the request keeps for it (`of` / `put` / `drop`; `Request.state`), no field of `Request`;
- its dependencies: `requires` names the features it builds on (earlier in FEATURES), handed over as `needs`;
- its cost accounting: `counters`, counts of work its rows left out or added, which bench/flops.py prices;
and hooks the engine calls: when a row is made (`attach`) and its prompt is in its cache (`prefilled`), when a canvas
starts (`start`, which may commit), before the decoder pass (`shape`: positions kept, hidden, reused, ids moved into
a cache), after each step (`step` rewrites the step's output, `after_step` acts on the canvas after it), and on the
request's own commit (`visible`, `commit`, `committed_early`, `cached_early`, called for the features that hold a
slot on it). The token-by-token engines call `attach` and `start_sequence`. Hooks act only on the rows that carry
the feature; a new feature is one module here and one entry in FEATURES (features/__init__.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dgemma.engine.batch import Canvas
from dgemma.engine.request import Commit, Event, Request
from dgemma.engine.runner import Pass
from dgemma.model import DiffusionGemma
from dgemma.model.head import Head
from dgemma.sampling import StepOutput

log = logging.getLogger("dgemma.engine")


@dataclass(frozen=True)
class Counter:
    """A count a feature keeps per request (`Stats.add`, read back as `stats[name]`): `unit`s of work its rows left
    out (`saves`) or added. bench/flops.py prices each unit: "vocab_row" (a position's LM head or soft-embedding
    row), "sparse_soft_row" (a soft embedding over k entries instead of the vocabulary), "canvas_body_row" (a canvas
    position's share of a decoder pass), "encoded_id" (an id through the encoder)."""

    name: str
    unit: str
    saves: bool = True


@dataclass
class Step:
    """One denoising step of a canvas as the features see it."""

    rows: list[Request]
    canvas: Canvas
    hidden: Tensor  # [B, C, H] the decoder's normed hidden states
    head: Head
    inv_temp: Tensor  # [B] this step's 1 / temperature per row
    out: StepOutput  # the fused step's output (features may rewrite it in `step`)
    events: list[Event]
    step_seconds: float | None = None  # the engine's measured wall time of a step so far (None: none measured)

    def fail(self, i: int, error: BaseException) -> None:
        """Row i failed in its own work (its grammar, its layout): it ends with "error" and leaves the batch at the
        next step; the other rows go on."""
        log.error("request %s failed and was ended: %s: %s", self.rows[i].id, type(error).__name__, error,
                  exc_info=error)
        self.rows[i].finish("error", self.events)

    def done_now(self) -> list[bool]:
        """Rows whose canvas ends at this step: done, or out of denoising steps."""
        cv = self.canvas
        return [d or n >= r.params.max_denoising_steps for d, n, r in zip(cv.done, cv.row_steps, self.rows)]


class Feature:
    """Every hook defaults to nothing. `name`: the option it serves (its SamplingParams field)."""

    name = ""
    requires: tuple[str, ...] = ()
    counters: tuple[Counter, ...] = ()
    needs: dict[str, Feature] = {}  # the features in `requires`, by name (`bind`)

    # ---- the row's slot -----------------------------------------------------------------------------------
    def of(self, req: Request) -> Any:
        """This feature's state on the row; None when the row does not carry it."""
        return req.state.get(self)

    def put(self, req: Request, value: Any) -> Any:
        req.state[self] = value
        return value

    def drop(self, req: Request) -> None:
        req.state.pop(self, None)

    # ---- the batch's hooks ------------------------------------------------------------------------------
    def attach(self, req: Request, engine) -> None:
        """A new request: set its state up (or refuse it)."""

    def wants_prefill(self, req: Request) -> bool:
        """This row reads its prompt's last hidden state (`prefilled`): a prefix-cache hit still encodes its last id."""
        return False

    def prefilled(self, rows: list[Request], hidden: Tensor, head: Head) -> None:
        """These rows' prompts are in their caches: hidden [B, H] is each prompt's last normed hidden state."""

    def start(self, rows: list[Request], tokens: Tensor, events: list[Event]) -> None:
        """A canvas starts for these rows: tokens [B, C] holds their fresh noise (edit it in place). Ids committed
        here (events) go out at once: that engine step runs no pass."""

    def start_sequence(self, req: Request) -> None:
        """The token-by-token engines (autoregressive, speculative): the request's answer starts."""

    def shape(self, p: Pass, model: DiffusionGemma) -> None:
        """Before the decoder pass: leave positions out of it (`Pass`), after moving work into the rows' caches."""

    def step(self, s: Step) -> None:
        """After the fused step, before the canvas takes `s.out`."""

    def after_step(self, s: Step) -> None:
        """After the canvas took the step: end rows (`s.canvas.mark_done`), report (`s.events`)."""

    # ---- the row's own commit (called by the Request, for the features holding a slot on it) --------------
    def visible(self, req: Request, ids: list[int]) -> list[int] | None:
        """The part of a canvas the row shows, when this feature decides it (a layout)."""
        return None

    def commit(self, req: Request, c: Commit) -> None:
        """The row commits a canvas: reshape what it appends, its logprobs, whether it ends the request."""

    def committed_early(self, req: Request) -> int:
        """Ids of the row's canvas this feature committed ahead of the canvas's end."""
        return 0

    def cached_early(self, req: Request) -> int:
        """Of those, ids already in the row's cache (the canvas's commit encodes only the rest)."""
        return 0


def bind(features: tuple[Feature, ...]) -> tuple[Feature, ...]:
    """Hand each feature the features it `requires` (each must come before it: their hooks run first)."""
    seen: dict[str, Feature] = {}
    for f in features:
        missing = [n for n in f.requires if n not in seen]
        if missing:
            raise ValueError(f"feature {f.name} requires {missing} earlier in the features")
        f.needs = {n: seen[n] for n in f.requires}
        seen[f.name] = f
    return features


def counters(features: tuple[Feature, ...]) -> tuple[Counter, ...]:
    """Every counter the features declare, once (two features may count the same work)."""
    by_name: dict[str, Counter] = {}
    for k in (k for f in features for k in f.counters):
        if by_name.setdefault(k.name, k) != k:
            raise ValueError(f"counter {k.name} declared twice with different units")
    return tuple(by_name.values())
