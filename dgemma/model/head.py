"""The tied LM head, the one way from hidden states to logits: softcap * tanh(h . E / softcap) in float32, for any
rows, with a dense or a quantized embedding (a quantized one runs its own `linear` / `linear_t`, never a decoded
copy of the whole matrix); its transpose, the self-conditioning soft embedding; and the embedding's vocabulary
blocks that the fused denoising step (sampling/fused.py) streams through in the same GEMM dtype."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dgemma.model.layers import matmul
from dgemma.quant import QuantizedWeight


class Head:
    """Reads the embedding module's current weight on every call, so a loader that swaps in a quantized weight (or
    `+a8` packing) is seen without rebuilding the head."""

    def __init__(self, embed: nn.Embedding, softcap: float | None, scale: float):
        self.embed, self.softcap, self.scale = embed, softcap, scale

    @property
    def weight(self) -> Tensor | QuantizedWeight:
        return self.embed.weight

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> float32 logits [..., V]."""
        w = self.weight
        logits = (w.linear(hidden) if isinstance(w, QuantizedWeight) else matmul(hidden, w.T)).float()
        if not self.softcap:
            return logits
        if torch.is_grad_enabled() and logits.requires_grad:
            return torch.tanh(logits / self.softcap) * self.softcap
        return logits.div_(self.softcap).tanh_().mul_(self.softcap)  # in place: no fresh vocabulary-sized tensors

    def soft_embed(self, logits: Tensor) -> Tensor:
        """softmax(logits) @ E * sqrt(H): the self-conditioning signal, in the embedding's dtype."""
        w = self.weight
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(w.dtype)
        soft = w.linear_t(probs) if isinstance(w, QuantizedWeight) else matmul(probs, w)
        return soft * torch.tensor(self.scale, dtype=w.dtype, device=w.device)


def embedding_rows(weight: Tensor | QuantizedWeight, lo: int, hi: int, dtype: torch.dtype) -> Tensor:
    """Embedding rows lo..hi in `dtype` (the fused step's vocabulary blocks; a quantized embedding decodes them into
    its workspace, valid until the next decode on this thread)."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize(slice(lo, hi), dtype, fresh=False)
    return weight[lo:hi].to(dtype)
