"""Integer weights: int8 and int4, symmetric, one scale per group of `group_size` consecutive input columns.

Storage of a weight [*, N, K] (the same for 2D linears and [E, N, K] expert stacks):
- `qweight`: int8 codes [*, N, K] for 8 bits; for 4 bits uint8 [*, N, K // 2], two's-complement nibbles packed
  group-locally: in each group of g columns, byte j holds column j (low nibble) and column j + g/2 (high nibble),
  the order of GGUF's Q4_0 blocks (whose unsigned nibbles are these XOR 0x88);
- `scales`: [*, N, K // g] in float16 (or the dtype a checkpoint stored); the weight is `code * scale`.

Quantisation (`quantize_int`): round to nearest at a per-group scale that maps the group's largest-magnitude
value to the most negative code (GGUF Q4_0's choice: all 2^bits codes in use), for int4 the best of a few smaller
scales by squared error. Group 32 is the default for both: it divides every width of the released model (2816, 2112,
704, where 128 does not divide 2112 or 704), equals GGUF Q8_0 / Q4_0, and costs 0.5 (int8) or 0.0625 (int4) bytes
of float16 scale per 8 / 16 weight bytes: 1.06 and 0.56 bytes a weight (0.53x and 0.28x of bfloat16).
"""

from __future__ import annotations

import math

import torch

from dgemma.errors import CheckpointError
from dgemma.quant.base import QuantizedWeight

QMAX = {8: 127, 4: 7}
DEFAULT_GROUP = 32


class IntWeight(QuantizedWeight):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype,
                 name: str = "weight"):
        k = qweight.shape[-1] * (8 // bits)
        shape = (*qweight.shape[:-1], k)
        super().__init__(shape, dtype)
        self.bits = bits
        self.format = f"int{bits}"
        _check_int(name, qweight, scales, bits, k)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @property
    def group_size(self) -> int:
        return self.shape[-1] // self.scales.shape[-1]

    def _decode(self, sel, out: torch.Tensor) -> None:
        q, s = self.qweight[sel], self.scales[sel]
        g = self.group_size
        grouped = out.view(*out.shape[:-1], -1, g)
        if self.bits == 8:
            grouped.copy_(q.view(grouped.shape))
        else:
            grouped.copy_(unpack_int4(q, g).view(grouped.shape))
        grouped.mul_(s.to(out.dtype)[..., None])

    def rebuild(self, buffers: dict[str, torch.Tensor]) -> IntWeight:
        return IntWeight(buffers["qweight"], buffers["scales"], self.bits, self.dtype)


def _check_int(name: str, qweight: torch.Tensor, scales: torch.Tensor, bits: int, k: int) -> None:
    want = torch.int8 if bits == 8 else torch.uint8
    if qweight.dtype != want:
        raise CheckpointError(f"{name}: int{bits} codes must be {want}, got {qweight.dtype}")
    groups = scales.shape[-1] if scales.dim() else 0
    if scales.shape[:-1] != qweight.shape[:-1] or groups == 0 or k % groups:
        raise CheckpointError(f"{name}: scales of shape {list(scales.shape)} do not fit codes of shape "
                              f"{list(qweight.shape)} (int{bits}, {k} columns)")
    if bits == 4 and (k // groups) % 2:
        raise CheckpointError(f"{name}: int4 group size {k // groups} is odd")


def quantize_int(w: torch.Tensor, bits: int, group_size: int = DEFAULT_GROUP,
                 scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """Float w [*, N, K] -> (codes, scales) in IntWeight's layout (codes packed for 4 bits).

    int8: scale = max|w| / 127. int4: the group's largest-magnitude value m maps to the code -8 (scale = -m / 8,
    negative when m > 0, as in GGUF's Q4_0: all 16 codes in use), and scales of 80-95% of that are also tried; the
    one with the least squared error per group is kept.
    """
    k = w.shape[-1]
    groups = w.float().reshape(*w.shape[:-1], k // group_size, group_size)
    lowest = -QMAX[bits] - 1
    peak = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))
    if bits == 8:
        peak, lowest = -peak.abs(), -QMAX[bits]
    best_codes = best_scales = best_err = None
    for shrink in ((1.0,) if bits == 8 else (1.0, 0.95, 0.9, 0.85, 0.8)):
        scales = (peak * (shrink / lowest)).to(scale_dtype)
        codes, err = _round(groups, scales.float(), QMAX[bits])
        if best_err is None:
            best_codes, best_scales, best_err = codes, scales, err
            continue
        better = err < best_err
        best_codes = torch.where(better, codes, best_codes)
        best_scales = torch.where(better, scales, best_scales)
        best_err = torch.minimum(err, best_err)
    codes = best_codes.view(*w.shape[:-1], k)
    return (codes if bits == 8 else pack_int4(codes, group_size)), best_scales.squeeze(-1)


def _round(groups: torch.Tensor, s: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of `groups` at scales s [..., 1] (0 where s is 0) and each group's squared error [..., 1]."""
    codes = torch.where(s != 0, groups / s, 0).round_().clamp_(-qmax - 1, qmax)
    err = (codes * s - groups).square_().sum(-1, keepdim=True)
    return codes.to(torch.int8), err


def pack_int4(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """int8 codes in [-8, 7] [*, K] -> uint8 [*, K // 2] (group-local nibble order, see module docstring)."""
    g = codes.view(*codes.shape[:-1], -1, 2, group_size // 2)
    packed = (g[..., 0, :] & 15) | (g[..., 1, :] << 4)
    return packed.reshape(*codes.shape[:-1], -1).view(torch.uint8)


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 [*, K // 2] -> int8 codes [*, K] (sign-extended nibbles)."""
    p = packed.view(*packed.shape[:-1], -1, group_size // 2)
    low = (p << 4).view(torch.int8) >> 4
    high = p.view(torch.int8) >> 4
    return torch.stack([low, high], dim=-2).view(*packed.shape[:-1], -1)


def int_weight(rows, shape: tuple[int, ...], bits: int, group_size: int, dtype: torch.dtype, device,
               name: str = "weight", scale_dtype: torch.dtype = torch.float16) -> IntWeight:
    """Quantize a float weight of `shape` read a few rows of dim 0 at a time through `rows(lo, hi)` (a slice of a
    tensor or of a safetensors memory map): no float copy of more than one chunk ever exists."""
    k = shape[-1]
    if k % group_size or (bits == 4 and group_size % 2):
        raise CheckpointError(f"{name}: {k} columns are not a multiple of the group size {group_size}")
    codes = torch.empty(*shape[:-1], k * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8, device=device)
    scales = torch.empty(*shape[:-1], k // group_size, dtype=scale_dtype, device=device)
    step = max(1, (4 << 20) // math.prod(shape[1:]))
    for lo in range(0, shape[0], step):
        hi = min(lo + step, shape[0])
        codes[lo:hi], scales[lo:hi] = quantize_int(rows(lo, hi).to(device), bits, group_size, scale_dtype)
    return IntWeight(codes, scales, bits, dtype, name)


def quantize_tensor(w: torch.Tensor, bits: int, group_size: int = DEFAULT_GROUP, name: str = "weight") -> IntWeight:
    """An IntWeight of a float tensor (computing in w's dtype)."""
    return int_weight(lambda lo, hi: w[lo:hi], tuple(w.shape), bits, group_size, w.dtype, w.device, name)
