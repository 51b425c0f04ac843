"""Prefix cache: per-request KV caches of earlier prompts and answers, kept so that a request whose prompt starts
with the same tokens (the earlier turns of a chat, a shared system prompt) continues from a copy instead of
encoding them again; least recently used out first, within a byte budget.

Entries are private copies (`KVCache.extract`), and a hit hands out another copy, so requests sharing a prefix
never write into each other's memory. A prefix is usable up to any length its entry still holds (`holds`):
full-attention layers keep every slot, sliding-window rings only the newest, so a match shorter than its entry
is usable only within the entry's last `room` slots.

Entries live in partitions (a salt: the server's API key and the request's `cache_salt`): a lookup sees only
its own partition's entries, so no client can learn from a hit (its speed, or the counters) what another
partition's prompts were.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from dgemma.cache.kv import KVCache


def common_prefix(a: tuple[int, ...], b: tuple[int, ...] | list[int]) -> int:
    """Length of the longest common prefix of two id sequences: a binary search over slices, which Python compares
    in C (an id-by-id loop took ~8 ms a lookup for 100 entries sharing a 1,500-token system prompt, this ~2 ms)."""
    b = b if isinstance(b, tuple) else tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


Key = tuple[str | None, tuple[int, ...]]  # (partition, tokens)


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: OrderedDict[Key, KVCache] = OrderedDict()  # oldest use first
        self.bytes = 0
        self.lookups = self.hits = self.tokens_reused = self.evictions = 0

    def lookup(self, prompt: list[int], partition: str | None = None) -> tuple[KVCache | None, int]:
        """A private copy of the cache of the longest usable cached prefix of `prompt` in `partition`, and that
        prefix's length ((None, 0) when nothing matches)."""
        self.lookups += 1
        best, best_len, query = None, 0, tuple(prompt)
        for key, cache in self.entries.items():
            n = common_prefix(key[1], query) if key[0] == partition else 0
            if n > best_len and cache.holds(n):
                best, best_len = key, n
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        self.hits += 1
        self.tokens_reused += best_len
        return self.entries[best].extract(0, 0, best_len), best_len

    def store(self, tokens: list[int], cache: KVCache, partition: str | None = None) -> None:
        """Keep a copy of the slots of `cache` (one row) that hold `tokens`, its first ones, in `partition`; entries
        of that partition it makes redundant (prefixes it can stand in for) leave, then the least recently used of
        any partition until it fits. Larger than the budget: not kept."""
        key = (partition, tuple(tokens))
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if cache.length < len(tokens) or not cache.holds(len(tokens)):
            return
        copy = cache.extract(0, 0, len(tokens))
        if copy.nbytes > self.budget:
            return
        for old in [k for k in self.entries if k[0] == partition and len(k[1]) < len(tokens)
                    and key[1][:len(k[1])] == k[1] and copy.holds(len(k[1]))]:
            self._drop(old)
        while self.bytes + copy.nbytes > self.budget:
            self._drop(next(iter(self.entries)))
            self.evictions += 1
        self.entries[key] = copy
        self.bytes += copy.nbytes

    def extend(self, tokens: list[int], held: int, partition: str | None,
               encode: Callable[[KVCache, list[int]], None]) -> None:
        """Grow the entry for tokens[:held], if it is still kept, to all of `tokens`: `encode(cache, ids)` writes
        the missing ids into a copy of it, which replaces it. Not a lookup: no counter moves."""
        key = (partition, tuple(tokens[:held]))
        if key not in self.entries or held >= len(tokens):
            return
        cache = self.entries[key].extract(0, 0, held)
        encode(cache, tokens[held:])
        self.store(tokens, cache, partition)

    def _drop(self, key: Key) -> None:
        self.bytes -= self.entries.pop(key).nbytes
