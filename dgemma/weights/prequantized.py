"""Pre-quantized checkpoints, detected from the files: compressed-tensors and NVIDIA ModelOpt NVFP4.

compressed-tensors (`config.json` `quantization_config.quant_method == "compressed-tensors"`), per quantized linear `P`:
- pack-quantized (W4A16 / W8A16): `P.weight_packed` int32 (consecutive codes + 2^(b-1) packed densely from bit 0),
  `P.weight_scale` [N, K / group] (or [N, 1] per channel), `P.weight_shape`; repacked into `IntWeight`;
- int-quantized / naive-quantized: `P.weight` int8 + `P.weight_scale`: `IntWeight`;
- float-quantized (FP8): `P.weight` float8_e4m3fn + `P.weight_scale` per tensor, channel, group or block: `FP8Weight`;
- nvfp4-pack-quantized: `P.weight_packed` uint8, `P.weight_scale` float8_e4m3fn per 16, `P.weight_global_scale`.
ModelOpt (`hf_quant_config.json`, or `quant_method == "modelopt"`): `P.weight` uint8 E2M1 pairs, `P.weight_scale`
float8 per 16, `P.weight_scale_2` float32. Activation scales (`input_scale`, `input_global_scale`) are not used:
activations stay float. Asymmetric (zero-point) weights are refused.

Experts: quantized files (vLLM's layout for Gemma 4 MoE) unfuse them into `experts.E.{gate,up,down}_proj`; they are
re-stacked here into dgemma's `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] (per-expert bf16 pieces too).
Unquantized tensors (routers, norms, often the embedding and attention) load as usual.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dgemma.errors import CheckpointError
from dgemma.jsonfile import read_json
from dgemma.quant import FP8Weight, IntWeight, NVFP4Weight, QuantizedWeight, pack_int4

METHODS = ("compressed-tensors", "modelopt")
_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_global_scale", "weight_zero_point",
          "weight_scale_2", "input_scale", "input_global_scale")
_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)")

Getter = Callable[[str], torch.Tensor]


def detect(directory: Path) -> str | None:
    """The pre-quantized format of a checkpoint directory, None for a plain float one."""
    if (directory / "hf_quant_config.json").is_file():
        return "modelopt"
    qc = read_json(directory / "config.json").get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in METHODS:
        raise CheckpointError(f"config.json quantization_config.quant_method={method!r} is not supported "
                              f"(dgemma reads {', '.join(METHODS)})")
    fmt = qc.get("format")
    if method == "compressed-tensors" and fmt in ("marlin-24", "sparse-bitmask", "sparse-24-bitmask"):
        raise CheckpointError(f"config.json quantization_config.format={fmt!r} is not supported")
    return method


def plan(files: dict[str, Path], wanted: dict[str, tuple[int, ...]]) -> tuple[dict[str, list[str]], set[str]]:
    """For each wanted checkpoint tensor (name -> shape) stored quantized or unfused: the prefixes to read
    (one linear, or per expert gate/up or down); and every file tensor those consume."""
    sources: dict[str, list[str]] = {}
    for name, shape in wanted.items():
        if name.endswith(".weight") and _quantized(files, name[:-len(".weight")]):
            sources[name] = [name[:-len(".weight")]]
            continue
        if name in files:
            continue
        m = _EXPERTS.fullmatch(name)
        kinds = () if m is None else ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
        if any(f"{m.group(1)}.0.{k}.{s}" in files for k in kinds for s in ("weight", "weight_packed")):
            sources[name] = [f"{m.group(1)}.{e}.{k}" for e in range(shape[0]) for k in kinds]
    consumed = {f"{p}.{s}" for ps in sources.values() for p in ps for s in ("weight", *_PARTS)}
    return sources, consumed & set(files)


def _quantized(files, prefix: str) -> bool:
    return f"{prefix}.weight_scale" in files or f"{prefix}.weight_packed" in files


def read(name: str, prefixes: list[str], get: Getter, has: Callable[[str], bool],
         dtype: torch.dtype) -> QuantizedWeight | torch.Tensor:
    """The dgemma weight for checkpoint tensor `name` from its pieces (one linear, or unfused experts), built where
    `get` puts the pieces (the CPU: the caller moves the finished weight to its device)."""
    if len(prefixes) == 1 and not _EXPERTS.fullmatch(name):
        return read_linear(prefixes[0], get, has, dtype)
    per_expert = 2 if name.endswith("gate_up_proj") else 1
    stack = None
    for e in range(len(prefixes) // per_expert):
        pieces = [read_linear(p, get, has, dtype) for p in prefixes[e * per_expert:(e + 1) * per_expert]]
        stack = stack or _Stack(name, len(prefixes) // per_expert, pieces, dtype)
        stack.put(e, pieces)
    return stack.result()


class _Stack:
    """Unfused experts re-stacked into one weight [E, N, K]: the stacked buffers are allocated once (from expert 0's
    pieces) and each expert's pieces are copied into their rows, so no list of pieces or second copy ever exists."""

    def __init__(self, name: str, experts: int, pieces: list, dtype: torch.dtype):
        self.name, self.first = name, pieces[0]
        self.buffers = {n: torch.empty(experts, *self._shape(n, ts), device=ts[0].device,
                                       dtype=dtype if n == "" else ts[0].dtype)
                        for n, ts in self._parts(pieces).items()}

    def put(self, e: int, pieces: list) -> None:
        for n, ts in self._parts(pieces).items():
            dest = self.buffers[n][e]
            if self._shape(n, ts) != tuple(dest.shape):
                raise CheckpointError(f"{self.name}: cannot re-stack its experts (expert {e}'s {n or 'weight'} is "
                                      f"{list(self._shape(n, ts))}, expert 0's {list(dest.shape)})")
            lo = 0
            for t in ts:
                _copy(dest[..., lo:lo + t.shape[-2], :], t)
                lo += t.shape[-2]

    def _parts(self, pieces: list) -> dict[str, list[torch.Tensor]]:
        """Buffer name -> that buffer of each piece ("" for float pieces), once the pieces' formats agree."""
        if any(isinstance(p, torch.Tensor) != isinstance(self.first, torch.Tensor) for p in pieces):
            raise CheckpointError(f"{self.name}: its unfused experts mix quantized and float pieces")
        if odd := [p for p in pieces if type(p) is not type(self.first)]:
            raise CheckpointError(f"{self.name}: its unfused experts mix formats ({type(odd[0]).__name__} and "
                                  f"{type(self.first).__name__})")
        return {"": pieces} if isinstance(self.first, torch.Tensor) else _buffers(self.name, pieces)

    def result(self) -> QuantizedWeight | torch.Tensor:
        return self.buffers[""] if isinstance(self.first, torch.Tensor) else self.first.rebuild(self.buffers)

    def _shape(self, n: str, ts: list[torch.Tensor]) -> tuple[int, ...]:
        """Shape of the pieces `ts` joined along their rows (dim -2)."""
        first = ts[0].shape
        if any(t.dim() != len(first) or t.dim() < 2 or t.shape[-1] != first[-1] or t.shape[:-2] != first[:-2]
               for t in ts):
            raise CheckpointError(f"{self.name}: cannot re-stack its experts ({n or 'weight'} pieces of shapes "
                                  f"{[list(t.shape) for t in ts]})")
        return (*first[:-2], sum(t.shape[-2] for t in ts), first[-1])


def _buffers(name: str, pieces: list[QuantizedWeight]) -> dict[str, list[torch.Tensor]]:
    """Persistent buffer name -> that buffer of each piece (rows at dim -2)."""
    if any(p.group_size != pieces[0].group_size for p in pieces):
        raise CheckpointError(f"{name}: its unfused experts mix group sizes "
                              f"({sorted({p.extra_repr() for p in pieces})})")
    states = [p.state_dict() for p in pieces]
    return {n: [s[n] for s in states] for n in states[0]}


def read_linear(prefix: str, get: Getter, has, dtype) -> QuantizedWeight | torch.Tensor:
    """One linear's weight: quantized from its parts, or the plain float tensor."""
    name = f"{prefix}.weight"
    if has(f"{prefix}.weight_zero_point"):
        raise CheckpointError(f"{prefix}.weight_zero_point: asymmetric (zero-point) weights are not supported")
    if has(f"{prefix}.weight_packed"):
        packed = get(f"{prefix}.weight_packed")
        scale = _required(get, has, f"{prefix}.weight_scale")
        if packed.dtype == torch.int32:
            return _pack_quantized(prefix, packed, scale, _required(get, has, f"{prefix}.weight_shape"), dtype)
        gs = _required(get, has, f"{prefix}.weight_global_scale").float().reshape(-1)[:1]
        return NVFP4Weight(packed, scale, gs.expand(packed.shape[0], 1).contiguous(), dtype, True,
                           f"{prefix}.weight_packed")
    w = get(name)
    if not has(f"{prefix}.weight_scale"):
        return w
    scale = get(f"{prefix}.weight_scale")
    if w.dtype == torch.uint8 and has(f"{prefix}.weight_scale_2"):
        gs = get(f"{prefix}.weight_scale_2").float().reshape(-1)[:1]
        return NVFP4Weight(w, scale, gs.expand(w.shape[0], 1).contiguous(), dtype, False, name)
    if w.dtype == torch.int8:
        return IntWeight(w, _rows(scale, w.shape, name), 8, dtype, name)
    if w.dtype == torch.float8_e4m3fn:
        return FP8Weight(w, _rows(scale, w.shape, name), dtype, name)
    raise CheckpointError(f"{name}: quantized weight of dtype {w.dtype} is not a known format")


def _required(get: Getter, has, name: str) -> torch.Tensor:
    if not has(name):
        raise CheckpointError(f"missing tensor {name} (a quantized weight needs it)")
    return get(name)


def _rows(scale: torch.Tensor, shape: torch.Size, name: str) -> torch.Tensor:
    """Scales as [N, G]: per tensor ([] / [1]) and per block ([N / bn, K / bk]) scales expanded over rows."""
    n, k = shape
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1).contiguous()
    if scale.dim() == 1 and scale.shape[0] == n:
        return scale[:, None]
    if scale.dim() == 2 and scale.shape[0] != n and scale.shape[0] > 0:
        block = -(-n // scale.shape[0])
        return scale.repeat_interleave(block, dim=0)[:n].contiguous()
    if scale.dim() != 2 or k % scale.shape[-1]:
        raise CheckpointError(f"{name}: scale of shape {list(scale.shape)} does not fit a weight of shape "
                              f"{list(shape)}")
    return scale


def _pack_quantized(prefix: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, dtype) -> IntWeight:
    """compressed-tensors' dense int32 packing -> IntWeight (int8 codes, or int4 repacked group-locally)."""
    n, k = (int(x) for x in shape.reshape(-1)[-2:])
    bits = packed.shape[-1] * 32 // k if k else 0
    if bits not in (4, 8) or packed.shape != (n, -(-k * bits // 32)):
        raise CheckpointError(f"{prefix}.weight_packed: shape {list(packed.shape)} does not hold a 4- or 8-bit "
                              f"weight of shape {[n, k]}")
    scale = _rows(scale, torch.Size((n, k)), f"{prefix}.weight_scale")
    raw = packed.contiguous().view(torch.uint8)  # little-endian: code i sits at bit i * bits of the row
    group = k // scale.shape[-1]
    if bits == 4 and group % 2:
        raise CheckpointError(f"{prefix}.weight_scale: int4 group size {group} is odd")
    if bits == 8:
        q = (raw[:, :k] ^ 0x80).view(torch.int8)
    elif group % 4 == 0:
        q = _repack_int4(raw[:, :k // 2], group)
    else:
        codes = (torch.stack([raw & 15, raw >> 4], dim=-1).view(n, -1)[:, :k].view(torch.int8) - 8)
        q = pack_int4(codes.contiguous(), group)
    return IntWeight(q.contiguous(), scale, bits, dtype, f"{prefix}.weight_packed")


def _repack_int4(raw: torch.Tensor, group: int) -> torch.Tensor:
    """compressed-tensors int4 bytes [N, K / 2] (byte j: codes 2j | 2j+1 << 4, each + 8) -> IntWeight's group-local
    nibbles (byte j of a group: column j | column j + g/2 << 4, two's complement) with byte operations only.

    In a group, columns [0, g/2) fill its first g/4 bytes (h1) and columns [g/2, g) the last g/4 (h2); IntWeight's
    byte 2m holds columns 2m and 2m + g/2 (low nibbles of h1[m], h2[m]), byte 2m+1 columns 2m+1 and 2m+1 + g/2 (their
    high nibbles); XOR 0x88 turns each offset code into two's complement. numpy, single-threaded: on a busy CPU
    torch's threaded byte kernels were 10x slower for these ~1 MB pieces.
    """
    n = raw.shape[0]
    halves = raw.numpy().reshape(n, -1, 2, group // 4)
    h1, h2 = halves[:, :, 0], halves[:, :, 1]
    out = np.empty((n, halves.shape[1], group // 4, 2), dtype=np.uint8)
    np.bitwise_or(h1 & 15, h2 << 4, out=out[..., 0])
    np.bitwise_or(h1 >> 4, h2 & 0xF0, out=out[..., 1])
    out ^= 0x88
    return torch.from_numpy(out.reshape(n, -1))


def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    """dest[...] = src; same-dtype CPU copies as bytes through numpy (single-threaded, see _repack_int4)."""
    if dest.dtype != src.dtype or dest.device.type != "cpu" or src.device.type != "cpu" or not dest.is_contiguous():
        dest.copy_(src)
        return
    np.copyto(dest.view(torch.uint8).numpy(), src.contiguous().view(torch.uint8).numpy())
