"""The tied embedding and LM head, the one way from ids to embeddings and from hidden states to logits:
softcap * tanh(h . E / softcap) in float32, for any rows, with a dense or a quantized embedding (a quantized one runs
its own `linear` / `linear_t`, never a decoded copy of the whole matrix); its transpose, the self-conditioning soft
embedding; the embedding's vocabulary blocks that the fused denoising step (sampling/fused.py) streams through in
the same GEMM dtype; and, under tensor parallelism, this rank's `VocabShard` of the vocabulary: lookups summed over
the ranks, logits gathered from them (so every caller of `logits` sees the whole vocabulary)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dgemma.model.layers import all_gather, all_reduce, matmul
from dgemma.quant import QuantizedWeight


@dataclass(frozen=True)
class VocabShard:
    """This rank's embedding rows lo..hi of a `vocab`-entry vocabulary split evenly over the process group."""

    lo: int
    hi: int
    vocab: int
    group: object

    @property
    def rank(self) -> int:
        return self.lo // (self.hi - self.lo)

    def local(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(ids [...] as rows of this shard, clamped into it; whether this shard holds them)."""
        return (ids - self.lo).clamp(0, self.hi - self.lo - 1), (ids >= self.lo) & (ids < self.hi)

    def gather(self, x: Tensor) -> Tensor:
        """x [..., hi - lo] of every rank, side by side: [..., vocab]."""
        return all_gather(x, self.group).movedim(0, -2).flatten(-2)


class Head:
    """Reads the embedding module's current weight on every call, so a loader that swaps in a quantized weight (or
    `+a8` packing) is seen without rebuilding the head."""

    def __init__(self, embed: nn.Embedding, softcap: float | None, scale: float):
        self.embed, self.softcap, self.scale = embed, softcap, scale
        self.shard: VocabShard | None = None  # dgemma/parallel sets it when it keeps this rank's rows

    @property
    def weight(self) -> Tensor | QuantizedWeight:
        return self.embed.weight

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0] if self.shard is None else self.shard.vocab

    def rows(self, ids: Tensor) -> Tensor:
        """E[ids] [..., H] (the input lookup); under tensor parallelism each rank's rows, zeros for the other
        ranks' ids, summed over the ranks (Megatron's vocabulary-parallel embedding)."""
        if self.shard is None:
            return _lookup(self.weight, ids)
        local, mine = self.shard.local(ids)
        return all_reduce(_lookup(self.weight, local).masked_fill_(~mine[..., None], 0), self.shard.group)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> float32 logits [..., V] (of the whole vocabulary under tensor parallelism too)."""
        w = self.weight
        logits = (w.linear(hidden) if isinstance(w, QuantizedWeight) else matmul(hidden, w.T)).float()
        if self.softcap and torch.is_grad_enabled() and logits.requires_grad:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        elif self.softcap:
            logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)  # in place: no fresh vocabulary-sized tensors
        return logits if self.shard is None else self.shard.gather(logits)

    def soft_embed(self, logits: Tensor) -> Tensor:
        """softmax(logits [..., V]) @ E * sqrt(H): the self-conditioning signal, in the embedding's dtype (under
        tensor parallelism each rank's part of the sum, summed over the ranks)."""
        w = self.weight
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(w.dtype)
        if self.shard is not None:
            probs = probs[..., self.shard.lo:self.shard.hi].contiguous()
        soft = w.linear_t(probs) if isinstance(w, QuantizedWeight) else matmul(probs, w)
        if self.shard is not None:
            soft = all_reduce(soft, self.shard.group)
        return soft * torch.tensor(self.scale, dtype=w.dtype, device=w.device)


def _lookup(weight: Tensor | QuantizedWeight, ids: Tensor) -> Tensor:
    return weight.embedding(ids) if isinstance(weight, QuantizedWeight) else F.embedding(ids, weight)


def embedding_rows(weight: Tensor | QuantizedWeight, lo: int, hi: int, dtype: torch.dtype) -> Tensor:
    """Embedding rows lo..hi in `dtype` (the fused step's vocabulary blocks; a quantized embedding decodes them into
    its workspace, valid until the next decode on this thread)."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize(slice(lo, hi), dtype, fresh=False)
    return weight[lo:hi].to(dtype)
