"""int4 expert stacks on CPUs in torch's own int4 layout, multiplied by `torch._weight_int4pack_mm_for_cpu`.

An expert sees ~16 rows of a canvas, so its GEMM is bound by reading its weight. Decoding int4 to float32 and
running sgemm (quant/base.py) reads the codes, writes 8x their bytes of float and reads them back; torch's int4
kernel unpacks in registers and reads only the codes. At the real model's expert shape (1,408 x 2,816, 16 rows)
it ran 4.0x faster than decode + sgemm and 1.65x faster than sgemm on float32 weights (docs/performance.md).
The kernel takes bfloat16 activations and scales and writes bfloat16: expert inputs, the group scales and the
expert outputs are rounded to bfloat16 (8-bit mantissa), the cost of the speed. Weights stay exact: the codes
and float16 scales are kept, only permuted into torch's layout, and `dequantize` gives the same floats as the
`IntWeight` they came from. Stacks are converted at load on CPUs that have the kernel (`convert`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from dgemma.quant.base import QuantizedWeight
from dgemma.quant.intq import IntWeight, pack_int4, unpack_int4

GROUPS = (32, 64, 128, 256)  # the kernel's group sizes


def available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


@lru_cache(maxsize=8)
def _order(n: int, k: int) -> Tensor:
    """For torch's packing of an [n, k] matrix: the flat source index (row * k + column) of each packed nibble, in
    packed order (byte-major, low nibble first). Found by packing probes that spell each index 4 bits at a time, so
    it follows whatever layout this torch build and CPU use."""
    idx = torch.arange(n * k, dtype=torch.int64).view(n, k)
    order = torch.zeros(n * k, dtype=torch.int64)
    for d in range(math.ceil(math.log2(n * k) / 4)):
        packed = torch._convert_weight_to_int4pack_for_cpu(((idx >> 4 * d) & 15).int(), 2)
        order |= _nibbles(packed).reshape(-1).long() << 4 * d
    return order


def _nibbles(packed: Tensor) -> Tensor:
    """uint8 [..., b] -> the 2b nibble values (0..15), low nibble first."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


class CPUInt4Experts(QuantizedWeight):
    """An int4 expert stack [E, N, K] in torch's CPU int4 layout (`packed` [E, N, K // 2]) with the float16 group
    scales [E, N, K // g] of the `IntWeight` it came from."""

    format, bits = "int4", 4

    def __init__(self, packed: Tensor, scales: Tensor, shape: tuple[int, ...], dtype: torch.dtype):
        super().__init__(shape, dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    @classmethod
    def from_int(cls, w: IntWeight) -> CPUInt4Experts:
        e, n, k = w.shape
        packed = torch.empty(e, n, k // 2, dtype=torch.uint8)
        for i in range(e):
            codes = unpack_int4(w.qweight[i], w.group_size).int() + 8  # torch's nibbles are unsigned, zero at 8
            packed[i] = torch._convert_weight_to_int4pack_for_cpu(codes, 2).view(n, k // 2)
        return cls(packed, w.scales, tuple(w.shape), w.dtype)

    @property
    def group_size(self) -> int:
        return self.shape[-1] // self.scales.shape[-1]

    def _codes(self, sel, out: Tensor) -> Tensor:
        """The signed codes of experts `sel` written into `out` [m, N, K] (any dtype that holds -8..7)."""
        n, k = self.shape[1:]
        flat = out.view(-1, n * k)
        nib = _nibbles(self.packed[sel]).view(flat.shape[0], -1)
        flat.index_copy_(1, _order(n, k), nib.to(out.dtype).sub_(8))
        return out

    def _decode(self, sel, out: Tensor) -> None:
        grouped = self._codes(sel, out).view(*out.shape[:-1], -1, self.group_size)
        grouped.mul_(self.scales[sel].to(out.dtype)[..., None])

    def to_int(self) -> IntWeight:
        """The `IntWeight` this stack came from (its layout, the same codes and scales)."""
        codes = self._codes(slice(None), torch.empty(self.shape, dtype=torch.int8))
        return IntWeight(pack_int4(codes, self.group_size), self.scales, 4, self.dtype)

    def rebuild(self, buffers: dict[str, Tensor]) -> CPUInt4Experts:
        return CPUInt4Experts(buffers["packed"], buffers["scales"], (buffers["packed"].shape[0], *self.shape[1:]),
                              self.dtype)

    def expert_matmul(self, x: Tensor, ends: Tensor) -> Tensor:
        """x [R, K] sorted by expert (expert e owns rows ends[e-1]..ends[e]) times w[e].T -> [R, N] in x's dtype."""
        bounds = [0, *ends.tolist()]
        xb = x.to(torch.bfloat16)
        out = torch.empty(x.shape[0], self.shape[1], dtype=torch.bfloat16)
        zeros = torch.zeros(self.scales.shape[2], self.shape[1], dtype=torch.bfloat16)
        for e in range(self.shape[0]):
            lo, hi = bounds[e], bounds[e + 1]
            if hi > lo:
                scale_zero = torch.stack([self.scales[e].T.to(torch.bfloat16), zeros], dim=-1)
                out[lo:hi] = torch._weight_int4pack_mm_for_cpu(xb[lo:hi], self.packed[e], self.group_size, scale_zero)
        return out.to(x.dtype)


def convert(module: torch.nn.Module) -> int:
    """Replace every int4 expert stack of `module` (an `IntWeight` [E, N, K] whose group the kernel takes) with its
    `CPUInt4Experts`, one at a time (only names are listed first: each old stack is freed as soon as it is
    replaced, so converting never holds a second copy of the model's experts); returns how many were converted."""
    targets = [(owner, name) for owner, parent in module.named_modules() for name, w in parent.named_children()
               if isinstance(w, IntWeight) and w.bits == 4 and len(w.shape) == 3 and w.group_size in GROUPS]
    for owner, name in targets:
        parent = module.get_submodule(owner)
        setattr(parent, name, CPUInt4Experts.from_int(getattr(parent, name)))
    return len(targets)
