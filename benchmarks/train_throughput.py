#!/usr/bin/env python3
"""Training throughput of the DiffusionGemma objective on synthetic batches (no corpus needed).

    python benchmarks/train_throughput.py                       # the demo model's architecture
    python benchmarks/train_throughput.py --lora --batch-size 4

Each step: encoder over prompt + canvases (AR loss), decoder pass 1 (no grad) and pass 2 on one noisy canvas,
backward, clip, AdamW. tokens/s counts the clean sequence tokens the encoder processes; canvas_tokens/s the
tokens the decoder is trained on. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dgemma.config import ModelConfig  # noqa: E402
from dgemma.dtypes import NAMES  # noqa: E402
from dgemma.model import DiffusionGemma  # noqa: E402
from dgemma.train.data import Example, collate  # noqa: E402
from dgemma.train.objective import ObjectiveConfig, compute_losses  # noqa: E402
from dgemma.train.trainer import compute_dtype, init_weights  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/demo.json"), help="training config with model_config")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per example")
    p.add_argument("--canvases", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--precision", default="auto", choices=["auto", *NAMES])
    p.add_argument("--lora", action="store_true", help="LoRA r=16 on attention + MLP instead of full training")
    return p.parse_args()


def build_model(args: argparse.Namespace) -> tuple[DiffusionGemma, list[torch.nn.Parameter]]:
    """The config's architecture with seeded random weights; (model, trainable parameters)."""
    hf = {"model_type": "diffusion_gemma", **json.loads(Path(args.config).read_text())["model_config"]}
    torch.manual_seed(0)
    model = DiffusionGemma(ModelConfig.from_hf(hf))
    init_weights(model, 0.02)
    if args.lora:
        from dgemma.train.lora import apply_lora

        model.requires_grad_(False)
        apply_lora(model, 16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj",
                                   "mlp.down_proj"], [])
    return model, [q for q in model.parameters() if q.requires_grad]


def train(args: argparse.Namespace, model: DiffusionGemma, params: list, amp) -> tuple[float, int, int]:
    """Warm-up, then timed steps on synthetic batches; (seconds, clean tokens, canvas tokens) of the timed ones."""
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.95, 0.99))
    c, vocab = model.cfg.canvas_length, model.cfg.text.vocab_size
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    elapsed, tokens, canvas_tokens = 0.0, 0, 0
    for i in range(args.warmup + args.steps):
        exs = [Example([2] + [rng.randrange(6, vocab) for _ in range(args.prompt - 1)],
                       [rng.randrange(6, vocab) for _ in range(args.canvases * c)]) for _ in range(args.batch_size)]
        b = collate(exs, c, eos=1)
        t0 = time.perf_counter()
        losses = compute_losses(model, b, ObjectiveConfig(), gen, amp)
        losses.total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            elapsed, tokens, canvas_tokens = elapsed + dt, tokens + b.tokens, canvas_tokens + losses.canvas_tokens
            print(f"step {i - args.warmup + 1}: {dt:.2f} s, {b.tokens / dt:.0f} tokens/s", flush=True)
    return elapsed, tokens, canvas_tokens


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, params = build_model(args)
    dtype = compute_dtype(args.precision, torch.device("cpu"))
    amp = dtype if dtype != torch.float32 else None
    elapsed, tokens, canvas_tokens = train(args, model, params, amp)
    print(json.dumps({
        "benchmark": "train_throughput", "batch_size": args.batch_size, "prompt": args.prompt,
        "canvases": args.canvases, "canvas_length": model.cfg.canvas_length, "lora": args.lora,
        "precision": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "parameters": sum(q.numel() for q in model.parameters()), "trainable": sum(q.numel() for q in params),
        "step_s": round(elapsed / args.steps, 3), "tokens_per_s": round(tokens / elapsed, 1),
        "canvas_tokens_per_s": round(canvas_tokens / elapsed, 1),
    }))


if __name__ == "__main__":
    main()
