"""The KV cache the encoder writes and the decoder reads, for a batch of rows sharing one slot timeline.

Slots are absolute sequence indices shared by the batch; `valid` marks real (non-padding) tokens, and the host
knows that every slot from `padded_until` on is valid (so attention can skip the mask without reading `valid`).
Slots past `length` are scratch space: the decoder puts the canvas keys there and the next encoder commit
overwrites them. Full-attention layers keep every slot; with `room` (the most slots a pass adds in place: the
canvas), sliding-window layers keep a ring of window - 1 + room slots, so their memory stops growing past the
window (`store.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dgemma.cache.store import LinearStore, RingStore
from dgemma.config import TextConfig


class KVCache:
    def __init__(self, cfg: TextConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str,
                 room: int | None = None):
        self.cfg, self.room = cfg, room
        self.stores: list[LinearStore] = []
        for i in range(cfg.num_hidden_layers):
            spec = cfg.layer(i)
            args = (batch, spec.num_kv_heads, capacity, spec.head_dim, dtype, device)
            ring = spec.sliding and room is not None
            self.stores.append(RingStore(*args, ring=cfg.sliding_window - 1 + room) if ring else LinearStore(*args))
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.length = 0
        self.padded_until = 0  # slots below may be padding; slots from here to length are valid

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held (the valid flags, one byte a slot, left out)."""
        return sum(s.nbytes for s in self.stores)

    def ensure(self, needed: int) -> None:
        """Room for slots up to `needed` (amortised doubling; rings stop at their size)."""
        for s in self.stores:
            s.ensure(needed)
        if needed > self.capacity:
            self.valid = torch.nn.functional.pad(self.valid, (0, max(needed, 2 * self.capacity) - self.capacity))

    def reserve(self, n: int, valid: Tensor | None) -> int:
        """Claim `n` slots for new tokens (valid [B, n] or all valid); returns the first slot."""
        start = self.length
        self.ensure(start + n)
        self.valid[:, start:start + n] = True if valid is None else valid
        if valid is not None and not bool(valid.all()):  # one read per masked prefill, none per step
            self.padded_until = start + n
        self.length = start + n
        return start

    def has_padding(self, lo: int) -> bool:
        """Whether any slot from `lo` to `length` may be padding in some row (host state, no device read)."""
        return self.padded_until > lo

    def window_start(self, sliding: bool, start: int) -> int:
        """First cached slot visible to tokens added at `start`: sliding layers keep the last window - 1."""
        return max(0, start - self.cfg.sliding_window + 1) if sliding else 0

    def layout(self, sliding: bool, lo: int, start: int, n: int) -> tuple[int, Tensor | None]:
        """For a pass adding n slots at `start` that sees slots lo..: (the first slot among the keys `view`
        returns, their slot ids [S] in key order, or None when they are first..start+n in order)."""
        store = next(s for i, s in enumerate(self.stores) if self.cfg.layer(i).sliding == sliding)
        return store.layout(lo, start, n, self.valid.device)

    def view(self, layer: int, lo: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [B, kv_heads, n, D] at slots start..start+n; the keys and values the pass attends to."""
        return self.stores[layer].view(lo, start, k, v)

    def slice(self, layer: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """Slots lo..hi of a layer kept whole (training: the cache stays in the graph, nothing wraps)."""
        return self.stores[layer].slice(lo, hi)

    def select(self, rows: list[int]) -> None:
        """Keep only these batch rows (finished requests leave the batch)."""
        index = torch.tensor(rows, device=self.valid.device)
        for s in self.stores:
            s.select(index)
        self.valid = self.valid.index_select(0, index)

    @classmethod
    def merge(cls, caches: list[KVCache], capacity: int) -> tuple[KVCache, list[int]]:
        """Stack caches of different lengths right-aligned (left padding); returns the cache and each
        part's left-pad, so that a row's slot s holds its token s - pad."""
        first = caches[0]
        length = max(c.length for c in caches)
        batch = sum(c.batch_size for c in caches)
        out = cls(first.cfg, batch, max(capacity, length), first.stores[0].keys.dtype, first.valid.device, first.room)
        out.length = length
        out.padded_until = max(length - c.length + c.padded_until for c in caches)  # left pad, then each part's
        pads, row = [], 0
        for c in caches:
            pad = length - c.length
            rows = slice(row, row + c.batch_size)
            for dst, src in zip(out.stores, c.stores):
                lo, k, v = src.ordered(c.length)
                dst.put(pad + lo, k, v, rows)
            out.valid[rows, pad:length] = c.valid[:, :c.length]
            pads.extend([pad] * c.batch_size)
            row += c.batch_size
        return out, pads
