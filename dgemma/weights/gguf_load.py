"""The model of a GGUF file (`dgemma.load("file.gguf")`): the form each tensor takes, built from the file's bytes a
few rows at a time (the file is memory-mapped; no float copy of a quantized tensor is made beyond a chunk).

- Q8_0 and Q4_0 are symmetric group-32 formats: blocks of a float16 scale d and 32 codes, w = d * q (Q4_0 keeps
  q + 8 in nibbles, column j low and j + 16 high: `IntWeight`'s int4 layout XOR 0x88). They become int8 / int4
  `IntWeight`s bit for bit (Q4_0 also into int8, exactly): dequantising them gives `gguf`'s values exactly.
- k-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 with 6-8 bit sub-block scales, and mins for Q4_K / Q5_K) have no
  exact int form: `gguf` dequantises them a few rows at a time and they are re-quantised (group 32): Q4_K to int4,
  Q5_K and Q6_K to int8, which keeps their precision (re-quantising adds at most half a step of the new grid).
- F32 / F16 / BF16 tensors, and the parameters dgemma keeps in float (norms, router, scalars), are dequantised to
  the model's dtype.
With a `QuantSpec` (`--quantize int8|int4`) every quantizable tensor takes that scheme instead: exactly where the
mapping above is exact (Q8_0 / Q4_0 into as many bits or more, group 32), re-quantised otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from dgemma.errors import CheckpointError
from dgemma.model import DiffusionGemma
from dgemma.quant import IntWeight, QuantSpec, int_weight, unpack_int4
from dgemma.tokenizer import Tokenizer
from dgemma.weights.gguf import GGUFFile
from dgemma.weights.gguf_vocab import gguf_tokenizer
from dgemma.weights.quantize import bits_for, install

NATURAL_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_K": 4, "Q5_K": 8, "Q6_K": 8}
EXACT_BITS = {"Q8_0": 8, "Q4_0": 4}  # formats that are IntWeights of at least this many bits, group 32
_ALL = QuantSpec(8, 32, 8)  # quantizes everything quantizable: which params may be quantized at all


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              quantize: QuantSpec | None = None, built: dict | None = None) -> tuple[DiffusionGemma, GGUFFile]:
    """The model of a GGUF file and the opened file; every check runs before any tensor is read. `built`: weights
    already made (parameter name -> weight, from the kernel cache), installed instead of read."""
    from dgemma.weights.hf import _init_derived, _target_names

    f = GGUFFile(path)
    device = torch.device(device)
    with torch.device("meta"):
        model = DiffusionGemma(f.config())
    targets = _target_names(model)
    sources = f.check_tensors(list(targets))
    for param, srcs in sources.items():
        got, want = _stacked_shape(f, srcs), tuple(targets[param][0])
        if got != want:
            raise CheckpointError(f"{f.path.name}: tensor {srcs[0]} has shape {list(got)}, expected {list(want)} "
                                  f"(dgemma's {param})")
    group = quantize.group_size if quantize is not None else 32
    built = built or {}
    for param, srcs in sources.items():
        if param in built:
            if tuple(built[param].shape) != tuple(targets[param][0]):
                raise CheckpointError(f"{param}: the kernel cache's weight has shape {list(built[param].shape)}")
            install(model, param, built[param].to(device))
            continue
        bits = target_bits(f, param, srcs, quantize)
        value = gguf_weight(f, param, srcs, tuple(targets[param][0]), bits, group, dtype, device)
        for s in srcs:
            f.header.release(s)
        if isinstance(value, IntWeight):
            install(model, param, value)
        else:
            _install_tensor(model, param, value)
    _init_derived(model, device)
    return model.eval(), f


def load_gguf_model(path: str | Path, dtype: torch.dtype, device: str | torch.device,
                    quantize: QuantSpec | None = None,
                    built: dict | None = None) -> tuple[DiffusionGemma, Tokenizer | None, dict[str, Any]]:
    """What `dgemma.load` needs from a GGUF file: the model, its tokenizer, its sampler defaults."""
    model, f = load_gguf(path, dtype, device, quantize, built)
    return model, gguf_tokenizer(f), f.generation_config()


def target_bits(f: GGUFFile, param: str, sources: list[str], spec: QuantSpec | None) -> int | None:
    """Bits of the IntWeight `param` becomes, or None to keep it in float."""
    if bits_for(_ALL, param) is None:
        return None
    if spec is not None:
        return bits_for(spec, param)
    natural = [NATURAL_BITS.get(f.type_name(s)) for s in sources]
    return None if None in natural else max(natural)


def gguf_weight(f: GGUFFile, param: str, sources: list[str], shape: tuple[int, ...], bits: int | None,
                group: int, dtype: torch.dtype, device: torch.device):
    """A float tensor (bits None) or an IntWeight for `param`, from its GGUF source tensors."""
    if bits is None:
        parts = [f.read(s, dtype, device) for s in sources]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    if group == 32 and all(EXACT_BITS.get(f.type_name(s), 99) <= bits for s in sources):
        codes, scales = zip(*(_exact(f, s, bits) for s in sources))
        join = (lambda t: t[0]) if len(sources) == 1 else (lambda t: torch.cat(t, dim=1))
        return IntWeight(join(codes).to(device), join(scales).to(device), bits, dtype, param)

    def rows(lo: int, hi: int) -> torch.Tensor:
        parts = [f.read(s, torch.float32, torch.device("cpu"), slice(lo, hi)) for s in sources]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    return int_weight(rows, shape, bits, group, dtype, device, param)


def _exact(f: GGUFFile, name: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, float16 scales) in IntWeight's layout of a Q8_0 / Q4_0 tensor: the file's bytes rearranged."""
    shape = f.shape(name)
    k = shape[-1]
    blocks = f.tensors[name].data.reshape(*shape[:-1], k // 32, -1)
    scales = torch.from_numpy(np.array(blocks[..., :2])).view(torch.float16).reshape(*shape[:-1], k // 32)
    payload = torch.from_numpy(np.array(blocks[..., 2:]))
    if f.type_name(name) == "Q8_0":
        return payload.view(torch.int8).reshape(*shape[:-1], k), scales
    packed = (payload ^ 0x88).reshape(*shape[:-1], k // 2)  # unsigned q + 8 -> two's-complement nibbles
    return (packed if bits == 4 else unpack_int4(packed, 32).reshape(*shape[:-1], k)), scales


def _stacked_shape(f: GGUFFile, srcs: list[str]) -> tuple[int, ...]:
    shapes = [f.shape(s) for s in srcs]
    if len(shapes) == 1:
        return shapes[0]
    return (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])


def _install_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value
