"""Prefix cache: per-request KV caches of earlier prompts and answers, kept so that a request whose prompt starts
with the same tokens (the earlier turns of a chat, a shared system prompt) continues from a copy instead of
encoding them again; least recently used out first, within a byte budget.

Entries are private copies (`KVCache.extract`), and a hit hands out another copy, so requests sharing a prefix
never write into each other's memory. A prefix is usable up to any length its entry still holds (`holds`):
full-attention layers keep every slot, sliding-window rings only the newest, so a match shorter than its entry
is usable only within the entry's last `room` slots.
"""

from __future__ import annotations

from collections import OrderedDict

from dgemma.cache.kv import KVCache


def common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: OrderedDict[tuple[int, ...], KVCache] = OrderedDict()  # oldest use first
        self.bytes = 0
        self.lookups = self.hits = self.tokens_reused = self.evictions = 0

    def lookup(self, prompt: list[int]) -> tuple[KVCache | None, int]:
        """A private copy of the cache of the longest usable cached prefix of `prompt`, and that prefix's length
        ((None, 0) when nothing matches)."""
        self.lookups += 1
        best, best_len = None, 0
        for tokens, cache in self.entries.items():
            n = common_prefix(tokens, prompt)
            if n > best_len and cache.holds(n):
                best, best_len = tokens, n
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        self.hits += 1
        self.tokens_reused += best_len
        return self.entries[best].extract(0, 0, best_len), best_len

    def store(self, tokens: list[int], cache: KVCache) -> None:
        """Keep a copy of `cache` (one row holding exactly `tokens`); entries it makes redundant (prefixes it can
        stand in for) leave, then the least recently used until it fits. Larger than the budget: not kept."""
        key = tuple(tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if cache.length != len(key) or not cache.holds(len(key)):
            return
        copy = cache.extract(0, 0, len(key))
        if copy.nbytes > self.budget:
            return
        for old in [k for k in self.entries if len(k) < len(key) and key[:len(k)] == k and copy.holds(len(k))]:
            self._drop(old)
        while self.bytes + copy.nbytes > self.budget:
            self._drop(next(iter(self.entries)))
            self.evictions += 1
        self.entries[key] = copy
        self.bytes += copy.nbytes

    def _drop(self, key: tuple[int, ...]) -> None:
        self.bytes -= self.entries.pop(key).nbytes
