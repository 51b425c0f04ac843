"""The one dtype vocabulary (`float32`, `bfloat16`, and `auto` where a command resolves it) and the one check
for native bf16 matmuls. torch is imported lazily so that argument parsing stays cheap."""

from __future__ import annotations

import functools
import os

from dgemma.errors import ConfigError

NAMES = ("float32", "bfloat16")


def parse_dtype(name, what: str = "dtype"):
    """'float32' | 'bfloat16' (or a torch.dtype) -> torch.dtype; anything else is a one-line ConfigError."""
    import torch

    if isinstance(name, torch.dtype) and name in (torch.float32, torch.bfloat16):
        return name
    if name not in NAMES:
        raise ConfigError(f"{what}={name!r} must be one of {', '.join(NAMES)}")
    return getattr(torch, name)


POLICY_ENV = "DGEMMA_NATIVE_BF16"  # "0" / "1" forces the CPU policy (tests run both; a CPU that misreports)


def native_bf16(device_type: str) -> bool:
    """True where bf16 matmuls run at full speed: CUDA GPUs with bf16, CPUs with AVX512-BF16 or AMX. On other
    CPUs bf16 GEMMs run tens of times slower than float32 ones. `DGEMMA_NATIVE_BF16=0|1` overrides the CPU's
    answer."""
    forced = os.environ.get(POLICY_ENV)
    if device_type == "cpu" and forced in ("0", "1"):
        return forced == "1"
    return _detected(device_type)


@functools.cache
def _detected(device_type: str) -> bool:
    import torch

    if device_type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True
