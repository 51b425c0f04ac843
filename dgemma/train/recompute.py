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
        self.new: tuple[torch.Tensor, ...] = ()

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    def view(self, layer: int, lo: int, start: int, *new: torch.Tensor):
        """What `KVCache.view` returns (slots lo..start of the cache, then the new tensors), unwritten."""
        self.new = new
        if lo == start:
            return new
        return tuple(torch.cat([old, t], dim=2) for old, t in zip(self.cache.slice(layer, lo, start), new))


def _checkpointed(forward, layer: int, x, rope, parts, encoder, write=True, keep=None):
    """Block.forward, checkpointed when it records a graph; cache writes happen once, outside the rerun. `keep`
    (settled keys/values reused) is an inference option, so a recorded graph never has one."""
    if not torch.is_grad_enabled() or keep is not None:
        return forward(x, rope, parts, encoder, write, keep)
    if not write:  # the training decoder: reads the cache, writes nothing
        return checkpoint(forward, x, rope, parts, encoder, False, use_reentrant=False)

    def rerunnable(x):
        recorders = [_Recorder(part.cache) for part in parts]
        out = forward(x, rope, [part._replace(cache=r) for part, r in zip(parts, recorders)], encoder, True)
        return (out, *[t for r in recorders for t in r.new])

    out, *new = checkpoint(rerunnable, x, use_reentrant=False)
    per_part = len(new) // len(parts)  # the tensors a layer stores per part: the same for every part
    for i, part in enumerate(parts):
        part.cache.view(layer, part.start, part.start, *new[i * per_part:(i + 1) * per_part])
    return out


def enable(model: torch.nn.Module) -> None:
    """Checkpoint every layer of `model` (a DiffusionGemma, LoRA layers inside or not); before FSDP wraps it."""
    for block in model.layers:
        block.forward = functools.partial(_checkpointed, block.forward, block.self_attn.layer)
