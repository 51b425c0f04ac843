"""Preallocated KV cache written by the encoder and read by the decoder.

Slots are absolute sequence indices shared by the batch; `valid` marks real (non-padding) tokens, and the host
knows that every slot from `padded_until` on is valid (so attention can skip the mask without reading `valid`).
Slots past `length` are scratch space: the decoder puts the canvas keys there so that attention reads one
contiguous slice, and the next encoder commit overwrites them.
"""

from __future__ import annotations

import torch

from dgemma.config import TextConfig


class KVCache:
    def __init__(self, cfg: TextConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str):
        self.cfg = cfg
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for i in range(cfg.num_hidden_layers):
            spec = cfg.layer(i)
            shape = (batch, spec.num_kv_heads, capacity, spec.head_dim)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.length = 0
        self.padded_until = 0  # slots below may be padding; slots from here to length are valid

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def ensure(self, needed: int) -> None:
        """Grow the slot dimension to at least `needed` (amortised doubling)."""
        if needed <= self.capacity:
            return
        extra = max(needed, 2 * self.capacity) - self.capacity
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, extra))  # noqa: E731
        self.keys = [pad(k) for k in self.keys]
        self.values = [pad(v) for v in self.values]
        self.valid = torch.nn.functional.pad(self.valid, (0, extra))

    def reserve(self, n: int, valid: torch.Tensor | None) -> int:
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

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, kv_heads, n, head_dim] into slots start..start+n."""
        n = k.shape[2]
        self.keys[layer][:, :, start:start + n] = k
        self.values[layer][:, :, start:start + n] = v

    def window_start(self, sliding: bool, start: int) -> int:
        """First cached slot visible to tokens added at `start`: sliding layers keep the last window - 1."""
        return max(0, start - self.cfg.sliding_window + 1) if sliding else 0

    def slice(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][:, :, lo:hi], self.values[layer][:, :, lo:hi]

    def select(self, rows: list[int]) -> None:
        """Keep only these batch rows (finished requests leave the batch)."""
        index = torch.tensor(rows, device=self.valid.device)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.valid = self.valid.index_select(0, index)

    @classmethod
    def merge(cls, caches: list[KVCache], capacity: int) -> tuple[KVCache, list[int]]:
        """Stack caches of different lengths right-aligned (left padding); returns the cache and each
        part's left-pad, so that a row's slot s holds its token s - pad."""
        first = caches[0]
        length = max(c.length for c in caches)
        batch = sum(c.batch_size for c in caches)
        out = cls(first.cfg, batch, max(capacity, length), first.keys[0].dtype, first.valid.device)
        out.length = length
        out.padded_until = max(length - c.length + c.padded_until for c in caches)  # left pad, then each part's
        pads, row = [], 0
        for c in caches:
            pad = length - c.length
            rows = slice(row, row + c.batch_size)
            for layer in range(len(out.keys)):
                out.keys[layer][rows, :, pad:length] = c.keys[layer][:, :, :c.length]
                out.values[layer][rows, :, pad:length] = c.values[layer][:, :, :c.length]
            out.valid[rows, pad:length] = c.valid[:, :c.length]
            pads.extend([pad] * c.batch_size)
            row += c.batch_size
        return out, pads
