#!/usr/bin/env python3
"""On paper: memory per GPU for training the released 26B model with FSDP (train/distributed.py), from its real
shapes (the parameter counts come from dgemma's own model built on the meta device; nothing is allocated).

    python benchmarks/fsdp_memory.py                      # full fine-tuning, 8 GPUs, bf16, 8 canvases, 1 example
    python benchmarks/fsdp_memory.py --gpus 8 --lora --canvases 4 --batch 2

Sharded over the GPUs: float32 master weights, float32 gradients and AdamW's two float32 moments (16 bytes per
trained parameter; LoRA: the bf16 frozen base, 2 bytes). Whole on each GPU at a time: the root unit (embedding,
final norm, self-conditioning; gathered in bf16 from the first forward to the end of backward), and two layers
gathered in bf16 (the one computing and the one prefetched) with their unsharded bf16 gradients and float32
reduce buffers. Activations with per-layer activation checkpointing: each layer's bf16 input for the encoder and
the scored decoder pass, the KV cache (bf16), the recomputed layer's intermediates (estimated from its widths) and
the loss chunks (2^24 float32 logits each, with softmax and gradient copies). The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from dgemma.config import FULL, SLIDING, ModelConfig, TextConfig  # noqa: E402
from dgemma.model import DiffusionGemma  # noqa: E402

GB = 1e9


def real_config() -> ModelConfig:
    """google/diffusiongemma-26B-A4B-it's text model (shapes in docs: 30 layers, 5 sliding : 1 full)."""
    layers = (SLIDING,) * 5 + (FULL,)
    text = TextConfig(
        vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, layer_types=layers * 5,
        per_layer={i: {"head_dim": 512, "num_key_value_heads": 2} for i in range(5, 30, 6)},
        sliding_window=1024, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
        max_position_embeddings=262_144, eos_token_id=(1,))
    return ModelConfig(text=text, canvas_length=256)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def activations(cfg: ModelConfig, batch: int, tokens: int) -> dict[str, float]:
    """Bytes of what backward needs with per-layer checkpointing, for `batch` rows of `tokens` clean tokens."""
    t, c = cfg.text, cfg.canvas_length
    layer_inputs = 2 * t.num_hidden_layers * batch * (tokens + c) * t.hidden_size  # bf16, encoder + decoder
    kv = sum(2 * t.layer(i).num_kv_heads * t.layer(i).head_dim for i in range(t.num_hidden_layers)) * 2
    cache = batch * tokens * kv
    # one layer rerun in backward: q/k/v/o, dense MLP, routed expert rows (top-k), float32 attention softmax
    # rows of the flash-less path are not counted (SDPA's fused kernels keep none)
    widest = max(t.layer(i).head_dim for i in range(t.num_hidden_layers))
    per_token = (2 * t.num_attention_heads * widest + 4 * t.hidden_size + 3 * t.intermediate_size
                 + t.top_k_experts * 3 * t.moe_intermediate_size) * 2
    rerun = 2 * batch * tokens * per_token  # the values and their gradients
    loss = 3 * 4 * 2**24  # one chunk's logits, softmax and gradient in float32
    return {"layer_inputs": layer_inputs, "kv_cache": cache, "rerun_layer": rerun, "loss_chunk": loss}


def plan(args: argparse.Namespace) -> dict:
    cfg = real_config()
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    total = count(model)
    layer = max(count(block) for block in model.layers)
    root = total - sum(count(block) for block in model.layers)
    n = args.gpus
    if args.lora:  # bf16 frozen base; adapters (r 16 on attention + MLP) are a rounding error here
        sharded = 2 * total / n
        gathered = 2 * root + 2 * 2 * layer
    else:
        sharded = 16 * total / n
        gathered = 2 * root + 4 * root + 2 * (2 * layer + 2 * layer + 4 * layer)  # weights, bf16 grads, fp32 reduce
    acts = activations(cfg, args.batch, args.prompt + args.canvases * cfg.canvas_length)
    per_gpu = sharded + gathered + sum(acts.values())
    return {"parameters": total, "largest_layer": layer, "root_unit": root, "gpus": n, "lora": args.lora,
            "batch_per_gpu": args.batch, "tokens_per_example": args.prompt + args.canvases * cfg.canvas_length,
            "sharded_gb": round(sharded / GB, 2), "gathered_gb": round(gathered / GB, 2),
            **{f"{k}_gb": round(v / GB, 2) for k, v in acts.items()}, "per_gpu_gb": round(per_gpu / GB, 1),
            "fits": per_gpu < args.gpu_gb * GB}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpu-gb", type=float, default=80.0)
    p.add_argument("--batch", type=int, default=1, help="examples per GPU per micro-batch")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--canvases", type=int, default=8)
    p.add_argument("--lora", action="store_true")
    result = plan(p.parse_args())
    for key, value in result.items():
        print(f"{key:>20}: {value}", file=sys.stderr)
    print(json.dumps({"benchmark": "fsdp_memory", **result}))


if __name__ == "__main__":
    main()
