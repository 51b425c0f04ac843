"""Write a random checkpoint with the real DiffusionGemma 26B-A4B shapes directly in int4, int8 or NVFP4
(compressed-tensors pack-quantized / nvfp4-pack-quantized, experts unfused as vLLM expects), never materialising a
float weight: random packed codes and constant scales (int4: float16 1 / (4 sqrt(fan_in)) per group of 32, weights of
root mean square 4.64 / (4 sqrt(fan_in)); int8: the scale giving the same root mean square; NVFP4: E4M3 block scales
of 1 and a global scale giving 1 / (4 sqrt(fan_in))). The tied embedding is int4 with NVFP4 (as `dgemma quantize
--to nvfp4` writes it), otherwise in the file's format; norms, routers and scalars bf16.

Shapes (the released checkpoint's config.json): hidden 2816, 30 layers (5 sliding : 1 full, last full), 16 heads;
sliding layers 8 KV heads of 256, full layers 2 KV heads of 512 (no v_proj); dense MLP 2112 beside 128 experts of
704, top-8; vocabulary 262,144; canvas 256. `--layers N` keeps the real widths with fewer layers (for profiling the
loader). Then run `dgemma bench --model OUT --steps N ...` on it (docs/performance.md, "The real shape").

    python benchmarks/real_shape.py --out DIR [--format int4|int8|nvfp4] [--layers 30] [--group 32]

Last stdout line: JSON {path, format, parameters, bytes, seconds}.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dgemma.config import FULL, SLIDING, ModelConfig, TextConfig  # noqa: E402
from dgemma.weights.compressed import SHARD_BYTES  # noqa: E402
from build_bench_checkpoint import GENERATION_CONFIG  # noqa: E402


def real_config(layers: int) -> ModelConfig:
    types = tuple(FULL if (i + 1) % 6 == 0 or i == layers - 1 else SLIDING for i in range(layers))
    text = TextConfig(
        vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, layer_types=types,
        per_layer={i: {"head_dim": 512, "num_key_value_heads": 2} for i, t in enumerate(types) if t == FULL},
        sliding_window=1024, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
        max_position_embeddings=262_144, eos_token_id=(1, 106, 50))
    return ModelConfig(text=text, canvas_length=256)


def shapes(cfg: ModelConfig):
    """(checkpoint prefix, [N, K], quantized) for every tensor the loader wants, experts unfused."""
    t, d = cfg.text, "model.decoder."
    yield f"{d}embed_tokens", (t.vocab_size, t.hidden_size), True
    for name in ("gate_proj", "up_proj"):
        yield f"{d}self_conditioning.{name}", (t.intermediate_size, t.hidden_size), True
    yield f"{d}self_conditioning.down_proj", (t.hidden_size, t.intermediate_size), True
    yield f"{d}self_conditioning.pre_norm.weight", (t.hidden_size,), False
    yield f"{d}norm.weight", (t.hidden_size,), False
    for i in range(t.num_hidden_layers):
        yield from layer_shapes(cfg, i)


def layer_shapes(cfg: ModelConfig, i: int):
    t, p = cfg.text, f"model.decoder.layers.{i}."
    spec, h = t.layer(i), t.hidden_size
    yield f"{p}self_attn.q_proj", (t.num_attention_heads * spec.head_dim, h), True
    yield f"{p}self_attn.k_proj", (spec.num_kv_heads * spec.head_dim, h), True
    if spec.sliding:
        yield f"{p}self_attn.v_proj", (spec.num_kv_heads * spec.head_dim, h), True
    yield f"{p}self_attn.o_proj", (h, t.num_attention_heads * spec.head_dim), True
    for norm in ("q_norm", "k_norm"):
        yield f"{p}self_attn.{norm}.weight", (spec.head_dim,), False
    yield f"{p}mlp.gate_proj", (t.intermediate_size, h), True
    yield f"{p}mlp.up_proj", (t.intermediate_size, h), True
    yield f"{p}mlp.down_proj", (h, t.intermediate_size), True
    for e in range(t.num_experts):
        yield f"{p}experts.{e}.gate_proj", (t.moe_intermediate_size, h), True
        yield f"{p}experts.{e}.up_proj", (t.moe_intermediate_size, h), True
        yield f"{p}experts.{e}.down_proj", (h, t.moe_intermediate_size), True
    yield f"{p}router.proj.weight", (t.num_experts, h), False
    yield f"{p}router.scale", (h,), False
    yield f"{p}router.per_expert_scale", (t.num_experts,), False
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                 "pre_feedforward_layernorm_2"):
        yield f"{p}{norm}.weight", (h,), False
    yield f"{p}layer_scalar", (1,), False
    yield f"model.encoder.language_model.layers.{i}.layer_scalar", (1,), False


POOL_WORDS = 1 << 24  # 64 MB of random int32 words; tensors take slices at random offsets (drawing each is slow)
E2M1_RMS = 2.93  # root mean square of the 16 E2M1 values, each code equally likely
INT4_RMS, INT8_RMS = 4.64, 73.9  # the same for the int4 codes -8..7 and the int8 codes -128..127


def random_bytes(n: int, g: torch.Generator, pool: torch.Tensor) -> torch.Tensor:
    """n random bytes: a slice of the pool at a random offset (wrapping), copied."""
    raw = pool.view(torch.uint8)
    start = int(torch.randint(0, raw.numel(), (1,), generator=g))
    reps = -(-(start + n) // raw.numel())
    return (raw.repeat(reps) if reps > 1 else raw)[start:start + n].clone()


def tensors_for(prefix: str, shape, quantized: bool, fmt: str, group: int, g: torch.Generator,
                pool: torch.Tensor) -> dict[str, torch.Tensor]:
    if not quantized:
        value = torch.randn(shape, generator=g) / math.sqrt(shape[-1]) if prefix.endswith("router.proj.weight") \
            else torch.ones(shape)
        return {prefix: value.to(torch.bfloat16)}
    n, k = shape
    if fmt == "nvfp4" and not prefix.endswith("embed_tokens"):
        return {f"{prefix}.weight_packed": random_bytes(n * k // 2, g, pool).view(n, k // 2),
                f"{prefix}.weight_scale": torch.ones(n, k // 16).to(torch.float8_e4m3fn),
                f"{prefix}.weight_global_scale": torch.tensor([4 * math.sqrt(k) * E2M1_RMS])}
    bits = 8 if fmt == "int8" else 4
    packed = random_bytes(n * k * bits // 8, g, pool).view(torch.int32).view(n, k * bits // 32)
    # int8: the scale that gives int4's weights their root mean square (uniform codes: RMS 4.64 vs 73.9)
    rms = 1 / (4 * math.sqrt(k)) * (INT4_RMS / INT8_RMS if bits == 8 else 1)
    scale = torch.full((n, k // group), rms, dtype=torch.float16)
    return {f"{prefix}.weight_packed": packed, f"{prefix}.weight_scale": scale,
            f"{prefix}.weight_shape": torch.tensor([n, k])}


def quantization_config(fmt: str, group: int) -> dict:
    bits = 8 if fmt == "int8" else 4
    intq = {"format": "pack-quantized", "weights": {"num_bits": bits, "type": "int", "symmetric": True,
                                                    "strategy": "group", "group_size": group}}
    if fmt in ("int4", "int8"):
        groups = {"group_0": {"targets": ["Linear", "Embedding"], **intq}}
    else:
        nvfp4 = {"format": "nvfp4-pack-quantized", "weights": {"num_bits": 4, "type": "float", "symmetric": True,
                                                                "strategy": "tensor_group", "group_size": 16}}
        groups = {"group_0": {"targets": ["Embedding"], **intq}, "group_1": {"targets": ["Linear"], **nvfp4}}
    formats = {c["format"] for c in groups.values()}
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed", "config_groups": groups,
            "format": formats.pop() if len(formats) == 1 else "mixed-precision"}


def write(out: Path, fmt: str, layers: int, group: int, seed: int) -> dict:
    cfg = real_config(layers)
    out.mkdir(parents=True, exist_ok=False)
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(-2**31, 2**31 - 1, (POOL_WORDS,), dtype=torch.int32, generator=g)
    shards, current, size, params = [], {}, 0, 0
    weight_map = {}

    def flush():
        nonlocal current, size
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(current, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in current})
        shards.append(name)
        current, size = {}, 0

    for prefix, shape, quantized in shapes(cfg):
        params += math.prod(shape)
        for k, v in tensors_for(prefix, shape, quantized, fmt, group, g, pool).items():
            current[k] = v
            size += v.numel() * v.element_size()
        if size >= SHARD_BYTES:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = cfg.to_hf()
    config["dtype"] = "bfloat16"
    config["quantization_config"] = quantization_config(fmt, group)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    return {"parameters": params, "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--format", choices=["int4", "int8", "nvfp4"], default="int4", help="weight format (default int4)")
    p.add_argument("--layers", type=int, default=30, help="decoder layers at the real width (default 30, the model's)")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.out.exists():
        p.error(f"{args.out} exists; choose another --out")
    partial = args.out.with_name(args.out.name + ".partial")  # the directory appears only when complete
    shutil.rmtree(partial, ignore_errors=True)
    try:
        info = write(partial, args.format, args.layers, args.group, args.seed)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(args.out)
    seconds = round(time.perf_counter() - t0, 1)
    print(json.dumps({"path": str(args.out), "format": args.format, **info, "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
