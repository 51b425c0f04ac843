"""`dgemma quantize`: write a checkpoint in the compressed-tensors layout (pack-quantized int4 / int8), which dgemma
reloads with identical logits and vLLM / transformers can also read.

The source is quantized on load (`load_model(..., quantize=spec)`: the float weights are never all in memory), then
written tensor by tensor into shards of at most `SHARD_BYTES`: per quantized linear `P` the tensors `P.weight_packed`
(int32, codes + 2^(b-1) packed from bit 0), `P.weight_scale` [N, K / group] and `P.weight_shape`; experts unfused into
`experts.E.{gate,up,down}_proj` as vLLM's Gemma 4 loader expects. Everything else (norms, routers, scalars) is
written as loaded. The directory appears only when complete (written beside it, then renamed).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from dgemma.errors import DgemmaError
from dgemma.quant import IntWeight, NVFP4Weight, QuantizedWeight, unpack_int4
from dgemma.quant.int4cpu import CPUInt4Weight
from dgemma.weights.files import save_tensors
from dgemma.weights.hf import checkpoint_name

SHARD_BYTES = 2 << 30


def ct_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes [N, K] -> compressed-tensors' int32 packing [N, ceil(K * bits / 32)] (little-endian hosts)."""
    n, k = codes.shape
    per_word = 32 // bits
    padded = torch.zeros(n, -(-k // per_word) * per_word, dtype=torch.uint8)
    padded[:, :k] = (codes + (1 << (bits - 1))).to(torch.uint8)
    if bits == 4:
        padded = padded[:, 0::2] | (padded[:, 1::2] << 4)
    return padded.contiguous().view(torch.int32)


def linear_tensors(prefix: str, w: IntWeight | NVFP4Weight) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one 2D weight (pack-quantized int, or nvfp4-pack-quantized)."""
    if isinstance(w, NVFP4Weight):
        glob = w.global_scale.cpu()
        if not torch.equal(glob, glob[:1].expand_as(glob)):
            raise DgemmaError(f"{prefix}: one linear needs one NVFP4 global scale")
        return {f"{prefix}.weight_packed": w.packed.cpu(), f"{prefix}.weight_scale": w.scales.cpu(),
                f"{prefix}.weight_global_scale": glob[0].reshape(1)}
    codes = w.qweight if w.bits == 8 else unpack_int4(w.qweight, w.group_size)
    return {f"{prefix}.weight_packed": ct_pack(codes.cpu(), w.bits), f"{prefix}.weight_scale": w.scales.cpu(),
            f"{prefix}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}


def module_tensors(param: str, value) -> dict[str, torch.Tensor]:
    """Checkpoint tensors for one dgemma parameter (quantized stacks unfused per expert)."""
    name = checkpoint_name(param)
    if not isinstance(value, QuantizedWeight):
        return {name: value.detach().cpu().contiguous()}
    if isinstance(value, CPUInt4Weight):
        value = value.to_int()
    if not isinstance(value, (IntWeight, NVFP4Weight)):
        raise DgemmaError(f"{name}: writing {value.format} weights is not supported")
    if len(value.shape) == 2:
        return linear_tensors(name.removesuffix(".weight"), value)
    out = {}
    base = name.rsplit(".", 1)[0]
    for e in range(value.shape[0]):
        expert = _take(value, lambda t: t[e])
        if name.endswith("gate_up_proj"):
            half = expert.shape[0] // 2
            for k, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None))):
                out.update(linear_tensors(f"{base}.{e}.{k}", _take(expert, lambda t: t[rows])))
        else:
            out.update(linear_tensors(f"{base}.{e}.down_proj", expert))
    return out


def _take(w: QuantizedWeight, index) -> QuantizedWeight:
    """The same weight over `index` of each persistent buffer (one expert, or some rows)."""
    return w.rebuild({n: index(t) for n, t in w.state_dict().items()})


def quantization_config(model) -> dict:
    """config.json's quantization_config: one group per (bits, group size) in use, targets by module name."""
    groups: dict[tuple[str, int, int], list[str]] = {}
    for n, m in model.named_modules():
        if isinstance(m, (IntWeight, NVFP4Weight)):
            groups.setdefault((m.format, 4 if m.format == "nvfp4" else m.bits, m.group_size), []).append(n)
    config_groups = {
        f"group_{i}": {"targets": sorted({f"re:.*{_target(n)}$" for n in names}),
                       "weights": {"num_bits": bits, "type": "float" if fmt == "nvfp4" else "int", "symmetric": True,
                                   "strategy": "tensor_group" if fmt == "nvfp4" else "group", "group_size": group,
                                   "dynamic": False, "observer": "minmax"},
                       "input_activations": None, "output_activations": None, "format": _FORMATS[fmt]}
        for i, ((fmt, bits, group), names) in enumerate(sorted(groups.items()))}
    formats = {g["format"] for g in config_groups.values()}
    return {"quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed", "config_groups": config_groups, "ignore": ["re:.*router.*"],
            "producer": "dgemma quantize"}


_FORMATS = {"int4": "pack-quantized", "int8": "pack-quantized", "nvfp4": "nvfp4-pack-quantized"}


def _target(module: str) -> str:
    """A module-name pattern for one quantized weight (experts: every unfused expert's linears)."""
    name = re.sub(r"^.*layers\.\d+\.", "", module.removesuffix(".weight")).replace(".", r"\.")
    if name.endswith(r"experts\.gate_up_proj"):
        return name.removesuffix(r"gate_up_proj") + r"\d+\.(gate|up)_proj"
    if name.endswith(r"experts\.down_proj"):
        return name.removesuffix(r"down_proj") + r"\d+\.down_proj"
    return name


def check_out(out: Path) -> None:
    """`out` may be written: it does not exist or is empty (callers with long work before writing check first)."""
    if out.exists() and any(out.iterdir()):
        raise DgemmaError(f"{out} exists and is not empty; choose another --out")


def save_compressed(model, source: Path, out: Path) -> Path:
    """Write `model` (quantized on load from `source`) as a compressed-tensors checkpoint at `out`, atomically."""
    check_out(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(model, source, tmp)
        if out.exists():
            out.rmdir()
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write(model, source: Path, tmp: Path) -> None:
    state = model.state_dict()
    items = [(n, p) for n, p in model.named_parameters()]
    items += [(n, b) for n, b in model.named_buffers() if n in state and not _inside_quantized(model, n)]
    items += [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedWeight)]
    shards, current, size = [], {}, 0
    for param, value in sorted(items, key=lambda x: x[0]):
        for name, t in module_tensors(param, value).items():
            current[name] = t
            size += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
    shards.append(current)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_tensors(tensors, tmp / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}) + "\n")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(model)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in source.iterdir():
        if f.is_file() and not f.name.startswith(("model", "config.json")) and f.suffix != ".safetensors":
            shutil.copyfile(f, tmp / f.name)


def _inside_quantized(model, buffer: str) -> bool:
    owner = buffer.rsplit(".", 1)[0]
    return isinstance(model.get_submodule(owner), QuantizedWeight)
