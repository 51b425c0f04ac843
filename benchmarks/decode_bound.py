"""Autoregressive decoding of a quantized checkpoint against its memory bound, before and after the kernel choice.

Variants (`--variants`, default before,after): "before": every 2D int4 or int8 weight back in the group-local
layout (`IntWeight`: decoded to float + GEMM for every call, what dgemma ran before quant/kernels.py); "after": as
`dgemma.load` leaves it (`CPUInt4Weight`, `CPUInt8SplitWeight`: torch's int4 kernel for few rows); "a8": loaded
with `+a8` (`--quantize a8` on a pre-quantized file: int8 activations on the 2D weights). All are in memory at once
and run interleaved, round after round.

- seconds per token: `head` of the last hidden state, argmax, `encode` of that token (what the autoregressive
  engine does per token), after a short prompt prefill; median over the rounds of the per-round mean;
- bytes read per token: every 2D weight's bytes as its M = 1 path reads them (int4 kernel: codes + its bf16 scale
  table; decode: codes + scales; `+a8`: the int8 copy), but the self-conditioning MLP's (only denoising reads it),
  top_k / num_experts of each expert stack, the float parameters; the KV cache of a short context is left out;
- read bandwidth: a sum over a 1 GiB float32 buffer (touched first), best of 3, with the same threads, measured
  again in every round (a shared machine's load moves it by 2-3x);
- the memory bound = bytes / bandwidth, and each variant's ratio to it: per round (that round's bandwidth), then
  the median over the rounds;
- optionally (`--steps N`) one denoising step (decoder pass over the canvas + the fused vocabulary step) per variant.

    python benchmarks/decode_bound.py --model DIR [--tokens 8] [--rounds 3] [--threads 1] [--steps 0] [--quantize S]
        [--variants before,after,a8] [--prompt-len 16]

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
sys.path.insert(0, str(Path(__file__).resolve().parent))
import dgemma  # noqa: E402
from dgemma.quant import QuantizedWeight  # noqa: E402
from dgemma.quant.kernels import KERNEL  # noqa: E402
from dgemma.quant.int4cpu import CPUInt4Weight  # noqa: E402
from quant_speed import step_seconds  # noqa: E402


def prompt(n: int) -> torch.Tensor:
    """A prompt of n tokens: BOS, then ids 100.. (the cache's context for the timed tokens)."""
    return torch.tensor([[2] + [100 + i % 1000 for i in range(n - 1)]])


def read_bandwidth(buf: torch.Tensor, repeats: int = 3) -> float:
    """Bytes per second of a streaming read (a float32 sum) over a buffer far larger than the caches, best run."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / min(times)


def token_bytes(module: torch.nn.Module) -> int:
    """Weight bytes one token reads (see the module docstring)."""
    t = module.cfg.text
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    for name, m in module.named_modules():
        if not isinstance(m, QuantizedWeight) or name.startswith("self_conditioning."):  # read only by denoising
            continue
        if len(m.shape) == 3:
            total += m.nbytes * t.top_k_experts // t.num_experts
        elif getattr(m, "a8", None) is not None:
            total += m.a8.nbytes
        elif isinstance(m, CPUInt4Weight) and m.choice.path(1) == KERNEL:
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
def token_seconds(module, tokens: int, ids: torch.Tensor) -> float:
    cache = module.new_cache(1, ids.shape[1] + tokens + 1)
    hidden = module.prefill(ids, cache)
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = module.head(hidden).argmax(-1)
        hidden = module.encode(token[:, None], cache)[:, -1]
    return (time.perf_counter() - t0) / tokens


def _spec(variant: str, quantize: str | None) -> str | None:
    """The `quantize` a variant loads with: a8 adds int8 activations (to the checkpoint's own weights by default)."""
    if variant != "a8":
        return quantize
    return "a8" if quantize is None else quantize + "+a8"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--quantize", default=None, help="as dgemma.load's quantize (default: the checkpoint's own)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="denoising steps timed per variant (0: none)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=16, help="tokens in the cache before the timed ones")
    p.add_argument("--variants", default="before,after")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    ids = prompt(args.prompt_len)
    models = {name: dgemma.load(args.model, dtype=args.dtype, quantize=_spec(name, args.quantize)).module
              for name in variants}
    reverted = before(models["before"]) if "before" in models else 0
    buf = torch.ones(1 << 28)  # 1 GiB
    per_token = {name: token_bytes(m) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    ratios: dict[str, list[float]] = {name: [] for name in models}
    steps: dict[str, list[float]] = {name: [] for name in models}
    bandwidths = []
    for name, m in models.items():  # warm-up
        token_seconds(m, 1, ids)
    for r in range(args.rounds):
        bandwidths.append(read_bandwidth(buf))
        for name, m in models.items():
            times[name].append(token_seconds(m, args.tokens, ids))
            ratios[name].append(times[name][-1] * bandwidths[-1] / per_token[name])
        print(f"round {r + 1} ({bandwidths[-1] / 1e9:.1f} GB/s): " + ", ".join(
            f"{n} {t[-1]:.3f} s/token ({ratios[n][-1]:.2f}x)" for n, t in times.items()), file=sys.stderr)
    for _ in range(args.steps):
        for name, m in models.items():
            steps[name].append(step_seconds(m, ids))
        print("step: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in steps.items()), file=sys.stderr)
    out = {}
    for name in models:
        s = statistics.median(times[name])
        out[name] = {"seconds_per_token": round(s, 4), "tokens_per_second": round(1 / s, 2),
                     "bytes_per_token": per_token[name],
                     "memory_bound_seconds": round(per_token[name] / statistics.median(bandwidths), 4),
                     "x_memory_bound": round(statistics.median(ratios[name]), 2)}
        if steps[name]:
            out[name]["seconds_per_denoising_step"] = round(statistics.median(steps[name]), 3)
    base = out[variants[0]]["seconds_per_token"]
    speedup = {n: round(base / r["seconds_per_token"], 2) for n, r in out.items()}
    print(json.dumps({"model": args.model, "dtype": str(models[variants[0]].dtype).removeprefix("torch."),
                      "threads": args.threads, "prompt_len": args.prompt_len,
                      "cpu": torch.backends.cpu.get_cpu_capability(),
                      "read_bandwidth_gb_s": [round(b / 1e9, 2) for b in bandwidths], "reverted_2d_weights": reverted,
                      f"speedup_over_{variants[0]}": speedup,
                      "results": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
