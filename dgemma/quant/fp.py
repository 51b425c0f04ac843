"""Floating-point weight formats as pre-quantized checkpoints store them: FP8 (E4M3) and NVFP4 (E2M1 + E4M3 scales).

Both decode on the fly through the shared chunked matmuls (quant/base.py), on any device. A GPU with FP8 / FP4
tensor cores (Hopper / Blackwell) would instead override `linear` here with `torch._scaled_mm` (FP8) or a
block-scaled FP4 GEMM on the stored codes; the buffers are already in the layout those kernels take (row-major codes,
per-row / per-16 scales).

- `FP8Weight`: `weight` float8_e4m3fn [*, N, K], `scales` [*, N, G] (G = 1 per channel; per-tensor and block scales
  are expanded to this on load); the weight is `weight * scale` over groups of K / G columns.
- `NVFP4Weight`: `packed` uint8 [*, N, K / 2] (two E2M1 codes a byte, the even column in the low nibble: the order of
  compressed-tensors and ModelOpt), `scales` float8_e4m3fn [*, N, K / 16], `global_scale` float32 [*, N, 1] (one value
  per tensor or expert, kept per row so that fused gate/up rows may differ). The weight is
  `e2m1 * (scale / global)` (compressed-tensors) or `e2m1 * (scale * global)` (ModelOpt's `weight_scale_2`): `divide`
  says which, so that each format's own arithmetic is reproduced bit for bit.
"""

from __future__ import annotations

import math

import torch

from dgemma.errors import CheckpointError
from dgemma.quant.base import QuantizedWeight, workspace

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_GROUP = 16


class FP8Weight(QuantizedWeight):
    format = "fp8"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "weight"):
        super().__init__(tuple(weight.shape), dtype)
        if weight.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{name}: FP8 weights must be float8_e4m3fn, got {weight.dtype}")
        if scales.shape[:-1] != weight.shape[:-1] or weight.shape[-1] % scales.shape[-1]:
            raise CheckpointError(f"{name}: scales of shape {list(scales.shape)} do not fit an FP8 weight of shape "
                                  f"{list(weight.shape)}")
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    @property
    def group_size(self) -> int:
        return self.shape[-1] // self.scales.shape[-1]

    def _decode(self, sel, out: torch.Tensor) -> None:
        grouped = out.view(*out.shape[:-1], self.scales.shape[-1], -1)
        grouped.copy_(self.weight[sel].view(grouped.shape))
        grouped.mul_(self.scales[sel].to(out.dtype)[..., None])

    def rebuild(self, buffers: dict[str, torch.Tensor]) -> FP8Weight:
        return FP8Weight(buffers["weight"], buffers["scales"], self.dtype)


class NVFP4Weight(QuantizedWeight):
    format = "nvfp4"

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype,
                 divide: bool, name: str = "weight"):
        super().__init__((*packed.shape[:-1], packed.shape[-1] * 2), dtype)
        _check_nvfp4(name, packed, scales, global_scale)
        self.divide = divide
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("global_scale", global_scale.float())
        self.register_buffer("pairs", _pairs(packed.device), persistent=False)
        self.register_buffer("e4m3", _e4m3(packed.device), persistent=False)

    @property
    def group_size(self) -> int:
        return NVFP4_GROUP

    def _decode(self, sel, out: torch.Tensor) -> None:
        codes, s = self.packed[sel], self.scales[sel]
        scale = _lookup(self.e4m3, s.view(torch.uint8)).view(s.shape)
        g = self.global_scale[sel]
        scale = scale.div_(g) if self.divide else scale.mul_(g)
        values = out if out.dtype == torch.float32 else _staging(out)
        _lookup(self.pairs, codes, values.view(torch.int64).view(-1))  # one gather of 8 bytes per code byte
        values.view(*out.shape[:-1], -1, NVFP4_GROUP).mul_(scale[..., None])
        if values is not out:
            out.copy_(values)

    def rebuild(self, buffers: dict[str, torch.Tensor]) -> NVFP4Weight:
        return NVFP4Weight(buffers["packed"], buffers["scales"], buffers["global_scale"], self.dtype, self.divide)


def _pairs(device) -> torch.Tensor:
    """[256] int64: the two float32 E2M1 values (low nibble first) of every code byte, as one 8-byte word each: a 1-D
    gather moves both at once (a [256, 2] row gather is ~10x slower on CPU)."""
    table, byte = torch.tensor(E2M1, device=device), torch.arange(256, device=device)
    return torch.stack([table[byte & 15], table[byte >> 4]], dim=-1).view(torch.int64).view(-1)


def _e4m3(device) -> torch.Tensor:
    """[256] float32: torch's own value of every E4M3 byte (NaN included); a gather is ~4x faster than `.float()`."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()


def _lookup(table: torch.Tensor, codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """table[codes] flattened, through a 1-D index_select (int32 indices: cheaper to make than int64)."""
    return torch.index_select(table, 0, codes.reshape(-1).int(), out=out)


def _staging(out: torch.Tensor) -> torch.Tensor:
    """A float32 buffer shaped like `out`: the decode multiplies in float32 and rounds once into `out`. Reused on the
    CPU (a fresh one costs page faults); fresh on accelerators, whose caching allocator makes it cheap."""
    fresh = out.device.type != "cpu"
    return workspace(out.numel(), torch.float32, out.device, fresh, use="nvfp4").view(out.shape)


def _check_nvfp4(name: str, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{name}: NVFP4 needs uint8 codes and float8_e4m3fn scales, got {packed.dtype} and "
                              f"{scales.dtype}")
    k = packed.shape[-1] * 2
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * NVFP4_GROUP != k:
        raise CheckpointError(f"{name}: scales of shape {list(scales.shape)} do not fit NVFP4 codes of shape "
                              f"{list(packed.shape)} (one scale per {NVFP4_GROUP} columns)")
    if global_scale.shape != (*packed.shape[:-1], 1):
        raise CheckpointError(f"{name}: global scale of shape {list(global_scale.shape)}, expected "
                              f"{[*packed.shape[:-1], 1]}")


_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between the E2M1 magnitudes: round to nearest


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float w [*, N, K] at a given global scale (compressed-tensors' convention: 448 * 6 / max|w|) -> (codes packed
    two a byte, float8 block scales [*, N, K / 16]); the weight is e2m1 * (scale / global)."""
    blocks = w.float().unflatten(-1, (-1, NVFP4_GROUP))
    scales = (blocks.abs().amax(-1) / 6.0 * global_scale).clamp(max=448.0).to(torch.float8_e4m3fn)
    step = (scales.float() / global_scale)[..., None]
    x = torch.where(step > 0, blocks / step, 0.0)
    mids = torch.tensor(_MIDPOINTS, device=w.device)
    codes = torch.bucketize(x.abs(), mids).to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)
    codes = codes.flatten(-2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales


def nvfp4_weight(rows, shape: tuple[int, ...], dtype: torch.dtype, device, name: str = "weight") -> NVFP4Weight:
    """NVFP4 from a row reader (as `int_weight`): one global scale per 2D slab (per expert for a stack), from a first
    pass over its rows, then the codes a chunk at a time."""
    if shape[-1] % NVFP4_GROUP:
        raise CheckpointError(f"{name}: {shape[-1]} columns are not a multiple of NVFP4's group of {NVFP4_GROUP}")
    lead, (n, k) = shape[:-2], shape[-2:]
    slabs = max(1, math.prod(lead))
    packed = torch.empty(slabs, n, k // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(slabs, n, k // NVFP4_GROUP, dtype=torch.float8_e4m3fn, device=device)
    glob = torch.empty(slabs, n, 1, dtype=torch.float32, device=device)
    for i in range(slabs):
        w = rows(i, i + 1).to(device).reshape(n, k) if lead else rows(0, n).to(device)
        g = 448.0 * 6.0 / w.float().abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
        packed[i], scales[i] = quantize_nvfp4(w, g)
        glob[i] = g
    shape_out = (*lead, n)
    return NVFP4Weight(packed.view(*shape_out, -1), scales.view(*shape_out, -1), glob.view(*shape_out, 1), dtype,
                       True, name)
