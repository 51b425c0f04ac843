"""Which rows run (cf. nano-vllm's Scheduler; the engine runs the model): the waiting queue, admission up to
`max_batch` rows, each joining row's own cache (a copy of the longest prefix the `PrefixCache` holds plus the rest
of its prompt, or a prefill grouped by prompt length), and pruning of finished rows, whose prompts and answers go
to the prefix cache. A row's cache is its own, so joins and leaves never copy another row's."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dgemma.cache import KVCache, PrefixCache
from dgemma.engine.batch import Canvas, prefill
from dgemma.engine.request import Request
from dgemma.model import DiffusionGemma


@dataclass
class Batch:
    rows: list[Request]
    caches: list[KVCache]  # one per row
    pending: list[tuple[Request, torch.Tensor]] = field(default_factory=list)  # committed canvases [C] to encode
    canvas: Canvas | None = None


def prefill_groups(rows: list[Request], waste: float = 0.25) -> list[list[Request]]:
    """Rows admitted together, grouped for batched prefill: by prompt length, so that left padding adds at
    most `waste` of the group's real tokens."""
    rows = sorted(rows, key=lambda r: len(r.prompt))
    groups: list[list[Request]] = []
    for r in rows:
        g = groups[-1] if groups else None
        if g and len(r.prompt) * (len(g) + 1) <= (1 + waste) * (sum(len(q.prompt) for q in g) + len(r.prompt)):
            g.append(r)
        else:
            groups.append([r])
    return groups


class Scheduler:
    def __init__(self, model: DiffusionGemma, pad_id: int, max_batch: int, prefix_cache: PrefixCache | None):
        self.model, self.pad_id, self.max_batch, self.prefix_cache = model, pad_id, max_batch, prefix_cache
        self.waiting: list[Request] = []
        self.batch: Batch | None = None

    def admit(self) -> list[Request]:
        """Move waiting requests into the batch while there is room, each with its cache; returns them."""
        room = self.max_batch - (0 if self.batch is None else len(self.batch.rows))
        rows, self.waiting = self.waiting[:room], self.waiting[room:]
        if not rows:
            return []
        caches = {r.id: self._from_prefix(r) for r in rows} if self.prefix_cache is not None else {}
        canvas = self.model.cfg.canvas_length
        for group in prefill_groups([r for r in rows if caches.get(r.id) is None]):
            cache, pads = prefill(self.model, group, self.pad_id, 2 * canvas, own_positions=True)
            caches.update((r.id, cache.extract(i, pad, cache.length)) for i, (r, pad) in enumerate(zip(group, pads)))
        if self.prefix_cache is not None:
            for r in rows:
                self.prefix_cache.store(r.prompt, caches[r.id], r.params.cache_salt)
        if self.batch is None:
            self.batch = Batch([], [])
        self.batch.rows += rows
        self.batch.caches += [caches[r.id] for r in rows]
        return rows

    def prune(self) -> bool:
        """Drop finished rows from the batch (their caches go with them); False, and no batch, if none is left."""
        b = self.batch
        keep = [i for i, r in enumerate(b.rows) if not r.finished]
        if self.prefix_cache is not None:
            self._remember([(r, c) for r, c in zip(b.rows, b.caches) if r.finish_reason in ("stop", "length")])
        if not keep:
            self.batch = None
            return False
        if len(keep) < len(b.rows):
            index = torch.tensor(keep, device=self.model.device)
            b.rows, b.caches = [b.rows[i] for i in keep], [b.caches[i] for i in keep]
            if b.canvas is not None:
                b.canvas.select(index, keep)
        return True

    def _from_prefix(self, r: Request) -> KVCache | None:
        cache, n = self.prefix_cache.lookup(r.prompt, r.params.cache_salt)
        if cache is not None:
            r.stats.t_start, r.stats.cached_tokens = time.perf_counter(), n
            if n < len(r.prompt):
                self.model.prefill(torch.tensor([r.prompt[n:]], device=self.model.device), cache)
        return cache

    def _remember(self, finished: list[tuple[Request, KVCache]]) -> None:
        """Keep finished requests' prompts and answers for later turns: the answer's last canvas (never encoded
        while decoding) is encoded first, up to the answer's end."""
        for r, cache in finished:
            tokens = r.prompt + r.output
            if len(tokens) > cache.length:
                self.model.encode(torch.tensor([tokens[cache.length:]], device=self.model.device), cache)
            self.prefix_cache.store(tokens, cache, r.params.cache_salt)
