"""Activation checkpointing per layer that keeps the encoder's KV-cache writes exact.

A checkpointed layer keeps only its input and reruns in backward to rebuild what it needs. The encoder pass also
writes the layer's keys and values into the KV cache that the decoder reads, inside the graph. transformers turns
the cache off under gradient checkpointing, which drops what the decoder must see; checkpointing the layer as it
is would write the cache a second time during the rerun, in the middle of backward, rewriting the cache's autograd
history after the decoder has read it. Here the rerunnable part writes into a private recorder and hands the keys
and values out as outputs; they enter the real cache once, outside the rerun, so the rerun neither loses nor
duplicates them, and the decoder's gradient reaches the encoder through them.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint


class _Recorder:
    """The KV cache as one checkpointed encoder layer sees it: reads the real cache, keeps its own writes."""

    def __init__(self, cache):
        self.cache = cache
        self.k = self.v = None
        self.start = 0

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v, self.start = k, v, start

    def slice(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots lo..hi = the cache's lo..start, then this layer's new keys / values (hi = start + new)."""
        if lo == self.start:
            return self.k, self.v
        keys, values = self.cache.slice(layer, lo, self.start)
        return torch.cat([keys, self.k], dim=2), torch.cat([values, self.v], dim=2)


def _checkpointed(forward, layer: int, x, rope, cache, start, span, encoder, write=True):
    """Block.forward, checkpointed when it records a graph; cache writes happen once, outside the rerun."""
    if not torch.is_grad_enabled():
        return forward(x, rope, cache, start, span, encoder, write)
    if not write:  # the training decoder: reads the cache, writes nothing
        return checkpoint(forward, x, rope, cache, start, span, encoder, False, use_reentrant=False)

    def rerunnable(x):
        recorder = _Recorder(cache)
        out = forward(x, rope, recorder, start, span, encoder, True)
        return out, recorder.k, recorder.v

    out, k, v = checkpoint(rerunnable, x, use_reentrant=False)
    cache.write(layer, start, k, v)
    return out


def enable(model: torch.nn.Module) -> None:
    """Checkpoint every layer of `model` (a DiffusionGemma, LoRA layers inside or not); before FSDP wraps it."""
    for block in model.layers:
        block.forward = functools.partial(_checkpointed, block.forward, block.self_attn.layer)
