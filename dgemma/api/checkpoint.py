"""Opening a checkpoint for the Python API: where it is (a directory, a Hugging Face repo id, fetched unless cached,
a GGUF file or the bundled demo), the device and dtype it runs in, quantization while loading, and torch.compile."""

from __future__ import annotations

from pathlib import Path

import torch

from dgemma import parallel
from dgemma.dtypes import native_bf16, parse_dtype
from dgemma.errors import DgemmaError
from dgemma.jsonfile import read_json
from dgemma.quant import a8, int4cpu, parse_quantize
from dgemma.sampling.fused import vocab_chunk
from dgemma.tokenizer import Tokenizer
from dgemma.weights import is_gguf, load_gguf_model, load_model, resolve_checkpoint
from dgemma.weights.kernel_cache import open_cache

DEMO_MODEL = Path(__file__).parent.parent / "assets" / "demo"
DEMO_NAME = "demo"  # the bundled model's name (the server's model id for it), unless a local path has that name
QUANT_DEVICES = ("cpu", "cuda")  # where the decode ops (bit shifts on uint8, int8 casts) are known to run
AUTO_FLOAT32_BYTES = 4 << 30  # "auto" upcasts bf16 checkpoints up to this size where bf16 is slow


def locate(path_or_repo: str | Path | None, revision: str | None = None) -> tuple[Path, bool]:
    """Where a checkpoint is, and whether it is a GGUF file: the bundled demo (None or "demo"), a GGUF file, a
    directory, or a Hugging Face repo id (fetched unless cached; `revision` applies to a repo id only)."""
    demo = path_or_repo is None or (str(path_or_repo) == DEMO_NAME and not Path(DEMO_NAME).exists())
    if revision is not None and (demo or is_gguf(path_or_repo)):
        raise DgemmaError("--revision applies to a Hugging Face repo id")
    if demo:
        if not (DEMO_MODEL / "config.json").is_file():
            raise DgemmaError("the bundled demo model is missing from this install; pass --model PATH")
        path_or_repo = DEMO_MODEL
    if is_gguf(path_or_repo):
        return Path(path_or_repo).expanduser(), True
    return resolve_checkpoint(path_or_repo, revision), False


def open_checkpoint(path_or_repo: str | Path | None, dtype: str | torch.dtype, device: str | torch.device,
                    compile: bool, quantize: str | None, revision: str | None = None,
                    tensor_parallel_size: int = 1) -> tuple[torch.nn.Module, Tokenizer | None, Path, dict]:
    """(the DiffusionGemma module, its tokenizer or None, the checkpoint directory or GGUF file, its generation
    config) for `dgemma.load`, whose docstring says what each argument does. Under tensor parallelism the
    checkpoint is read on the CPU, this rank's shard kept (`parallel.shard`) and only that moved to the device."""
    spec = parse_quantize(quantize)
    directory, gguf = locate(path_or_repo, revision)
    device = _device(device)
    _check_quantize(spec, device)
    group = None
    if tensor_parallel_size > 1:
        group, device = parallel.join(tensor_parallel_size, device)
    stored = spec if spec is None or spec.requantizes else None
    dtype, reader = _resolve_dtype(dtype, directory, device), torch.device("cpu") if group else device
    repacks = device.type == "cpu" and int4cpu.available()  # int4 weights into torch's CPU layout
    cache = open_cache(directory, dtype, stored and stored.name) if repacks and group is None else None
    built = cache.weights() if cache else None
    if gguf:
        module, tokenizer, generation = load_gguf_model(directory, dtype, reader, stored, built)
    else:
        module = load_model(directory, dtype, reader, stored, built)
        tokenizer, generation = Tokenizer.maybe_load(directory), read_json(directory / "generation_config.json")
    if group is not None:
        parallel.shard(module, group)
        module.to(device)
    if repacks and int4cpu.convert(module) and cache is not None:
        cache.store(module)  # the next load memory-maps what was just repacked (weights/kernel_cache.py)
    if spec is not None and spec.int8_activations and not a8.enable(module, module.embed_tokens.weight,
                                                                     vocab_chunk(device, module.lm_head.shard)):
        raise DgemmaError(f"quantize={spec.name}: {directory} has no quantized 2D weights to run with int8 "
                          "activations (int8+a8 or int4+a8 quantizes them while loading)")
    if compile:
        # dynamic shapes: the cache view grows every canvas; a new batch size compiles once more
        module.denoise = torch.compile(module.denoise, dynamic=True)
    return module, tokenizer, directory, generation


def _check_quantize(spec, device: torch.device) -> None:
    if spec is not None and device.type not in QUANT_DEVICES:
        raise DgemmaError(f"quantize={spec.name} runs on {' or '.join(QUANT_DEVICES)}, not on device {device}")
    if spec is not None and spec.int8_activations and not a8.available(device):
        raise DgemmaError(f"quantize={spec.name}: int8 activations need an x86 CPU build of PyTorch with oneDNN, "
                          f"not device {device}")


def _device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        raise DgemmaError(f"device {device!s} is not available ({e})") from None
    return device


def _resolve_dtype(dtype: str | torch.dtype, directory: Path, device: torch.device) -> torch.dtype:
    if dtype == "auto" and directory.is_file():  # GGUF: dequantised weights compute in float32 without native bf16
        return torch.bfloat16 if native_bf16(device.type) else torch.float32
    if dtype == "auto":
        config = read_json(directory / "config.json")  # {} when missing: load_model then says so
        saved = config.get("dtype") or config.get("torch_dtype")
        if saved != "bfloat16":
            return torch.float32
        small = sum(f.stat().st_size for f in directory.glob("*.safetensors")) <= AUTO_FLOAT32_BYTES
        return torch.float32 if small and not native_bf16(device.type) else torch.bfloat16
    return parse_dtype(dtype)
