"""Autoregressive decoding of a quantized checkpoint against its memory bound, before and after the kernel choice.

"before": every 2D int4 weight back in the group-local layout (`IntWeight`: decoded to float + GEMM for every
call, what dgemma ran before quant/kernels.py); "after": as `dgemma.load` leaves it (`CPUInt4Weight`: torch's int4
kernel for few rows). Both models are in memory at once and run interleaved, round after round.

- seconds per token: `head` of the last hidden state, argmax, `encode` of that token (what the autoregressive
  engine does per token), after a short prompt prefill; median over the rounds of the per-round mean;
- bytes read per token: every 2D weight's bytes as its M = 1 path reads them (int4 kernel: codes + its bf16
  scale table; decode: codes + scales; `+a8`: the int8 copy), top_k / num_experts of each expert stack, the float
  parameters; the KV cache of a short context is left out;
- read bandwidth: a sum over a 1 GiB float32 buffer (touched first), median of 5, with the same threads;
- the memory bound = bytes / bandwidth, and each variant's ratio to it;
- optionally (`--steps N`) one denoising step (decoder pass over the canvas + the fused vocabulary step) per variant.

    python benchmarks/decode_bound.py --model DIR [--tokens 8] [--rounds 3] [--threads 1] [--steps 0] [--quantize S]

Last stdout line: JSON.
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
from dgemma.quant import QuantizedWeight  # noqa: E402
from dgemma.quant.int4cpu import CPUInt4Weight  # noqa: E402
from dgemma.sampling.fused import fast_step  # noqa: E402


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (a float32 sum) over a buffer far larger than the caches."""
    buf = torch.ones(int(gib * (1 << 30)) // 4)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times[1:])


def token_bytes(module: torch.nn.Module) -> int:
    """Weight bytes one token reads (see the module docstring)."""
    t = module.cfg.text
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    for m in module.modules():
        if not isinstance(m, QuantizedWeight):
            continue
        if len(m.shape) == 3:
            total += m.nbytes * t.top_k_experts // t.num_experts
        elif getattr(m, "a8", None) is not None:
            total += m.a8.nbytes
        elif isinstance(m, CPUInt4Weight) and m.choice.use_kernel(1):
            total += m.packed.nbytes + m.scale_zero.nbytes
        else:
            total += m.nbytes
    return total


def before(module: torch.nn.Module) -> int:
    """Turn every 2D `CPUInt4Weight` back into the `IntWeight` it came from; returns how many."""
    targets = [(owner, name) for owner, parent in module.named_modules() for name, w in parent.named_children()
               if isinstance(w, CPUInt4Weight) and len(w.shape) == 2]
    for owner, name in targets:
        parent = module.get_submodule(owner)
        setattr(parent, name, getattr(parent, name).to_int())
    return len(targets)


@torch.inference_mode()
def token_seconds(module, tokens: int) -> float:
    cache = module.new_cache(1, 16 + tokens + 1)
    hidden = module.prefill(torch.tensor([[2] + list(range(100, 115))]), cache)
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = module.head(hidden).argmax(-1)
        hidden = module.encode(token[:, None], cache)[:, -1]
    return (time.perf_counter() - t0) / tokens


@torch.inference_mode()
def step_seconds(module) -> float:
    cache = module.new_cache(1, 16 + module.cfg.canvas_length)
    module.encode(torch.tensor([[2] + list(range(100, 115))]), cache)
    canvas = torch.randint(0, module.cfg.text.vocab_size, (1, module.cfg.canvas_length),
                           generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    hidden = module.denoise(canvas, cache)
    fast_step(hidden, module.embed_tokens.weight, module.cfg.text.final_logit_softcapping, module.embed_scale,
              torch.ones(1), torch.full((1,), 0.1), [torch.Generator().manual_seed(0)], [False], want_signal=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--quantize", default=None, help="as dgemma.load's quantize (default: the checkpoint's own)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="denoising steps timed per variant (0: none)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {name: dgemma.load(args.model, dtype=args.dtype, quantize=args.quantize).module
              for name in ("before", "after")}
    reverted = before(models["before"])
    bandwidth = read_bandwidth()
    per_token = {name: token_bytes(m) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    steps: dict[str, list[float]] = {name: [] for name in models}
    for name, m in models.items():  # warm-up
        token_seconds(m, 1)
    for r in range(args.rounds):
        for name, m in models.items():
            times[name].append(token_seconds(m, args.tokens))
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.3f} s/token" for n, t in times.items()), file=sys.stderr)
    for _ in range(args.steps):
        for name, m in models.items():
            steps[name].append(step_seconds(m))
        print("step: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in steps.items()), file=sys.stderr)
    out = {}
    for name in models:
        s = statistics.median(times[name])
        bound = per_token[name] / bandwidth
        out[name] = {"seconds_per_token": round(s, 4), "tokens_per_second": round(1 / s, 2),
                     "bytes_per_token": per_token[name], "memory_bound_seconds": round(bound, 4),
                     "x_memory_bound": round(s / bound, 2)}
        if steps[name]:
            out[name]["seconds_per_denoising_step"] = round(statistics.median(steps[name]), 3)
    print(json.dumps({"model": args.model, "dtype": str(models["after"].dtype).removeprefix("torch."),
                      "threads": args.threads, "cpu": torch.backends.cpu.get_cpu_capability(),
                      "read_bandwidth_gb_s": round(bandwidth / 1e9, 2), "reverted_2d_weights": reverted,
                      "speedup": round(out["before"]["seconds_per_token"] / out["after"]["seconds_per_token"], 2),
                      "results": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
