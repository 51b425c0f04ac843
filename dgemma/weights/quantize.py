"""Quantize on load: which dgemma parameters a `QuantSpec` covers, each built from the memory map a chunk at a time.

Quantized: attention q/k/v/o, the dense MLP, both expert stacks, the self-conditioning MLP and (as the spec says) the
tied embedding / LM head. Kept in the model's float dtype: norms, router (small, and it picks the experts), scalars.
"""

from __future__ import annotations

import re

import torch

from dgemma.quant import QuantizedWeight, QuantSpec, int_weight
from dgemma.quant.fp import nvfp4_weight

_BODY = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj\.weight|mlp\.(gate|up|down)_proj\.weight"
                   r"|experts\.(gate_up_proj|down_proj))|self_conditioning\.(gate|up|down)_proj\.weight")
EMBEDDING = "embed_tokens.weight"


def bits_for(spec: QuantSpec | None, param: str) -> int | None:
    """The bits `param` is quantized to under `spec`, or None when it stays float."""
    if spec is None:
        return None
    if param == EMBEDDING:
        return spec.embedding_bits
    return spec.bits if _BODY.fullmatch(param) else None


def quantize_view(view, name: str, bits: int, spec: QuantSpec, dtype: torch.dtype, device) -> QuantizedWeight:
    """The quantized weight of a safetensors slice `view`, read and quantized a few rows at a time (the embedding
    of an NVFP4 spec is an integer one)."""
    shape = tuple(view.get_shape())
    if spec.nvfp4 and not name.endswith("embed_tokens.weight"):
        return nvfp4_weight(lambda lo, hi: view[lo:hi], shape, dtype, device, name)
    return int_weight(lambda lo, hi: view[lo:hi], shape, bits, 32 if spec.nvfp4 else spec.group_size, dtype,
                      device, name)


def install(model: torch.nn.Module, param: str, weight: QuantizedWeight) -> None:
    """Put `weight` (a submodule) where the float parameter `param` was."""
    owner, _, leaf = param.rpartition(".")
    module = model.get_submodule(owner)
    module._parameters.pop(leaf, None)
    setattr(module, leaf, weight)


def quantized_weights(model: torch.nn.Module) -> dict[str, QuantizedWeight]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedWeight)}
