"""Early commit into the cache (`SamplingParams.early_commit_cache`): a row's early-committed prefix (early commit's,
which this feature requires) is encoded into the row's own KV cache before the next pass, as the canvas's commit
would encode it (the encoder is causal: those positions' keys and values do not depend on what follows them), and
the canvas's own commit encodes only the rest (`cached_early`, the row's slot). The pass then starts at the smallest
cached-early prefix among its rows; a row that cached more keeps the rest of its cached positions in the pass, hidden
from the canvas (`DiffusionGemma.denoise(hide=...)`), so that what it sees does not depend on its batch-mates. Every
early-committed position, cached or not yet, leaves the head work like a settled one (its previous outputs kept, its
entropy 0); the canvas's bookkeeping keeps its full width. Its cost: the ids of a last canvas it encoded
(`encoded_early`: the defaults never encode a last canvas)."""

from __future__ import annotations

import torch
from torch import Tensor

from dgemma.engine.batch import Canvas
from dgemma.engine.features.base import Counter, Feature
from dgemma.engine.request import Commit, Event, Request
from dgemma.engine.runner import Pass
from dgemma.model import DiffusionGemma

# Caching early is one more encoder pass (every weight read once more, however few its tokens): early-committed
# positions wait until they are at least 1 / CACHE_SHARE of the canvas (or the canvas ends without them).
CACHE_SHARE = 8


class EarlyCommitCache(Feature):
    name = "early_commit_cache"
    requires = ("early_commit",)
    counters = (Counter("skipped_head_rows", "vocab_row"), Counter("skipped_soft_rows", "vocab_row"),
                Counter("skipped_body_rows", "canvas_body_row"), Counter("encoded_early", "encoded_id", saves=False))

    def cached_early(self, req: Request) -> int:
        return self.of(req) or 0

    def start(self, rows: list[Request], tokens: Tensor, events: list[Event]) -> None:
        for r in rows:
            self.drop(r)

    def shape(self, p: Pass, model: DiffusionGemma) -> None:
        self._cache_early(p, model)
        self._narrow(p)

    def commit(self, req: Request, c: Commit) -> None:
        if c.finish is not None:  # its last canvas: what was cached early was encoded for it
            req.stats.add("encoded_early", self.cached_early(req))

    def _cache_early(self, p: Pass, model: DiffusionGemma) -> None:
        """Encode each opted-in live row's early-committed, not yet cached ids (its committed text) into its cache,
        rows with as many to cache together."""
        cv, rows, committed = p.canvas, p.rows, self.needs["early_commit"].committed_early
        least = max(1, cv.tokens.shape[1] // CACHE_SHARE)
        going: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            due = committed(r) - self.cached_early(r)
            if r.params.early_commit_cache and not r.finished and not cv.done[i] and due >= least:
                going.setdefault(due, []).append(i)
        for group in going.values():
            ids = torch.stack([cv.argmax[i, self.cached_early(rows[i]):committed(rows[i])] for i in group])
            model.encode(ids, [p.caches[i] for i in group])
            for i in group:
                self.put(rows[i], committed(rows[i]))

    def _narrow(self, p: Pass) -> None:
        """The pass runs on the positions no row cached early (from the smallest cached prefix; each row hides the
        rest of its own) and leaves every opted-in row's early-committed positions out of the head work (those not
        cached yet too: their head work decides nothing)."""
        cv, committed = p.canvas, self.needs["early_commit"].committed_early
        early = [committed(r) if r.params.early_commit_cache else 0 for r in p.rows]
        if not any(early):
            return
        cached = [self.cached_early(r) for r in p.rows]
        p.start = low = min(cached)
        p.hide = [m - low for m in cached]
        device = cv.tokens.device
        skip = torch.arange(cv.tokens.shape[1], device=device)[None] < torch.tensor(early, device=device)[:, None]
        _count(p.rows, cv, low, skip if p.skip is None else skip & ~p.skip)  # settled positions count already
        p.skip = skip if p.skip is None else skip | p.skip


def _count(rows: list[Request], cv: Canvas, low: int, skip: Tensor) -> None:
    """The work left out, for bench/flops.py: `low` positions of the body and the skipped ones' head and soft
    embedding, per row that stepped."""
    wanted_signal = not cv.last_step(rows)
    for r, done, n in zip(rows, cv.done, skip.sum(1).tolist()):
        if not done:
            r.stats.add("skipped_body_rows", low)
            r.stats.add("skipped_head_rows", n)
            r.stats.add("skipped_soft_rows", n * wanted_signal)
