"""Which matmul a quantized 2D weight runs for a call of M rows, chosen once per weight (quant/base.py `choice`).

Two paths: a weight-only kernel that reads the packed codes once (`kernel_mm` of a format that has one on this
device: torch's int4 CPU kernel, quant/int4cpu.py, for int4 weights and for int8 ones split in two int4 halves)
and decode + GEMM (quant/base.py: float rows decoded a chunk at a time, then the float GEMM). A weight with
`+a8`'s int8 copy (quant/a8.py) runs that instead, for every M (the user asked for it; on an AVX-512 VNNI CPU it
also measured fastest at every M). A call's shape class is its number of rows: up to `rows` the `small` path
(matrix-vector and small-M calls: autoregressive decoding, its tied head, short appends), above it the `large` one,
where the GEMM's reuse of each decoded weight can pay for the decode. The limits are measured crossovers
(`benchmarks/kernel_choice.py`, docs/kernels.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dgemma.dtypes import native_bf16

KERNEL, DECODE = "kernel", "decode"
ALL_ROWS = 1 << 62
# Largest M for a format's weight-only kernel, by (format, device, native bf16, compute dtype). int4 on CPUs:
# crossovers against decode + GEMM; on a native-bf16 CPU the kernel (bf16 dot products) beat decode + sgemm at
# every M measured (up to 512) when the model computes in float32. int8 (two int4 halves: the kernel's work doubles)
# against decode + GEMM from the same layout.
KERNEL_ROWS = {("int4", "cpu", True, torch.float32): ALL_ROWS, ("int4", "cpu", True, torch.bfloat16): 64,
               ("int4", "cpu", False, torch.float32): 64,
               ("int8", "cpu", True, torch.float32): 32, ("int8", "cpu", True, torch.bfloat16): 32,
               ("int8", "cpu", False, torch.float32): 8}


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float32 for bf16 on a device without native bf16 GEMMs (as `model.layers.gemm_dtype`), else `dtype`."""
    if dtype == torch.bfloat16 and not native_bf16(device.type):
        return torch.float32
    return dtype


class Choice(NamedTuple):
    small: str  # the path of calls with at most `rows` rows
    rows: int
    large: str  # the path above
    kernel: str = ""  # the weight-only kernel's name

    def path(self, m: int) -> str:
        return self.small if m <= self.rows else self.large

    def describe(self) -> str:
        names = {KERNEL: self.kernel, DECODE: "decode + GEMM"}
        if self.small == self.large or self.rows >= ALL_ROWS:
            return names[self.small]
        if self.rows <= 0:
            return names[self.large]
        return f"M<={self.rows}: {names[self.small]}; larger: {names[self.large]}"


def choose(w) -> Choice:
    """The choice for a 2D quantized weight `w` (its format, device, dtype, and the paths it has)."""
    kernel = getattr(w, "kernel_name", "")
    if not kernel:
        return Choice(DECODE, 0, DECODE)
    dtype = compute_dtype(w.dtype, w.device)
    rows = KERNEL_ROWS.get((w.format, w.device.type, native_bf16(w.device.type), dtype), 0)
    return Choice(KERNEL, rows, DECODE, kernel)
