"""One layer's keys and values for a batch of rows: a linear store (slot t at index t, grown on demand) or a
ring (slot t at index t % size) for sliding-window layers, which only ever read the last window - 1 slots plus
the ones a pass is adding.

`view(lo, start, k, v)` stores the keys of slots start..start+n and returns what a pass attends to: the slots
lo..start+n, in slot order, except on a wrapped ring, where they come in ring order (`layout` gives that order
and the first slot returned, so that masks line up with the keys).
"""

from __future__ import annotations

import torch
from torch import Tensor


class LinearStore:
    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device):
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def size(self) -> int:
        return self.keys.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def limit(self, needed: int) -> int:
        """How many indices `needed` slots take (all of them)."""
        return needed

    def ensure(self, needed: int) -> None:
        """Hold at least min(needed, limit) indices (amortised: at least a quarter more, so a long request's
        cache never holds more than 1.25x its length)."""
        needed = self.limit(needed)
        if needed > self.size:
            extra = self.limit(max(needed, self.size + self.size // 4)) - self.size
            pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, extra))  # noqa: E731
            self.keys, self.values = pad(self.keys), pad(self.values)

    def put(self, start: int, k: Tensor, v: Tensor, rows: slice | None = None) -> None:
        """k, v [B, kv_heads, n, D] into slots start..start+n (of `rows` only, if given)."""
        rows = rows or slice(None)
        self.keys[rows, :, start:start + k.shape[2]] = k
        self.values[rows, :, start:start + k.shape[2]] = v

    def layout(self, lo: int, start: int, n: int, device) -> tuple[int, Tensor | None]:
        return lo, None

    def view(self, lo: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.put(start, k, v)
        return self.slice(lo, start + k.shape[2])

    def slice(self, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        return self.keys[:, :, lo:hi], self.values[:, :, lo:hi]

    def ordered(self, length: int, row: int) -> tuple[int, Tensor, Tensor]:
        """(first slot, keys, values) of one row's slots still held below `length`, in slot order."""
        return 0, self.keys[row:row + 1, :, :length], self.values[row:row + 1, :, :length]


class RingStore(LinearStore):
    """At most `ring` indices; a pass adding n slots at start writes them in place when every slot it sees
    (lo..start+n) still fits the ring afterwards, else attends to the held slots and the new keys joined."""

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device, ring: int):
        self.ring = ring
        super().__init__(batch, kv_heads, min(capacity, ring), head_dim, dtype, device)

    def limit(self, needed: int) -> int:
        return min(needed, self.ring)

    def _in_place(self, lo: int, start: int, n: int) -> bool:
        return start + n - self.ring <= lo

    def put(self, start: int, k: Tensor, v: Tensor, rows: slice | None = None) -> None:
        n = k.shape[2]
        if n > self.ring:  # only the last `ring` slots survive
            k, v, start, n = k[:, :, -self.ring:], v[:, :, -self.ring:], start + n - self.ring, self.ring
        p = start % self.ring
        first = min(n, self.ring - p)
        super().put(p, k[:, :, :first], v[:, :, :first], rows)
        if first < n:
            super().put(0, k[:, :, first:], v[:, :, first:], rows)

    def _slots(self, hi: int, device) -> Tensor:
        """Slot held at each index of a full ring whose newest slot is hi - 1."""
        return (torch.arange(self.ring, device=device) - hi) % self.ring + hi - self.ring

    def layout(self, lo: int, start: int, n: int, device) -> tuple[int, Tensor | None]:
        hi = start + n
        if self._in_place(lo, start, n):
            return (lo, None) if hi <= self.ring else (hi - self.ring, self._slots(hi, device))
        if start <= self.ring:
            return lo, None
        return start - self.ring, torch.cat([self._slots(start, device), torch.arange(start, hi, device=device)])

    def view(self, lo: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        n = k.shape[2]
        if self._in_place(lo, start, n):
            self.put(start, k, v)
            return self.slice(lo, start + n) if start + n <= self.ring else (self.keys, self.values)
        old_k, old_v = self.slice(lo, start) if start <= self.ring else (self.keys, self.values)
        keys, values = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        self.put(start, k, v)
        return keys, values

    def ordered(self, length: int, row: int) -> tuple[int, Tensor, Tensor]:
        if length <= self.ring:
            return super().ordered(length, row)
        shift, one = -(length % self.ring), slice(row, row + 1)
        return length - self.ring, self.keys[one].roll(shift, dims=2), self.values[one].roll(shift, dims=2)
