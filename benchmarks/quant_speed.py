"""Seconds per denoising step of quantized weights against float32, side by side in one process.

One denoising step = the decoder pass over a canvas plus the fast vocabulary step (head, softmax, sampling, soft
embedding), as the engine runs it, at batch 1 after a prompt prefill. The schemes run interleaved, round after round,
so a shared machine's load drift spreads over all of them; medians and ratios to float32 are reported.

    python benchmarks/quant_speed.py --model /tmp/bench-ckpt [--schemes none,int8,int4] [--rounds 5]

Last stdout line: JSON {scheme: {median_seconds, ratio_to_float32}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import dgemma  # noqa: E402
from dgemma.sampling.fused import fast_step  # noqa: E402


@torch.inference_mode()
def step_seconds(model, prompt: torch.Tensor) -> float:
    mod = model.module
    cache = mod.new_cache(1, prompt.shape[1] + 2 * mod.cfg.canvas_length)
    mod.encode(prompt, cache)
    canvas = torch.randint(0, mod.cfg.text.vocab_size, (1, mod.cfg.canvas_length),
                           generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    hidden = mod.denoise(canvas, cache)
    fast_step(hidden, mod.lm_head, torch.ones(1), torch.full((1,), 0.1), [torch.Generator().manual_seed(0)], [False],
              want_signal=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--schemes", default="none,int8,int4")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    schemes = args.schemes.split(",")
    models = {s: dgemma.load(args.model, dtype="float32", quantize=None if s == "none" else s) for s in schemes}
    prompt = torch.tensor([[2] + list(range(100, 131))])
    times: dict[str, list[float]] = {s: [] for s in schemes}
    for s in schemes:  # warm-up
        step_seconds(models[s], prompt)
    for r in range(args.rounds):
        for s in schemes:
            times[s].append(step_seconds(models[s], prompt))
        print(f"round {r + 1}: " + ", ".join(f"{s} {times[s][-1]:.3f} s" for s in schemes), file=sys.stderr)
    base = statistics.median(times[schemes[0]])
    out = {s: {"median_seconds": round(statistics.median(t), 4),
               "ratio_to_" + schemes[0]: round(statistics.median(t) / base, 3)} for s, t in times.items()}
    print(json.dumps({"model": args.model or "bundled", "threads": torch.get_num_threads(), "results": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
