"""The kernel-layout cache: a checkpoint's int4 and 2D int8 weights in torch's CPU int4 layout (quant/int4cpu.py),
written once after a load that repacked them and memory-mapped by every later load, so a load costs what reading
the file costs.

One safetensors file per checkpoint and environment, `.dgemma-cache/int4cpu-<env>.safetensors` in the checkpoint
directory (`.dgemma-cache/FILE.gguf.int4cpu-<env>.safetensors` beside a GGUF file; when that is not writable or is a
Hugging Face cache snapshot, under `$XDG_CACHE_HOME/dgemma/kernels/<hash>/`; `DGEMMA_KERNEL_CACHE=off`
disables it, `=DIR` puts it under DIR). Per converted weight P: `P.packed` (uint8, torch's layout: [N, K / 2]; a 2D
int8 weight's two int4 rows a row, [2N, K / 2]), `P.scales`
(float16; an expert stack's transposed [E, K/g, N], the order it keeps them in) and, for 2D weights, `P.scale_zero`
(the kernel's bf16 table). The file's metadata holds the key it was written for: the format version, torch's
version, the CPU capability and probed layout, the dtype and quantization spec, and each checkpoint file's name,
size, mtime and header hash. Anything different, a file of the wrong size, a malformed header or a sampled checksum
that fails, and the cache is ignored (a warning): the load repacks and writes it again. Writes go to a temporary
file that is renamed into place (concurrent loads never see half a file). Small models (under `MIN_BYTES` of converted
weights, whose repacking takes well under a second) write nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import time
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows: no lock, the rename still keeps readers safe
    fcntl = None

from dgemma.quant import int4cpu
from dgemma.quant.int4cpu import CPUInt4Weight, CPUInt8SplitWeight
from dgemma.weights.files import readable

log = logging.getLogger(__name__)

VERSION = 1
ENV = "DGEMMA_KERNEL_CACHE"
DIRNAME = ".dgemma-cache"
MIN_BYTES = 256 << 20  # converted weights below this repack in well under a second
SAMPLE = 4096  # bytes at each end of every tensor that the checksum covers
_DTYPES = {torch.uint8: "U8", torch.float16: "F16", torch.bfloat16: "BF16"}
_TORCH = {v: k for k, v in _DTYPES.items()}


class CacheError(ValueError):
    """A cache file that cannot be used (then ignored)."""


class KernelCache:
    """The cache of one checkpoint (a directory, or a GGUF file), dtype and quantization spec in this environment."""

    def __init__(self, source: Path, dtype: torch.dtype, spec_name: str | None):
        env = {"version": VERSION, "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
               "layout": list(int4cpu.layout() or ()), "dtype": str(dtype), "quantize": spec_name}
        stem = f"{source.name}." if source.is_file() else ""  # GGUF files: one cache each, beside them
        self.path = _location(source) / f"{stem}int4cpu-{_digest(env)}.safetensors"
        self.key = json.dumps({**env, "files": fingerprint(source)}, sort_keys=True)
        self.dtype = dtype

    def weights(self) -> dict[str, CPUInt4Weight]:
        """The cached weights by parameter name, memory-mapped; {} when there is no usable cache."""
        if not self.path.is_file():
            return {}
        try:
            weights = read(self.path, self.key, self.dtype)
            log.info("memory-mapped %d converted weights from the kernel cache %s", len(weights), self.path)
            return weights
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            log.warning("ignoring the kernel cache %s (%s): repacking", self.path, e)
            return {}

    def store(self, module: torch.nn.Module) -> bool:
        """Write `module`'s converted weights (when they are worth it and the disk has room); False if not."""
        weights = {n: m for n, m in module.named_modules() if isinstance(m, CPUInt4Weight)}
        tensors = {f"{n}.{k}": t for n, w in weights.items() for k, t in _tensors(w).items()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size < MIN_BYTES:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(f".{self.path.name}.lock"), "w") as lock:
                if fcntl is not None:  # replicas loading at once: one of them writes
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if shutil.disk_usage(self.path.parent).free < size + (1 << 30):
                    log.warning("not writing the kernel cache %s: under %.1f GB free", self.path, size / 1e9 + 1)
                    return False
                t0 = time.perf_counter()
                shapes = {n: list(w.shape) for n, w in weights.items()}
                write(self.path, tensors, {"dgemma.key": self.key, "dgemma.shapes": json.dumps(shapes)})
            log.info("wrote the kernel cache %s (%.2f GB, %.1f s)", self.path, size / 1e9, time.perf_counter() - t0)
            return True
        except OSError as e:  # BlockingIOError: another process is writing it
            log.warning("not writing the kernel cache %s (%s)", self.path, e)
            return False


def open_cache(source: Path, dtype: torch.dtype, spec_name: str | None) -> KernelCache | None:
    """The cache for a checkpoint directory or GGUF file, or None when disabled (`DGEMMA_KERNEL_CACHE=off`) or of
    no use here."""
    if os.environ.get(ENV, "").lower() in ("0", "off", "no", "false") or int4cpu.layout() is None:
        return None
    try:
        return KernelCache(source, dtype, spec_name)
    except OSError as e:  # a file that cannot be stat'ed or hashed: the load itself will say what is wrong
        log.warning("no kernel cache for %s (%s)", source, e)
        return None


def fingerprint(source: Path) -> list:
    """[name, size, mtime_ns, header hash] of every file a load reads tensors or the config from."""
    if source.is_file():
        paths = [source]
    else:
        names = {"config.json", "model.safetensors.index.json"} | {p.name for p in source.glob("*.safetensors")}
        paths = [source / n for n in sorted(names) if (source / n).is_file()]
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns, _header_hash(p)] for p in paths]


def _header_hash(path: Path) -> str:
    """sha256 of a safetensors file's header (a JSON file: all of it; a GGUF file: its first MB)."""
    with open(path, "rb") as f:
        if path.suffix == ".json":
            return hashlib.sha256(f.read()).hexdigest()[:32]
        if path.suffix != ".safetensors":
            return hashlib.sha256(f.read(1 << 20)).hexdigest()[:32]
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        return hashlib.sha256(head + f.read(min(n, 100 << 20))).hexdigest()[:32]


def _location(source: Path) -> Path:
    setting = os.environ.get(ENV, "")
    if setting:
        return Path(setting).expanduser() / _digest(str(source.resolve()))
    directory = source if source.is_dir() else source.parent
    beside = directory / DIRNAME
    hub = any(part.startswith("models--") for part in directory.resolve().parts)  # the Hugging Face cache's own
    if not hub and os.access(beside if beside.is_dir() else directory, os.W_OK):
        return beside
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "dgemma" / "kernels" / _digest(str(source.resolve()))


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _tensors(w: CPUInt4Weight) -> dict[str, torch.Tensor]:
    if len(w.shape) == 2:
        return {"packed": w.packed, "scales": w.scales, "scale_zero": w.scale_zero}
    return {"packed": w.packed, "scales": w.scales.transpose(-1, -2)}  # contiguous: the order the stack keeps


# ---- the file -------------------------------------------------------------------------------------------------------
def write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file written tensor by tensor from memory (safetensors' own writer copies every tensor to bytes
    first: twice the model in memory), with a checksum of each tensor's ends; atomically renamed into `path`."""
    header, offset = {}, 0
    for name, t in tensors.items():
        if not t.is_contiguous() or t.dtype not in _DTYPES:
            raise ValueError(f"{name}: cannot cache a {t.dtype} tensor of strides {t.stride()}")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {**metadata, "dgemma.version": str(VERSION),
                              "dgemma.samples": _samples(_bytes(t) for t in tensors.values())}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for t in tensors.values():
                f.write(_bytes(t).numpy())
            f.flush()
            os.fsync(f.fileno())
        readable(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read(path: Path, key: str, dtype: torch.dtype) -> dict[str, CPUInt4Weight]:
    """The weights of a cache file written for `key`, their tensors views of one private memory map of it."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__")
    if meta.get("dgemma.version") != str(VERSION) or meta.get("dgemma.key") != key:
        raise CacheError("written for another checkpoint, torch, CPU or setting")
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if path.stat().st_size != 8 + n + end:
        raise CacheError(f"{path.stat().st_size} bytes, its header says {8 + n + end}")
    data = torch.from_file(str(path), shared=False, size=8 + n + end, dtype=torch.uint8)[8 + n:]
    tensors = {name: _view(data, name, info) for name, info in header.items()}
    if _samples(_bytes(t) for t in tensors.values()) != meta.get("dgemma.samples"):
        raise CacheError("checksum mismatch")
    return {p: _weight(tensors, p, shape, dtype) for p, shape in json.loads(meta["dgemma.shapes"]).items()}


def _view(data: torch.Tensor, name: str, info: dict) -> torch.Tensor:
    lo, hi = info["data_offsets"]
    dtype = _TORCH[info["dtype"]]
    t = data[lo:hi].view(dtype)
    if t.numel() != _numel(info["shape"]):
        raise CacheError(f"{name}: {hi - lo} bytes do not hold {info['shape']}")
    return t.view(info["shape"])


def _weight(tensors: dict, param: str, shape: list[int], dtype: torch.dtype) -> CPUInt4Weight:
    """One weight from its cached tensors, after checking their shapes against its logical shape."""
    packed, scales = tensors[f"{param}.packed"], tensors[f"{param}.scales"]
    *lead, n, k = shape
    halves = 2 if len(shape) == 2 and packed.shape[0] == 2 * n else 1  # an int8 weight: two int4 rows a row
    groups = scales.shape[-1] if len(shape) == 2 else scales.shape[-2]
    if (packed.dtype != torch.uint8 or list(packed.shape) != [*lead, halves * n, k // 2]
            or scales.dtype != torch.float16 or groups <= 0 or k % groups or k // groups not in int4cpu.GROUPS):
        raise CacheError(f"{param}: cached tensors do not fit shape {shape}")
    if len(shape) == 2:
        table = tensors[f"{param}.scale_zero"]
        if list(scales.shape) != [n, groups] or list(table.shape) != [groups, halves * n, 2]:
            raise CacheError(f"{param}: cached scales do not fit shape {shape}")
        cls = CPUInt8SplitWeight if halves == 2 else CPUInt4Weight
        return cls(packed, scales, tuple(shape), dtype, scale_zero=table)
    if list(scales.shape) != [*lead, groups, n]:
        raise CacheError(f"{param}: cached scales do not fit shape {shape}")
    return CPUInt4Weight(packed, scales.transpose(-1, -2), tuple(shape), dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _samples(flat) -> str:
    """A hash over the first and last `SAMPLE` bytes of every tensor (a truncated or overwritten file; reading all of
    it would cost what the cache saves)."""
    h = hashlib.sha256()
    for b in flat:
        h.update(b[:SAMPLE].numpy().tobytes())
        h.update(b[-SAMPLE:].numpy().tobytes())
    return h.hexdigest()


def _numel(shape: list[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
