"""Kernel launches and host reads per fast denoising step, counted on the CPU with an accelerator's settings
(large vocabulary chunks, the sync-free vocabulary step).

The model has the real DiffusionGemma's counts where they set the number of kernels: 128 experts top-8, a
262,144-token vocabulary, a 256-token canvas, one sliding and one full-attention layer; the body is narrow
(--hidden) because widths change no counts, only the time. Kernels are aten ops that compute (views excluded),
about one launch each on a GPU; host reads are `.tolist()`, `.item()`, `bool(tensor)` and the like in dgemma's
code (each a device-to-host synchronisation on a GPU).

    python benchmarks/step_ops.py [--hidden 256] [--batch 1] [--steps 3]

Last stdout line: JSON {kernels_per_step, host_reads_per_step, top_ops, settings}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from build_bench_checkpoint import randomise  # noqa: E402

import dgemma.engine.engine as engine_module  # noqa: E402
import dgemma.sampling.fused as fused  # noqa: E402
from dgemma.config import FULL, SLIDING, ModelConfig, TextConfig  # noqa: E402
from dgemma.engine import Engine  # noqa: E402
from dgemma.instruments import KernelCounter, Recorder  # noqa: E402
from dgemma.model import DiffusionGemma  # noqa: E402
from dgemma.sampling import SamplingParams  # noqa: E402

ACCELERATOR_CHUNK = 65536


def real_counts_config(hidden: int) -> ModelConfig:
    text = TextConfig(
        vocab_size=262_144, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, layer_types=(SLIDING, FULL),
        per_layer={1: {"head_dim": 128, "num_key_value_heads": 1}}, sliding_window=1024, num_experts=128,
        top_k_experts=8, moe_intermediate_size=hidden // 4, max_position_embeddings=32_768, eos_token_id=(1,))
    return ModelConfig(text=text, canvas_length=256)


def accelerator_settings(chunk: int) -> None:
    """What the vocabulary step does off the CPU (older checkouts, which had one chunk size for every device:
    the same through their own names)."""
    if hasattr(fused, "vocab_chunk"):
        fused.vocab_chunk = lambda device, shard=None: chunk
        fused.sync_free_default = lambda device: True
    else:
        fused.VOCAB_CHUNK = chunk
        engine_module.vocab_step = partial(fused.vocab_step, sync_free=True)


def count(engine: Engine, steps: int) -> tuple[list[int], list[int], KernelCounter]:
    """Kernels and host reads of each step that neither starts nor ends a canvas."""
    kernels, reads, last = [], [], None
    while engine.has_work() and len(kernels) < steps:
        mid_canvas = engine.batch is not None and engine.batch.canvas is not None
        with KernelCounter() as k, Recorder() as r:
            events = engine.step()
        if mid_canvas and not any(e.kind == "commit" for e in events):
            kernels.append(k.total)
            reads.append(len(r.reads))
            last = k
    return kernels, reads, last


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="denoising steps counted")
    p.add_argument("--vocab-chunk", type=int, default=ACCELERATOR_CHUNK,
                   help=f"vocabulary chunk (default {ACCELERATOR_CHUNK}, dgemma's choice off the CPU)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = DiffusionGemma(real_counts_config(args.hidden)).eval()
    randomise(model, 0)
    accelerator_settings(args.vocab_chunk)
    engine = Engine(model, (), pad_id=0, max_batch=args.batch)
    params = SamplingParams(max_new_tokens=256, max_denoising_steps=args.steps + 2, eos_token_ids=(),
                            confidence_threshold=1e-30, seed=0)
    for i in range(args.batch):
        engine.add_request(list(range(3, 40 + i)), params)
    kernels, reads, last = count(engine, args.steps)
    print(json.dumps({"kernels_per_step": statistics.median(kernels), "host_reads_per_step": max(reads),
                      "top_ops": dict(last.ops.most_common(8)), "settings": {
                          "hidden": args.hidden, "batch": args.batch, "experts": "8 of 128", "vocab": 262_144,
                          "canvas": 256, "vocab_chunk": args.vocab_chunk, "torch": torch.__version__}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
