"""One layer's cached tensors for a batch of rows: a linear store (slot t at index t, grown on demand) or a
ring (slot t at index t % size) for sliding-window layers, which only ever read the last window - 1 slots plus
the ones a pass is adding.

A store holds `fields` tensors [B, kv_heads, slots, D] per layer: keys and values (sliding layers), or one
(full-attention layers, whose keys and values both derive from k_proj's output: the attention stores that alone
and derives them when it reads). `view(lo, start, *new)` stores the new tensors of slots start..start+n and
returns what a pass attends to: the slots lo..start+n, in slot order, except on a wrapped ring, where they come in
ring order (`key_slots` gives that order and the first slot returned, so that masks line up with the keys).
"""

from __future__ import annotations

import torch
from torch import Tensor

Fields = tuple[Tensor, ...]


class LinearStore:
    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device, fields: int = 2):
        shape = (batch, kv_heads, capacity, head_dim)
        self.data = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(fields)]

    @property
    def size(self) -> int:
        return self.data[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.data[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.data)

    def limit(self, needed: int) -> int:
        """How many indices `needed` slots take (all of them)."""
        return needed

    def ensure(self, needed: int) -> None:
        """Hold at least min(needed, limit) indices (amortised: at least a quarter more, so a long request's
        cache never holds more than 1.25x its length)."""
        needed = self.limit(needed)
        if needed > self.size:
            extra = self.limit(max(needed, self.size + self.size // 4)) - self.size
            self.data = [torch.nn.functional.pad(t, (0, 0, 0, extra)) for t in self.data]

    def put(self, start: int, new: Fields, rows: slice | None = None) -> None:
        """new: tensors [B, kv_heads, n, D] into slots start..start+n (of `rows` only, if given)."""
        rows = rows or slice(None)
        for t, x in zip(self.data, new, strict=True):
            t[rows, :, start:start + x.shape[2]] = x

    def key_slots(self, lo: int, start: int, n: int, device) -> tuple[int, Tensor | None]:
        return lo, None

    def view(self, lo: int, start: int, new: Fields) -> Fields:
        self.put(start, new)
        return self.slice(lo, start + new[0].shape[2])

    def slice(self, lo: int, hi: int) -> Fields:
        return tuple(t[:, :, lo:hi] for t in self.data)

    def read(self, start: int, n: int) -> Fields:
        """Slots start..start+n as last written (a canvas's scratch keys, reused for its settled positions)."""
        return self.slice(start, start + n)

    def ordered(self, length: int, row: int) -> tuple[int, Fields]:
        """(first slot, tensors) of one row's slots still held below `length`, in slot order."""
        return 0, tuple(t[row:row + 1, :, :length] for t in self.data)


class RingStore(LinearStore):
    """At most `ring` indices; a pass adding n slots at start writes them in place when every slot it sees
    (lo..start+n) still fits the ring afterwards, else attends to the held slots and the new ones joined."""

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device, fields: int = 2, *,
                 ring: int):
        self.ring = ring
        super().__init__(batch, kv_heads, min(capacity, ring), head_dim, dtype, device, fields)

    def limit(self, needed: int) -> int:
        return min(needed, self.ring)

    def _in_place(self, lo: int, start: int, n: int) -> bool:
        return start + n - self.ring <= lo

    def put(self, start: int, new: Fields, rows: slice | None = None) -> None:
        n = new[0].shape[2]
        if n > self.ring:  # only the last `ring` slots survive
            new, start, n = tuple(x[:, :, -self.ring:] for x in new), start + n - self.ring, self.ring
        p = start % self.ring
        first = min(n, self.ring - p)
        super().put(p, tuple(x[:, :, :first] for x in new), rows)
        if first < n:
            super().put(0, tuple(x[:, :, first:] for x in new), rows)

    def read(self, start: int, n: int) -> Fields:
        index = (torch.arange(start, start + n, device=self.data[0].device)) % self.ring
        return tuple(t[:, :, index] for t in self.data)

    def _slots(self, hi: int, device) -> Tensor:
        """Slot held at each index of a full ring whose newest slot is hi - 1."""
        return (torch.arange(self.ring, device=device) - hi) % self.ring + hi - self.ring

    def key_slots(self, lo: int, start: int, n: int, device) -> tuple[int, Tensor | None]:
        hi = start + n
        if self._in_place(lo, start, n):
            return (lo, None) if hi <= self.ring else (hi - self.ring, self._slots(hi, device))
        if start <= self.ring:
            return lo, None
        return start - self.ring, torch.cat([self._slots(start, device), torch.arange(start, hi, device=device)])

    def view(self, lo: int, start: int, new: Fields) -> Fields:
        n = new[0].shape[2]
        if self._in_place(lo, start, n):
            self.put(start, new)
            return self.slice(lo, start + n) if start + n <= self.ring else tuple(self.data)
        old = self.slice(lo, start) if start <= self.ring else tuple(self.data)
        joined = tuple(torch.cat([o, x], dim=2) for o, x in zip(old, new))
        self.put(start, new)
        return joined

    def ordered(self, length: int, row: int) -> tuple[int, Fields]:
        if length <= self.ring:
            return super().ordered(length, row)
        shift, one = -(length % self.ring), slice(row, row + 1)
        return length - self.ring, tuple(t[one].roll(shift, dims=2) for t in self.data)
