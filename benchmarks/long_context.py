"""Long-context numbers: KV-cache bytes per token (computed), the longest prompt a cache budget holds, and the
peak memory of chunked prefill (measured, each case in its own process).

    python benchmarks/long_context.py kv [--tokens 32768] [--budget-gb 2] [--model DIR]
    python benchmarks/long_context.py prefill --model DIR [--chunk 512] [--chunks 16] [--dtype float32]

`kv` computes the cache of the released 26B-A4B shapes (and of --model's config, if given) in three layouts:
"before" (every layer's keys and values kept whole: the layout before this work), "linear" (every layer kept
whole, full-attention layers storing k_proj's output alone) and "ring" (the same, sliding layers in rings: what
the engine uses): bytes per request at --tokens, bytes each further token adds, and the longest context that
fits --budget-gb.
`prefill` measures the peak bytes of the tensors a prefill creates (its activations; weights and the preallocated
cache left out; `instruments.PeakBytes`), and the resident memory it adds (allocator effects included), for a
prompt of one chunk and of --chunks chunks, chunked and in one pass. Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from dgemma.cache import KVCache  # noqa: E402
from dgemma.config import FULL, SLIDING, ModelConfig, TextConfig  # noqa: E402
from dgemma.instruments import PeakBytes  # noqa: E402

REAL = ModelConfig(TextConfig(
    vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(30)),
    per_layer={i: {"head_dim": 512, "num_key_value_heads": 2} for i in range(5, 30, 6)}, sliding_window=1024,
    num_experts=128, top_k_experts=8, moe_intermediate_size=704, max_position_embeddings=262_144),
    canvas_length=256)


def cache_bytes(cfg: ModelConfig, tokens: int, layout: str, dtype: torch.dtype) -> int:
    if layout == "before":  # keys and values of every layer, every slot
        t = cfg.text
        values = 2 * tokens * sum(t.layer(i).num_kv_heads * t.layer(i).head_dim for i in range(t.num_hidden_layers))
        return values * torch.empty(0, dtype=dtype).element_size()
    room = cfg.canvas_length if layout == "ring" else None
    return KVCache(cfg.text, 1, tokens, dtype, "meta", room=room).nbytes


def longest(cfg: ModelConfig, budget: int, layout: str, dtype: torch.dtype) -> int:
    """Largest context whose cache fits `budget` bytes (bisection on the computed size)."""
    lo, hi = 1, 1 << 26
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cache_bytes(cfg, mid, layout, dtype) <= budget else (lo, mid - 1)
    return lo


def kv_report(cfg: ModelConfig, tokens: int, budget: int, dtype: torch.dtype) -> dict:
    out = {}
    for layout in ("before", "linear", "ring"):
        total = cache_bytes(cfg, tokens, layout, dtype)
        out[layout] = {"bytes": total, "bytes_per_token_beyond": cache_bytes(cfg, tokens + 1, layout, dtype) - total,
                       "longest_context_in_budget": longest(cfg, budget, layout, dtype)}
    out["before_over_ring"] = round(out["before"]["bytes"] / out["ring"]["bytes"], 2)
    out["max_position_embeddings"] = cfg.text.max_position_embeddings
    return out


def measure_prefill(model_dir: str, tokens: int, chunk: int | None, dtype: str) -> dict:
    """In this process: peak RSS a prefill of `tokens` adds over the loaded model and its preallocated cache."""
    import dgemma

    torch.set_num_threads(2)
    model = dgemma.load(model_dir, dtype=dtype).module
    ids = torch.randint(3, model.cfg.text.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(1, tokens + model.cfg.canvas_length)
    cache.ensure(tokens + model.cfg.canvas_length)
    with torch.inference_mode():
        model.prefill(ids[:, :8], model.new_cache(1, 16), chunk=chunk)  # warm-up: first-call allocations
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        with PeakBytes() as tensors:
            model.prefill(ids, cache, chunk=chunk)
        seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"tokens": tokens, "chunk": chunk, "activation_peak_mb": round(tensors.peak / 2**20, 1),
            "added_peak_rss_mb": round((peak - before) / 1024, 1), "seconds": round(seconds, 2)}


def prefill_report(model_dir: str, chunk: int, chunks: int, dtype: str) -> dict:
    cases = [(chunk, chunk), (chunk * chunks, chunk), (chunk * chunks, None)]
    runs = []
    for tokens, c in cases:
        cmd = [sys.executable, __file__, "_one", model_dir, str(tokens), str(c or 0), dtype]
        runs.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    one, many, whole = (r["activation_peak_mb"] for r in runs)
    return {"runs": runs, "chunked_over_one_chunk": round(many / one, 2),
            "one_pass_over_one_chunk": round(whole / one, 2)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_one":
        model_dir, tokens, chunk, dtype = argv[1:]
        print(json.dumps(measure_prefill(model_dir, int(tokens), int(chunk) or None, dtype)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["kv", "prefill"])
    p.add_argument("--model", help="checkpoint directory (prefill: required; kv: also report its config)")
    p.add_argument("--tokens", type=int, default=32_768)
    p.add_argument("--budget-gb", type=float, default=2.0)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    if args.what == "kv":
        report = {"real_26b_a4b_bf16": kv_report(REAL, args.tokens, int(args.budget_gb * 2**30), torch.bfloat16)}
        if args.model:
            from dgemma.weights.hf import read_config

            cfg = read_config(Path(args.model))
            report["model"] = kv_report(cfg, args.tokens, int(args.budget_gb * 2**30), getattr(torch, args.dtype))
    else:
        report = prefill_report(args.model, args.chunk, args.chunks, args.dtype)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
