"""Image soft tokens in a prompt's ids: each image's features get ids past the vocabulary, so the engine, batching,
prompt limits and the prefix cache handle an image prompt as the ids they already handle (one id per soft token),
and two different images never share ids (a prefix cached for one image is never reused for another).

An image's ids are a fresh range on first sight, the same range while its features stay here (identical pixels in
the same partition: the same key, so repeated turns of a chat reuse their cached prefix); ranges are never reused,
so an id whose features are gone is an error, never another image's features. The cache keeps features least
recently used first within a byte budget; a prompt holds its own images' features (`HeldIds`), so a request's
features stay placeable until its prompt is encoded, whatever the cache evicts meanwhile.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Callable

import torch

from dgemma.errors import DgemmaError

BUDGET_BYTES = 256 << 20


class HeldIds(list):
    """A prompt's ids together with its images' features [n, H] (strong references: while the prompt is alive
    they are, evicted from the cache or not)."""

    def __init__(self, ids: list[int], held: tuple[torch.Tensor, ...]):
        super().__init__(ids)
        self.held = held


class SoftTokens:
    def __init__(self, vocab_size: int, budget_bytes: int = BUDGET_BYTES):
        self.vocab = vocab_size
        self.budget = budget_bytes
        self.next_id = vocab_size
        self.entries: OrderedDict[str, tuple[int, torch.Tensor]] = OrderedDict()  # key -> (first id, [n, H])
        # first id -> features, for every image whose features someone holds (the cache above, or a prompt)
        self.live: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self.bytes = 0
        self.lock = threading.Lock()  # prompts are built (ids) on other threads than the engine's (place)

    def __bool__(self) -> bool:
        return bool(self.live)

    def ids(self, key: str, features: Callable[[], torch.Tensor]) -> tuple[list[int], torch.Tensor]:
        """The ids of the image `key` and its features [n, H] (computed with `features()` on first sight); whoever
        keeps the features keeps the ids placeable."""
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return _range(*self.entries[key])
        feats = features()
        with self.lock:
            if key in self.entries:  # another thread added it meanwhile
                return _range(*self.entries[key])
            base = self.next_id
            self.entries[key] = (base, feats)
            self.live[base] = feats
            self.next_id += feats.shape[0]
            self.bytes += feats.nbytes
            while self.bytes > self.budget and len(self.entries) > 1:
                self.bytes -= self.entries.popitem(last=False)[1][1].nbytes
        return _range(base, feats)

    def adopt(self, ids: list[int], held: tuple[torch.Tensor, ...]) -> None:
        """Place another process's image ids: each run of soft-token ids in `ids`, in order, gets the features of
        `held` in order (a prompt made on tensor-parallel rank 0, whose features travel with it); whoever holds
        `held` keeps them placeable, as with `HeldIds`."""
        runs = [t for i, t in enumerate(ids) if t >= self.vocab and (i == 0 or ids[i - 1] != t - 1)]
        if len(runs) != len(held):
            raise DgemmaError(f"{len(runs)} runs of image ids but {len(held)} images' features")
        with self.lock:
            for base, feats in zip(runs, held):
                self.live[base] = feats
                self.next_id = max(self.next_id, base + feats.shape[0])

    def check(self, ids: list[int]) -> None:
        """Refuse ids past the vocabulary whose features are gone (the request's own error, before it runs)."""
        if not ids or max(ids) < self.vocab:
            return
        wanted = {t for t in ids if t >= self.vocab}
        with self.lock:
            ranges = [(base, base + f.shape[0]) for base, f in self.live.items()]
        if any(not any(lo <= t < hi for lo, hi in ranges) for t in wanted):
            raise DgemmaError("the prompt has image soft-token ids whose features are gone; send the image again")

    def text_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids with every soft-token id replaced by 0, for the embedding lookup."""
        return ids.masked_fill(ids >= self.vocab, 0)

    def place(self, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """embeds [B, L, H] of ids [B, L] with each soft-token position's row replaced by its image feature."""
        flat = ids.reshape(-1)
        where = (flat >= self.vocab).nonzero().squeeze(1)
        if where.numel() == 0:
            return embeds
        out = embeds.clone()
        rows, wanted, found = out.view(-1, out.shape[-1]), flat[where], 0
        with self.lock:
            entries = list(self.live.items())
        for base, feats in entries:
            hit = (wanted >= base) & (wanted < base + feats.shape[0])
            if bool(hit.any()):
                rows[where[hit]] = feats[wanted[hit] - base].to(out.dtype)
                found += int(hit.sum())
        if found != where.numel():
            raise DgemmaError("an image's soft tokens were evicted before its prompt was encoded; send it again")
        return out

    def groups(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, L] the index of the run of soft tokens each position belongs to (-1: text), as the reference
        numbers its vision blocks: a run is a maximal stretch of consecutive soft tokens."""
        image = ids >= self.vocab
        starts = image & ~torch.cat([image.new_zeros(image.shape[0], 1), image[:, :-1]], dim=1)
        return torch.where(image, starts.long().cumsum(1) - 1, -1)


def _range(base: int, feats: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    return list(range(base, base + feats.shape[0])), feats


def chunk_bounds(image: torch.Tensor, step: int) -> list[int]:
    """Ends of prefill chunks of about `step` tokens over rows whose soft-token positions are image [B, n] (host
    bools) such that no run of soft tokens is split: a run's tokens see each other, so it is encoded in one pass."""
    n = image.shape[1]
    inside = (image[:, 1:] & image[:, :-1]).any(0).tolist()  # inside[i]: cutting before i + 1 splits a run
    bounds, lo = [], 0
    while lo < n:
        hi = min(lo + step, n)
        back = hi
        while back > lo and back < n and inside[back - 1]:
            back -= 1
        if back == lo:  # a run longer than the chunk from lo: extend to its end
            while hi < n and inside[hi - 1]:
                hi += 1
        else:
            hi = back
        bounds.append(hi)
        lo = hi
    return bounds
