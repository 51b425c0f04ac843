"""Build the deterministic benchmark checkpoint: the real vocabulary (262,144) and canvas (256) on a small body.

On the released model the vocabulary-sized work of a denoising step (LM head, softcap, softmax, sampling,
entropy, the self-conditioning matmul) is a large share of the time; a checkpoint with the real vocabulary
keeps that share honest while the body stays small enough for a 2-core CPU. Weights are random but seeded
(same seed, same bytes), written with dgemma's own `save_model` in the Hugging Face layout the reference loads.

    python benchmarks/build_bench_checkpoint.py --out /tmp/dgemma-bench [--dtype bfloat16] [--seed 0]

Last stdout line: JSON {path, parameters, bytes, seconds}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from dgemma.config import FULL, SLIDING, ModelConfig, TextConfig  # noqa: E402
from dgemma.model import DiffusionGemma  # noqa: E402
from dgemma.weights import save_model  # noqa: E402

# The released generation_config.json values (and HF's defaults); eos ids as in the released checkpoint.
GENERATION_CONFIG = {
    "bos_token_id": 2, "pad_token_id": 0, "eos_token_id": [1, 106, 50],
    "max_new_tokens": 256, "max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8,
    "stability_threshold": 1, "confidence_threshold": 0.005, "return_dict_in_generate": True,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
}


def bench_config(hidden: int = 256, layers: int = 4, vocab: int = 262_144, canvas: int = 256, experts: int = 8,
                 top_k: int = 2) -> ModelConfig:
    """Gemma-4-like proportions scaled down: 5:1 sliding:full pattern (last layer full), larger global heads
    with fewer kv heads, 8 experts top-2 (by default) beside the dense MLP."""
    heads = max(2, hidden // 64)
    types = tuple(FULL if (i + 1) % 6 == 0 or i == layers - 1 else SLIDING for i in range(layers))
    text = TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64, layer_types=types,
        per_layer={i: {"head_dim": 128, "num_key_value_heads": 1} for i, t in enumerate(types) if t == FULL},
        sliding_window=512, num_experts=experts, top_k_experts=top_k, moe_intermediate_size=hidden // 2,
        max_position_embeddings=32_768, eos_token_id=(1, 106, 50),
    )
    return ModelConfig(text=text, canvas_length=canvas)


@torch.no_grad()
def randomise(model: DiffusionGemma, seed: int) -> None:
    """Norm weights and scales near 1, matrices ~ N(0, 1/fan_in), embedding N(0, 0.5^2): peaked but not
    one-hot token distributions after the tied head and softcap. Deterministic for a given seed and device (the
    draws happen where the weights are)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name == "embed_tokens.weight":
            p.normal_(0.0, 0.5, generator=g)
        elif p.dim() == 1:  # norm weights, router scale, per-expert scale
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device=p.device))
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("layer_scalar"):
            b.copy_(0.75 + 0.5 * torch.rand(b.shape, generator=g, device=b.device))


def build(out: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **shape) -> dict:
    t0 = time.perf_counter()
    cfg = bench_config(**shape)
    model = DiffusionGemma(cfg).eval()
    randomise(model, seed)
    save_model(model, out, dtype=dtype)
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {"path": str(out), "parameters": sum(p.numel() for p in model.parameters()), "bytes": size,
            "dtype": str(dtype).removeprefix("torch."), "seed": seed, "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="output directory (created; files overwritten)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="stored weight dtype")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (256: ~270 MB in float32)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8, help="routed experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--vocab", type=int, default=262_144, help="vocabulary size (smaller: a body-heavy step, e.g. "
                   "32768 with --hidden 1024 --layers 12 --experts 32 puts ~70%% of a step's FLOPs in the body)")
    args = p.parse_args(argv)
    info = build(args.out, args.seed, getattr(torch, args.dtype), hidden=args.hidden, layers=args.layers,
                 experts=args.experts, top_k=args.top_k, vocab=args.vocab)
    print(f"wrote {info['path']}: {info['parameters'] / 1e6:.1f}M parameters, {info['bytes'] / 1e6:.0f} MB "
          f"({info['dtype']}) in {info['seconds']} s", file=sys.stderr)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
