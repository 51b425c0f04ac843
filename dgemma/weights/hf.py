"""Hugging Face checkpoints: directory / repo id resolution (the hub's part in `weights.hub`), one declared name
map, mmap loading with shape checks.

A reference checkpoint stores the decoder (`model.decoder.*`); the encoder shares those weights except its
`layer_scalar` buffers. The vision tower and embedder (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`)
load into `vision.tower.*` / `vision.embed.*` when the files hold them (never quantized: in the model's float dtype);
without them the model has no vision tower. The tied `lm_head` is ignored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dgemma.config import ModelConfig
from dgemma.errors import CheckpointError, ConfigError
from dgemma.jsonfile import read_json
from dgemma.model import DiffusionGemma
from dgemma.quant import QuantizedWeight, QuantSpec
from dgemma.weights.prequantized import detect, plan
from dgemma.weights.files import save_tensors
from dgemma.weights.prequantized import read as read_prequantized
from dgemma.weights.quantize import bits_for, install, quantize_view

log = logging.getLogger(__name__)

_DECODER = "model.decoder."
_ENCODER = "model.encoder.language_model."
_IGNORED = re.compile(r"^(lm_head\.weight|model\.encoder\.(vision_tower|embed_vision)\..*"
                      r"|model\.encoder\.language_model\.(?!layers\.\d+\.layer_scalar$).*)$")
_ENCODER_SCALAR = re.compile(r"^model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar$")
_VISION = {"vision.tower.": "model.encoder.vision_tower.", "vision.embed.": "model.encoder.embed_vision."}


def resolve_checkpoint(path_or_repo: str | Path, revision: str | None = None) -> Path:
    """A local directory, or a Hugging Face repo id: its cached snapshot, else downloaded (`weights.hub`);
    `revision` (a branch, tag or commit of the repo) applies to a repo id only."""
    path = Path(path_or_repo).expanduser()
    name = str(path_or_repo)
    if path.is_dir():
        if revision is not None:
            raise CheckpointError(f"{name} is a local directory: a revision applies to a Hugging Face repo id only")
        return path
    if path.exists():
        raise CheckpointError(f"{name} is neither a checkpoint directory (with config.json) nor a GGUF file "
                              "(it does not start with the GGUF magic)")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith((".", "/")):
        from dgemma.weights.hub import snapshot

        return snapshot(name, revision)
    raise CheckpointError(f"checkpoint directory not found: {name}")


def read_config(directory: Path) -> ModelConfig:
    return ModelConfig.from_hf(read_json(directory / "config.json", required=True))


def tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> file, from `model.safetensors` or a sharded index."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: invalid shard index (no weight_map object)")
        files = {name: directory / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{directory}: missing shard {shard.name} listed in {index.name}")
        return files
    single = directory / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{directory}: missing model.safetensors (or model.safetensors.index.json)")
    with _open(single) as f:
        return {name: single for name in f.keys()}


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path.name}: corrupt or truncated safetensors file ({e})") from None


def checkpoint_name(param: str) -> str:
    """dgemma parameter name -> checkpoint tensor name."""
    m = re.fullmatch(r"layers\.(\d+)\.encoder_layer_scalar", param)
    if m:
        return f"{_ENCODER}layers.{m.group(1)}.layer_scalar"
    for ours, theirs in _VISION.items():
        if param.startswith(ours):
            return theirs + param[len(ours):]
    return _DECODER + param


def with_stored_vision(cfg: ModelConfig, names) -> ModelConfig:
    """`cfg` with its vision tower only if the checkpoint's tensor names hold one (a config always declares one:
    the reference builds a tower whatever the files hold)."""
    has = any(n.startswith(_VISION["vision.tower."]) for n in names)
    return cfg if has or cfg.vision is None else dataclasses.replace(cfg, vision=None)


def _target_names(model: DiffusionGemma) -> dict[str, tuple[torch.Size, str]]:
    names = {n: (p.shape, "param") for n, p in model.named_parameters()}
    names.update({n: (b.shape, "buffer") for n, b in model.named_buffers() if _is_persistent(model, n)})
    return names


def _is_persistent(model: torch.nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return leaf not in module._non_persistent_buffers_set


def load_model(path_or_repo: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", quantize: QuantSpec | None = None,
               built: dict[str, QuantizedWeight] | None = None) -> DiffusionGemma:
    """Build the model on the meta device and materialise each tensor once, in `dtype`, from mmapped files;
    with `quantize`, the weights it covers are quantized a chunk at a time straight from the memory map. `built`:
    weights already made (parameter name -> weight, from the kernel cache), installed instead of read."""
    directory = resolve_checkpoint(path_or_repo)
    device = torch.device(device)
    cfg = read_config(directory)  # first: a wrong model_type is the error to report, whatever the files
    files = tensor_files(directory)
    cfg = with_stored_vision(cfg, files)
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    targets = _target_names(model)
    by_ckpt = {checkpoint_name(n): n for n in targets}
    sources, consumed = _prequantized(directory, files, by_ckpt, targets, quantize)
    _check_names({n: f for n, f in files.items() if n not in consumed}, by_ckpt, set(sources))
    _materialise(model, by_ckpt, targets, files, sources, quantize, dtype, device, built or {})
    for ckpt_name, param in by_ckpt.items():
        if ckpt_name not in files and ckpt_name not in sources:
            log.warning("%s missing: the encoder uses the decoder's layer_scalar", ckpt_name)
            shared = model.get_buffer(param.replace("encoder_layer_scalar", "layer_scalar"))
            _assign(model, param, shared.clone(), targets[param][0], dtype, device)
    _init_derived(model, device)
    return model.eval()


def _materialise(model, by_ckpt, targets, files, sources, quantize, dtype, device, built) -> None:
    """Every tensor of the checkpoint into the meta model: already built, pre-quantized pieces, quantize-on-load, or
    plain."""
    handles: dict[Path, object] = {}
    direct: dict[Path, DirectReader] = {}

    def reader(path: Path) -> DirectReader:
        if path not in direct:  # one header parse per shard (setdefault would parse it on every call)
            direct[path] = DirectReader(path)
        return direct[path]

    def get(name: str) -> torch.Tensor:
        return reader(files[name]).get(name)

    for ckpt_name, param in by_ckpt.items():
        if param in built:
            _check_shape(param, built[param].shape, targets[param][0])
            install(model, param, built[param].to(device))
            continue
        if ckpt_name in sources:
            value = read_prequantized(ckpt_name, sources[ckpt_name], get, files.__contains__, dtype).to(device)
            if isinstance(value, QuantizedWeight):
                _check_shape(param, value.shape, targets[param][0])
                install(model, param, value)
            else:
                _assign(model, param, value, targets[param][0], dtype, device)
            continue
        if ckpt_name not in files:
            continue  # a missing encoder layer_scalar; filled by the caller
        path = files[ckpt_name]
        if quantize is not None:  # plain reads: no page of the float file stays mapped and counted in RSS
            f = reader(path)
        else:
            if path not in handles:
                handles[path] = _open(path)
            f = handles[path]
        if (bits := bits_for(quantize, param)) is not None:
            _check_shape(param, f.get_slice(ckpt_name).get_shape(), targets[param][0])
            install(model, param, quantize_view(f.get_slice(ckpt_name), ckpt_name, bits, quantize, dtype, device))
            continue
        _assign(model, param, _read(f, ckpt_name, files[ckpt_name], dtype, device), targets[param][0], dtype,
                device)


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class DirectReader:
    """Tensors of one safetensors file read with plain file reads, not through the memory map: loading a large
    pre-quantized checkpoint then never counts the file's pages in the process's resident memory."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                self.header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise CheckpointError(f"{path.name}: corrupt or truncated safetensors file ({e})") from None
        self.base = 8 + n

    def get(self, name: str) -> torch.Tensor:
        info = self.header[name]
        lo, hi = info["data_offsets"]
        return self.read(name, 0, hi - lo).reshape(info["shape"])

    def read(self, name: str, skip: int, nbytes: int) -> torch.Tensor:
        """`nbytes` of tensor `name` from byte `skip` of its data, as a flat tensor of its dtype."""
        info = self.header[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        out = torch.empty(nbytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.base + info["data_offsets"][0] + skip)
            if f.readinto(out.numpy()) != nbytes:
                raise CheckpointError(f"{self.path.name}: truncated tensor {name}")
        return out.view(dtype)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get(name)

    def get_slice(self, name: str) -> DirectSlice:
        return DirectSlice(self, name)


class DirectSlice:
    """Rows of one tensor of a `DirectReader`, with the part of safetensors' slice API the loaders use."""

    def __init__(self, reader: DirectReader, name: str):
        self.reader, self.name, self.info = reader, name, reader.header[name]

    def get_shape(self) -> list[int]:
        return list(self.info["shape"])

    def get_dtype(self) -> str:
        return self.info["dtype"]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        shape = self.info["shape"]
        lo, hi, _ = rows.indices(shape[0])
        lo_byte, hi_byte = self.info["data_offsets"]
        row = (hi_byte - lo_byte) // shape[0] if shape[0] else 0
        return self.reader.read(self.name, lo * row, max(0, hi - lo) * row).reshape(-1, *shape[1:])


def _prequantized(directory: Path, files, by_ckpt, targets, quantize) -> tuple[dict[str, list[str]], set[str]]:
    """Checkpoint tensors stored quantized or as unfused experts: their pieces, and the file tensors they use."""
    method = detect(directory)
    if method is None:
        return {}, set()
    if quantize is not None:
        raise CheckpointError(f"{directory.name} is already quantized ({method}); load it without --quantize")
    return plan(files, {c: tuple(targets[p][0]) for c, p in by_ckpt.items()})


def _check_names(files: dict[str, Path], by_ckpt: dict[str, str], provided: set[str] = frozenset()) -> None:
    unexpected = sorted(n for n in files if n not in by_ckpt and not _IGNORED.match(n))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"unexpected tensor {unexpected[0]}{more} in checkpoint")
    missing = sorted(n for n in by_ckpt if n not in files and n not in provided and not _ENCODER_SCALAR.match(n))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]}{more} in checkpoint")


_CONVERT_ROWS_BYTES = 16 << 20


def _read(f, name: str, path: Path, dtype: torch.dtype | None, device) -> torch.Tensor:
    """The tensor in `dtype` (None: as stored) on `device`; converted slice by slice so a dtype change costs ~16 MB,
    not a copy."""
    try:
        view = f.get_slice(name)
        shape = view.get_shape()
        stored = view.get_dtype()
        if dtype is None:
            return f.get_tensor(name).to(device)
        if not shape or (_DTYPES.get(stored) == dtype and device.type == "cpu"):
            return f.get_tensor(name)  # zero-copy on the memory map
        out = torch.empty(shape, dtype=dtype, device=device)
        row_bytes = max(1, math.prod(shape[1:]) * 4)
        step = max(1, _CONVERT_ROWS_BYTES // row_bytes)
        for lo in range(0, shape[0], step):
            out[lo:lo + step] = view[lo:lo + step].to(device=device, dtype=dtype)
        return out
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path.name}: cannot read tensor {name} ({e})") from None


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def _check_shape(name: str, got, shape: torch.Size) -> None:
    if tuple(got) != tuple(shape):
        raise CheckpointError(f"tensor {checkpoint_name(name)} has shape {list(got)}, expected {list(shape)}")


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
            device) -> None:
    _check_shape(name, tensor.shape, shape)
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    value = tensor.to(device=device, dtype=dtype)
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _init_derived(model: DiffusionGemma, device) -> None:
    """Non-persistent buffers (RoPE frequencies) are computed, not loaded."""
    from dgemma.model.layers import rope_inv_freq

    for block in model.layers:
        attn = block.self_attn
        attn.inv_freq = rope_inv_freq(model.cfg.text.rope(attn.sliding), attn.head_dim).to(device)


def save_model(model: DiffusionGemma, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json and model.safetensors in the layout the reference loads (decoder + encoder scalars)."""
    if any(isinstance(m, QuantizedWeight) for m in model.modules()):
        raise CheckpointError("this model holds quantized weights: write it with `dgemma quantize` "
                              "(weights.compressed.save_compressed), not as a float checkpoint")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
        tensors[checkpoint_name(name)] = t
    tmp = directory / "model.safetensors.tmp"
    save_tensors(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(directory / "model.safetensors")
    config = model.cfg.to_hf()
    config["dtype"] = str(dtype or model.dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


__all__ = ["ConfigError", "load_model", "resolve_checkpoint", "save_model", "read_config"]
