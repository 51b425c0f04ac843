"""One prepared accelerator run: tokens/s, seconds per denoising step, host reads per step and peak memory,
for the benchmark shape and the real model's shape (2 of its 30 layers), diffusion beside autoregressive.

Models are built in memory on the device with random bf16 weights (no files, no downloads), so the whole run
fits in a few minutes on one GPU. Denoising runs a fixed number of steps per canvas (random weights never
converge); host reads are counted in dgemma's own code (each is a device-to-host synchronisation).
`--device cpu --tiny` runs the same script on small shapes (a smoke test). Tensor parallel: under
`torchrun --nproc-per-node N ... --tensor-parallel N` every rank builds the same weights, keeps its shard
(dgemma.parallel, NCCL on GPUs, gloo on CPUs) and runs the same requests; rank 0 reports (with its weight bytes).

    python benchmarks/gpu.py [--device cuda] [--batch 1,8] [--steps 16] [--max-new-tokens 512] [--tiny]
    torchrun --nproc-per-node 2 benchmarks/gpu.py --tensor-parallel 2 [...]

Last stdout line: JSON {device, runs: [{shape, batch, mode, tokens_per_second, seconds_per_step,
host_reads_per_step, peak_memory_bytes, ...}]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from build_bench_checkpoint import randomise  # noqa: E402
from dgemma import parallel  # noqa: E402
from dgemma.config import FULL, SLIDING, ModelConfig, TextConfig  # noqa: E402
from dgemma.dtypes import NAMES, parse_dtype  # noqa: E402
from dgemma.engine import AutoregressiveEngine, Engine  # noqa: E402
from dgemma.instruments import Recorder  # noqa: E402
from dgemma.model import DiffusionGemma  # noqa: E402
from dgemma.model.layers import rope_inv_freq  # noqa: E402
from dgemma.sampling import SamplingParams  # noqa: E402


def shape(name: str, tiny: bool) -> ModelConfig:
    """"bench": the benchmark checkpoint's proportions at hidden 1024; "real": the released model's widths,
    heads and expert counts, 2 layers (one sliding, one full). `tiny` shrinks both for a CPU smoke test."""
    real = name == "real"
    h = 64 if tiny else (2816 if real else 1024)
    experts, top_k, moe = (8, 2, 32) if tiny else ((128, 8, 704) if real else (8, 2, h // 2))
    text = TextConfig(
        vocab_size=4096 if tiny else 262_144, hidden_size=h, intermediate_size=2 * h if not real else 2112,
        num_hidden_layers=2 if real or tiny else 6, num_attention_heads=16 if real else max(2, h // 64),
        num_key_value_heads=8 if real else max(1, h // 128), head_dim=256 if real and not tiny else 64,
        layer_types=(SLIDING, FULL) if real or tiny else (SLIDING,) * 5 + (FULL,),
        per_layer={(1 if real or tiny else 5): {"head_dim": 512 if real and not tiny else 128,
                                                "num_key_value_heads": 2 if real else 1}},
        sliding_window=1024, num_experts=experts, top_k_experts=top_k, moe_intermediate_size=moe,
        max_position_embeddings=32_768, eos_token_id=(1,))
    return ModelConfig(text=text, canvas_length=32 if tiny else 256)


@torch.no_grad()
def build(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> DiffusionGemma:
    """Random weights made on the device, initialised as the benchmark checkpoint's (`randomise`)."""
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    model = model.to_empty(device=device).to(dtype).eval()
    randomise(model, 0)
    for block in model.layers:  # to_empty left the rotary buffers unset
        attn = block.self_attn
        attn.inv_freq.copy_(rope_inv_freq(cfg.text.rope(attn.sliding), attn.head_dim))
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_diffusion(model: DiffusionGemma, batch: int, steps: int, max_new: int) -> dict:
    device = model.device
    engine = Engine(model, (), max_batch=batch)
    params = SamplingParams(max_new_tokens=max_new, max_denoising_steps=steps, eos_token_ids=(),
                            confidence_threshold=1e-30, seed=0)
    reqs = [engine.add_request(list(range(3, 131 + i)), params) for i in range(batch)]
    step_times, reads = [], []
    _sync(device)
    t0 = time.perf_counter()
    while engine.has_work():
        mid = engine.batch is not None and engine.batch.canvas is not None
        t = time.perf_counter()
        with Recorder() as rec:
            events = engine.step()
        _sync(device)
        if mid and not any(e.kind == "commit" for e in events):
            step_times.append(time.perf_counter() - t)
            reads.append(len(rec.reads))
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.output) for r in reqs)
    return {"mode": "diffusion", "tokens_per_second": tokens / seconds,
            "seconds_per_step": statistics.median(step_times) if step_times else None,
            "host_reads_per_step": max(reads, default=None), "tokens": tokens, "steps_per_canvas": steps}


def run_autoregressive(model: DiffusionGemma, max_new: int) -> dict:
    engine = AutoregressiveEngine(model, ())
    req = engine.add_request(list(range(3, 131)), SamplingParams(max_new_tokens=max_new, eos_token_ids=()))
    _sync(model.device)
    t0 = time.perf_counter()
    for _ in engine.stream():
        pass
    _sync(model.device)
    seconds = time.perf_counter() - t0
    return {"mode": "autoregressive", "tokens_per_second": len(req.output) / seconds,
            "seconds_per_step": seconds / len(req.output), "tokens": len(req.output)}


def measure(name: str, args: argparse.Namespace, device: torch.device, group: parallel.Group | None) -> list[dict]:
    model = build(shape(name, args.tiny), device, parse_dtype(args.dtype))
    if group is not None:
        parallel.shard(model, group)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the other ranks' parts, freed
    tp = {"tensor_parallel": args.tensor_parallel, "weight_bytes": parallel.weight_bytes(model)}
    runs = []
    run_diffusion(model, 1, args.steps, model.cfg.canvas_length)  # warm-up: kernels chosen, caches allocated
    for batch in args.batch:
        _reset_peak(device)
        out = run_diffusion(model, batch, args.steps, args.max_new_tokens)
        runs.append({"shape": name, "batch": batch, **out, **tp, "peak_memory_bytes": _peak(device)})
    _reset_peak(device)
    out = run_autoregressive(model, args.ar_tokens)
    runs.append({"shape": name, "batch": 1, **out, **tp, "peak_memory_bytes": _peak(device)})
    del model
    return runs


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--steps", type=int, default=16, help="denoising steps per canvas")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--ar-tokens", type=int, default=64, help="tokens decoded autoregressively")
    p.add_argument("--shapes", default="bench,real")
    p.add_argument("--dtype", default="bfloat16", choices=NAMES)
    p.add_argument("--tiny", action="store_true", help="small shapes, for a CPU smoke test")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="under torchrun --nproc-per-node N: shard the model over the N ranks")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device", "torch": torch.__version__}))
        return 0
    group = None
    if args.tensor_parallel > 1:
        group, device = parallel.join(args.tensor_parallel, device)
    runs = [r for name in args.shapes.split(",") for r in measure(name, args, device, group)]
    if group is not None:
        parallel.leave()
        if group.rank:
            return 0
    for r in runs:
        print(f"{r['shape']:>5} {r['mode']:>14} batch {r['batch']:>2}: {r['tokens_per_second']:8.1f} tok/s, "
              f"{(r['seconds_per_step'] or 0) * 1e3:7.2f} ms/step", file=sys.stderr)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "torch": torch.__version__, "settings": vars(args) | {"batch": args.batch},
                      "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
