"""The KV cache the encoder writes and the decoder reads, for a batch of rows sharing one slot timeline.

Slots are absolute sequence indices shared by the batch; `valid` marks real (non-padding) tokens, and the host
knows that every slot from `padded_until` on is valid (so attention can skip the mask without reading `valid`).
Slots past `length` are scratch space: the decoder puts the canvas keys there and the next encoder commit
overwrites them. Full-attention layers keep every slot; with `room` (the most slots a pass adds in place: the
canvas), sliding-window layers keep a ring of window - 1 + room slots, so their memory stops growing past the
window (`store.py`).

Sliding layers store keys and values; full-attention layers, which have no v_proj (their values are the v-normed
k_proj output, their keys the k-normed and rotated one), store k_proj's output alone, and `positions` [B, slots]
keeps each slot's rotary position so that the attention derives both, bit for bit, when it reads them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dgemma.cache import views
from dgemma.cache.store import Fields, LinearStore, RingStore
from dgemma.config import LayerSpec, TextConfig

POSITION_DTYPE = torch.int32


def fields(spec: LayerSpec) -> int:
    """Tensors a layer stores per slot: keys and values, or (full attention) k_proj's output alone."""
    return 2 if spec.sliding else 1


class KVCache:
    def __init__(self, cfg: TextConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str,
                 room: int | None = None):
        self.cfg, self.room = cfg, room
        self.stores: list[LinearStore] = []
        for i in range(cfg.num_hidden_layers):
            spec = cfg.layer(i)
            args = (batch, spec.num_kv_heads, capacity, spec.head_dim, dtype, device, fields(spec))
            ring = spec.sliding and room is not None
            self.stores.append(RingStore(*args, ring=cfg.sliding_window - 1 + room) if ring else LinearStore(*args))
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch, capacity, dtype=POSITION_DTYPE, device=device)
        self.length = 0
        self.padded_until = 0  # slots below may be padding; slots from here to length are valid
        self.held_from = 0  # rings hold slots held_from..length (older ones, or the decoder's scratch, overwrote)

    @staticmethod
    def bytes_for(cfg: TextConfig, tokens: int, dtype: torch.dtype, room: int | None) -> int:
        """Bytes one row of `tokens` slots holds (`nbytes`), computed without building it."""
        values = 0
        for i in range(cfg.num_hidden_layers):
            spec = cfg.layer(i)
            slots = min(tokens, cfg.sliding_window - 1 + room) if spec.sliding and room is not None else tokens
            values += fields(spec) * slots * spec.num_kv_heads * spec.head_dim
        per_slot = 1 + torch.empty(0, dtype=POSITION_DTYPE).element_size()  # valid flag and position
        return values * torch.empty(0, dtype=dtype).element_size() + tokens * per_slot

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held: the stores, the valid flags and the positions."""
        return sum(s.nbytes for s in self.stores) + self.valid.nbytes + self.positions.nbytes

    def ensure(self, needed: int) -> None:
        """Room for slots up to `needed` (amortised, see `LinearStore.ensure`; rings stop at their size)."""
        for s in self.stores:
            s.ensure(needed)
        if needed > self.capacity:
            grown = max(needed, self.capacity + self.capacity // 4)
            self.positions = torch.nn.functional.pad(self.positions, (0, grown - self.capacity))
            self.valid = torch.nn.functional.pad(self.valid, (0, grown - self.capacity))

    def reserve(self, n: int, valid: Tensor | None) -> int:
        """Claim `n` slots for new tokens (valid [B, n] or all valid); returns the first slot."""
        start = self.length
        self.ensure(start + n)
        self.valid[:, start:start + n] = True if valid is None else valid
        if valid is not None and not bool(valid.all()):  # one read per masked prefill, none per step
            self.padded_until = start + n
        self.length = start + n
        self._written(self.length)
        return start

    def place(self, start: int, positions: Tensor) -> None:
        """Record the rotary positions [B, n] of the tokens in slots start..start+n."""
        self.positions[:, start:start + positions.shape[1]] = positions

    def truncate(self, length: int) -> None:
        """Forget the slots from `length` on (speculative tokens the verifier rejected). Rings lose nothing a later
        token sees: what the rejected slots overwrote lay at least a window behind `length`."""
        oldest = self.length - self.room if self.room is not None else 0
        if not oldest <= length <= self.length:
            raise ValueError(f"can only forget the newest {self.room} slots (length {self.length}, asked {length})")
        self.length = length

    def scratch(self, n: int) -> None:
        """The decoder is about to put n keys in the slots after `length` (scratch, overwritten by the commit)."""
        self.ensure(self.length + n)
        self._written(self.length + n)

    def _written(self, hi: int) -> None:
        if self.room is not None:
            self.held_from = max(self.held_from, hi - (self.cfg.sliding_window - 1 + self.room))

    def has_padding(self, lo: int) -> bool:
        """Whether any slot from `lo` to `length` may be padding in some row (host state, no device read)."""
        return self.padded_until > lo

    def window_start(self, sliding: bool, start: int) -> int:
        """First cached slot visible to tokens added at `start`: sliding layers keep the last window - 1."""
        return max(0, start - self.cfg.sliding_window + 1) if sliding else 0

    def key_slots(self, sliding: bool, lo: int, start: int, n: int) -> tuple[int, Tensor | None]:
        """For a pass adding n slots at `start` that sees slots lo..: (the first slot among the keys `view`
        returns, their slot ids [S] in key order, or None when they are first..start+n in order)."""
        store = next(s for i, s in enumerate(self.stores) if self.cfg.layer(i).sliding == sliding)
        return store.key_slots(lo, start, n, self.valid.device)

    def encoder_span(self, start: int, n: int, sliding: bool, groups: Tensor | None = None,
                     rows_apart: bool = False) -> views.Span:
        """What the causal encoder's n new tokens at `start` see (`views.encoder_span`; `groups`: image runs)."""
        return views.encoder_span(self, start, n, sliding, groups, rows_apart)

    def decoder_span(self, n: int, sliding: bool, hide: int = 0) -> views.Span:
        """What a canvas of n tokens after the cached ones sees (`views.decoder_span`; `hide`: its first positions
        left out, as the cache holds them)."""
        return views.decoder_span(self, self.length, n, sliding, hide)

    def context_span(self, context: Tensor, n: int, sliding: bool) -> views.Span:
        """Training: what a canvas after each row's first context[b] cached tokens sees (`views.context_span`)."""
        return views.context_span(self, context, n, sliding)

    def view(self, layer: int, lo: int, start: int, *new: Tensor) -> Fields:
        """Store a layer's new tensors [B, kv_heads, n, D] (k, v or k_proj's output, see `fields`) at slots
        start..start+n; returns the tensors of the slots the pass attends to."""
        return self.stores[layer].view(lo, start, new)

    def read(self, layer: int, start: int, n: int) -> Fields:
        """A layer's stored tensors of slots start..start+n (held ones: the canvas's scratch)."""
        return self.stores[layer].read(start, n)

    def slice(self, layer: int, lo: int, hi: int) -> Fields:
        """Slots lo..hi of a layer kept whole (training: the cache stays in the graph, nothing wraps)."""
        return self.stores[layer].slice(lo, hi)

    def extract(self, row: int, lo: int, hi: int) -> KVCache:
        """Slots lo..hi of one row as a cache of its own (batch 1; slot lo becomes slot 0), ready to go on from
        hi: a request's own cache out of a batched prefill (lo: its left padding), or a prefix of it to keep or
        reuse; `holds(hi)` says whether the rings still hold what going on from hi needs."""
        if not self.holds(hi):
            raise ValueError(f"slots up to {hi} are no longer held (cache length {self.length})")
        out = KVCache(self.cfg, 1, hi - lo, self.stores[0].dtype, self.valid.device, self.room)
        for dst, src in zip(out.stores, self.stores):
            first, held = src.ordered(self.length, row)  # slots first..length, in order
            keep = max(first, lo, self.held_from if isinstance(src, RingStore) else 0)
            dst.put(keep - lo, tuple(t[:, :, keep - first:hi - first] for t in held))
        out.valid[:, :hi - lo] = self.valid[row:row + 1, lo:hi]
        out.positions[:, :hi - lo] = self.positions[row:row + 1, lo:hi]
        out.length = hi - lo
        out.padded_until = max(0, min(self.padded_until, hi) - lo)
        out.held_from = max(0, self.held_from - lo)
        if out.padded_until and bool(out.valid[:, :hi - lo].all()):
            out.padded_until = 0  # one read per extract: a row cut from a left-padded batch has none left
        return out

    def holds(self, hi: int) -> bool:
        """Whether every layer still holds the slots a pass going on from slot hi sees (rings keep only the
        newest slots)."""
        return hi <= self.length and max(0, self.window_start(True, hi)) >= self.held_from
