"""Which rows and positions run (cf. nano-vllm's Scheduler; the model runner runs them, engine/runner.py): the waiting
queue, admission up to `max_batch` rows, each joining row's own cache (a copy of the longest prefix the `PrefixCache`
holds plus the rest of its prompt, or a prefill grouped by prompt length; with the policy's `chunk`, a prompt longer
than that is encoded one chunk per engine step, so that it never stalls the running rows for longer; the features
hear of each prompt's last hidden state, `Feature.prefilled`), pruning of finished rows, whose prompts and answers go
to the prefix cache as far as their caches hold them (a copy: the answer's last canvas was never encoded; `tidy`,
once the engine is idle, encodes those last canvases, so that this never delays a request), the turnover between
canvases under a policy (`RowClocks`, `BatchWide`), and each step's `Pass` as the features shape it. A row's cache
is its own, so joins and leaves never copy another row's."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dgemma.cache import KVCache, PrefixCache
from dgemma.engine.batch import Canvas, prefill
from dgemma.engine.features import Feature
from dgemma.engine.request import Event, Request
from dgemma.engine.runner import Pass
from dgemma.model import DiffusionGemma
from dgemma.model.diffusion_gemma import PREFILL_CHUNK
from dgemma.sampling import random_tokens


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


class RowClocks:
    """Each row on its own clock (the default): a row whose canvas is done commits it at once, and at the next step
    its canvas is encoded into its cache and its next canvas starts beside the others'; requests join at every step,
    and a long prompt is encoded a chunk per step."""

    chunk: int | None = PREFILL_CHUNK

    def turnover(self, batch: Batch | None) -> bool:
        """Rows leave, go on and join at this step."""
        return True

    def to_commit(self, rows: list[Request], cv: Canvas) -> tuple[list[int], bool]:
        """The rows that commit now, and whether the batch's canvas ends with them (every row starts anew)."""
        return [i for i, (d, r) in enumerate(zip(cv.done, rows)) if d and not r.finished], False


class BatchWide(RowClocks):
    """The batch moves from canvas to canvas together (kept to compare: benchmarks/row_clocks.py): done rows stay
    frozen in the pass until every row is done, then all commit; requests join only at that boundary, their prompts
    encoded whole."""

    chunk = None

    def turnover(self, batch: Batch | None) -> bool:
        return batch is None or batch.canvas is None

    def to_commit(self, rows: list[Request], cv: Canvas) -> tuple[list[int], bool]:
        done = cv.all_done(rows, finished_rows_count=False)
        return (list(range(len(rows))) if done else []), done


class Scheduler:
    def __init__(self, model: DiffusionGemma, pad_id: int, max_batch: int, prefix_cache: PrefixCache | None,
                 features: tuple[Feature, ...] = (), policy: RowClocks = RowClocks()):
        self.model, self.pad_id, self.max_batch, self.prefix_cache = model, pad_id, max_batch, prefix_cache
        self.features, self.policy, self.chunk = features, policy, policy.chunk
        self.waiting: list[Request] = []
        self.prefilling: list[tuple[Request, KVCache]] = []  # long prompts, encoded a chunk per step
        self.batch: Batch | None = None
        self.owed: list[tuple[str | None, list[int], int]] = []  # finished (partition, prompt + answer, ids cached)

    def schedule(self, events: list[Event]) -> Pass | None:
        """This step's pass: after the policy's turnover, the running rows' canvases, as the features shape it.
        None when no pass runs: no rows, a turnover whose starting canvases committed ids (they go out at once), or
        only aborted rows left."""
        if self.policy.turnover(self.batch):
            self._turnover(events)
        if events or self.batch is None:
            return None
        t, b = time.perf_counter(), self.batch
        if any(r.finished for r in b.rows) and not self.prune():
            return None  # aborted rows leave mid-canvas, so they stop costing compute
        p = Pass(b.rows, b.canvas, b.caches, t)
        for f in self.features:
            f.shape(p, self.model)
        return p

    # ---- between canvases -------------------------------------------------------------------------------
    def _turnover(self, events: list[Event]) -> None:
        """Rows that committed a canvas go on (finished ones leave; the others' canvases are encoded and their
        next ones start), and waiting requests join with a fresh canvas."""
        b = self.batch
        going_on = self._encode_pending(b) if b is not None and b.pending and self.prune() else []
        joined = self.admit()
        if (b := self.batch) is None:
            return
        if b.canvas is None:  # a new batch, or the batch-wide boundary: every row starts
            b.canvas = self._fresh(b.rows, events)
            return
        if going_on:
            b.canvas.put(going_on, self._fresh([b.rows[i] for i in going_on], events))
        if joined:
            b.canvas.extend(self._fresh(joined, events))

    def _encode_pending(self, b: Batch) -> list[int]:
        """Encode the committed canvases of the rows still in the batch (what the features did not move into their
        caches already), rows with as many ids together; returns their indices."""
        at = {id(r): i for i, r in enumerate(b.rows)}
        going = [(at[id(r)], ids) for r, ids in b.pending if id(r) in at]
        b.pending = []
        for n in sorted({len(ids) for _, ids in going}):
            group = [(i, ids) for i, ids in going if len(ids) == n]
            self.model.encode(torch.stack([ids for _, ids in group]), [b.caches[i] for i, _ in group])
        return [i for i, _ in going]

    def _fresh(self, rows: list[Request], events: list[Event]) -> Canvas:
        """A new canvas for these rows: noise from each row's generator, then the features' start."""
        cfg = self.model.cfg
        tokens = random_tokens((len(rows), cfg.canvas_length), cfg.text.vocab_size, self.model.device,
                               [r.generator for r in rows])
        for f in self.features:
            f.start(rows, tokens, events)
        return Canvas.start(rows, tokens)

    def _prefilled(self, rows: list[Request], hidden: torch.Tensor) -> None:
        for f in self.features:
            f.prefilled(rows, hidden, self.model.lm_head)

    # ---- admission and pruning --------------------------------------------------------------------------
    def admit(self) -> list[Request]:
        """Move requests into the batch while there is room, each with its cache; returns them."""
        room = self.max_batch - (0 if self.batch is None else len(self.batch.rows)) - len(self.prefilling)
        rows, self.waiting = self.waiting[:room], self.waiting[room:]
        caches = {r.id: self._from_prefix(r) for r in rows} if self.prefix_cache is not None else {}
        fresh = [r for r in rows if caches.get(r.id) is None]
        long = {r.id for r in fresh if self.chunk is not None and len(r.prompt) > self.chunk}
        self.prefilling += [(r, self._start_prefill(r)) for r in fresh if r.id in long]
        for group in prefill_groups([r for r in fresh if r.id not in long]):
            cache, pads, hidden = prefill(self.model, group, self.pad_id, 2 * self.model.cfg.canvas_length,
                                          own_positions=True)
            self._prefilled(group, hidden)
            caches.update((r.id, cache.extract(i, pad, cache.length)) for i, (r, pad) in enumerate(zip(group, pads)))
        joined = [r for r in rows if r.id not in long] + self._prefill_chunks(caches)
        for r in joined:
            r.image_features = ()  # the prompt is in its cache: its images' features may go
        if self.prefix_cache is not None:
            for r in joined:
                self.prefix_cache.store(r.prompt, caches[r.id], r.params.cache_salt)
        if joined and self.batch is None:
            self.batch = Batch([], [])
        if joined:
            self.batch.rows += joined
            self.batch.caches += [caches[r.id] for r in joined]
        return joined

    def _start_prefill(self, r: Request) -> KVCache:
        r.stats.t_start = time.perf_counter()
        return self.model.new_cache(1, len(r.prompt) + 2 * self.model.cfg.canvas_length)

    def _prefill_chunks(self, caches: dict[str, KVCache]) -> list[Request]:
        """One chunk of each long prompt being encoded (aborted ones dropped); returns the requests whose prompt
        is now whole in their cache (put in `caches`)."""
        done, going = [], []
        for r, cache in self.prefilling:
            if r.finished:
                continue
            part = r.prompt[cache.length:cache.length + self.chunk]
            hidden = self.model.prefill(torch.tensor([part], device=self.model.device), cache, chunk=None)
            if cache.length == len(r.prompt):
                self._prefilled([r], hidden)
                caches[r.id] = cache.extract(0, 0, cache.length)
                done.append(r)
            else:
                going.append((r, cache))
        self.prefilling = going
        return done

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
        """The request's cache from the longest cached prefix of its prompt, the rest encoded; at least the last
        prompt token is encoded for a request whose features read its prompt's last hidden state."""
        prompt = r.prompt[:-1] if any(f.wants_prefill(r) for f in self.features) else r.prompt
        cache, n = self.prefix_cache.lookup(prompt, r.params.cache_salt)
        if cache is not None:
            r.stats.t_start, r.stats.cached_tokens = time.perf_counter(), n
            if n < len(r.prompt):
                hidden = self.model.prefill(torch.tensor([r.prompt[n:]], device=self.model.device), cache)
                self._prefilled([r], hidden)
        return cache

    def tidy(self) -> bool:
        """Encode the last canvas of one answer `_remember` kept, the newest (idle-time work): its entry grows to
        the whole answer, unless it has left the prefix cache or a next turn's prompt replaced it. True while
        more is owed."""
        if self.owed:
            partition, tokens, held = self.owed.pop()
            self.prefix_cache.extend(tokens, held, partition, self._encode_into)
        return bool(self.owed)

    def _encode_into(self, cache: KVCache, ids: list[int]) -> None:
        self.model.encode(torch.tensor([ids], device=self.model.device), cache)

    def _remember(self, finished: list[tuple[Request, KVCache]]) -> None:
        """Keep finished requests' prompts and answers for later turns, as far as their caches hold them: a copy
        without model work. What the cache lacks (the answer's last canvas, never encoded while decoding) is owed
        to `tidy`; the newest `max_batch` debts are kept."""
        for r, cache in finished:
            tokens = r.prompt + r.output
            self.prefix_cache.store(tokens[:cache.length], cache, r.params.cache_salt)
            if len(tokens) > cache.length:
                self.owed.append((r.params.cache_salt, tokens, cache.length))
        del self.owed[:-self.max_batch]
