"""int8 activations x int8 weights for 2D quantized weights on x86 CPUs (`--quantize ...+a8`), through oneDNN.

Without it a quantized weight's matmul decodes the weight to float and runs a float GEMM (quant/base.py). With it,
each 2D quantized weight (the projections, and the tied embedding in both directions: LM head x @ E.T and soft
embedding p @ E) also keeps int8 codes with one scale per output channel in oneDNN's packed layout, cut into row
blocks (for the embedding, the vocabulary chunks of the fused step), and its matmuls quantize the activations per
row: x / max|x_row| to 7-bit codes (7 bits, so that the u8 x s8 pair sums of AVX2's vpmaddubsw cannot saturate),
an exact integer GEMM, then the row and channel scales in float32. On an AVX2 CPU this ran at ~2x float32's GEMM
(docs/performance.md), for one more byte per weight element and direction and the activations' rounding. Stacked
experts stay weight-only (a second copy of every expert would not fit where their size matters).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

SIGNED_LEVELS, SIGNED_ZERO = 63, 64  # codes 1..127: signed activations in 7 bits
POSITIVE_LEVELS = 127  # codes 0..127: non-negative activations (probabilities)


def available(device: torch.device) -> bool:
    """oneDNN's int8 linear exists for this device (x86 CPU builds of torch)."""
    return device.type == "cpu" and hasattr(torch.ops.onednn, "qlinear_prepack") and torch.backends.mkldnn.is_available()


class Rows(NamedTuple):
    """Activations quantized per row: x ~= (codes - zero) * scale."""
    codes: Tensor  # uint8 [M, K]
    scale: Tensor  # float32 [M, 1]
    zero: int


def quantize_rows(x: Tensor, nonnegative: bool = False) -> Rows:
    """x [M, K] (float) -> 7-bit codes per row; `nonnegative` (x >= 0) uses all 128 codes for the magnitude."""
    x = x.float()
    levels, zero = (POSITIVE_LEVELS, 0) if nonnegative else (SIGNED_LEVELS, SIGNED_ZERO)
    peak = x.abs().amax(-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
    codes = (x * (levels / peak)).round_().add_(zero).to(torch.uint8)
    return Rows(codes, peak / levels, zero)


class PackedBlock(nn.Module):
    """Rows of a weight [n, k] as int8 codes per output channel, packed for oneDNN (non-persistent buffers: counted
    with the model's tensors, never saved)."""

    def __init__(self, w: Tensor):
        super().__init__()
        scales = (w.abs().amax(1) / 127).clamp_min_(torch.finfo(torch.float32).tiny)
        codes = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        self.register_buffer("packed", torch.ops.onednn.qlinear_prepack(codes, None), persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("zeros", torch.zeros(w.shape[0], dtype=torch.long), persistent=False)

    def mm(self, x: Rows) -> Tensor:
        """float32 [M, n] ~= x @ w.T."""
        y = torch.ops.onednn.qlinear_pointwise(x.codes, 1.0, x.zero, self.packed, self.scales, self.zeros, None, 1.0,
                                               0, torch.float32, "none", [], "")
        return y.mul_(x.scale)


class Int8Activations(nn.Module):
    """The packed row blocks of one 2D weight W [N, K] (`blocks`) and, when `transposed`, of W[lo:hi].T for each
    block (`blocks_t`, for x @ W)."""

    def __init__(self, weight, block_rows: int, transposed: bool):
        super().__init__()
        self.block_rows = block_rows
        self.blocks, self.blocks_t = nn.ModuleList(), nn.ModuleList()
        for lo in range(0, weight.shape[0], block_rows):
            w = weight.dequantize(slice(lo, lo + block_rows), torch.float32)
            self.blocks.append(PackedBlock(w))
            if transposed:
                self.blocks_t.append(PackedBlock(w.T.contiguous()))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def linear(self, x: Tensor) -> Tensor:
        """x [M, K] @ W.T -> float32 [M, N]."""
        rows = quantize_rows(x)
        parts = [b.mm(rows) for b in self.blocks]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def linear_t(self, x: Tensor) -> Tensor:
        """x [M, N] @ W -> float32 [M, K] (needs `transposed`)."""
        y = None
        for lo, b in zip(range(0, x.shape[1], self.block_rows), self.blocks_t):
            part = b.mm(quantize_rows(x[:, lo:lo + self.block_rows]))
            y = part if y is None else y.add_(part)
        return y


def enable(module: torch.nn.Module, embedding, embedding_block_rows: int) -> int:
    """Give every 2D quantized weight of `module` its packed int8 copy (`weight.a8`); the tied `embedding` also in
    the transposed direction, in blocks of `embedding_block_rows`. Returns the bytes added."""
    from dgemma.quant.base import QuantizedWeight

    added = 0
    for m in [m for m in module.modules() if isinstance(m, QuantizedWeight) and len(m.shape) == 2]:
        tied = m is embedding
        m.a8 = Int8Activations(m, embedding_block_rows if tied else m.shape[0], transposed=tied)
        added += m.a8.nbytes
    return added
