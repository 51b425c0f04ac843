"""One MoE layer's experts at the real shape: the grouped-GEMM forward against the per-expert loop it replaced.

    python benchmarks/moe.py [--tokens 256] [--experts 128] [--top-k 8] [--hidden 2816] [--intermediate 704]
                             [--dtypes float32,bfloat16] [--repeats 5] [--threads N]

Old and new run interleaved on the same weights and routing (the machine may be shared: medians). bf16 weights
on a CPU without native bf16 also run converted into fresh memory per call, against the reused workspace.
Last stdout line: JSON {seconds per layer old/new (median and best), FLOPs, ratio to the square-matmul FLOP
bound, aten ops per forward old/new, threads, CPU flags}.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from dgemma.bench.flops import matmul_peak  # noqa: E402
from dgemma.config import TextConfig  # noqa: E402
from dgemma.dtypes import native_bf16, parse_dtype  # noqa: E402
from dgemma.instruments import KernelCounter  # noqa: E402
from dgemma.model import moe  # noqa: E402
from dgemma.model.layers import gelu_tanh, matmul  # noqa: E402


def old_forward(experts, x, weights, ids):
    """The previous Experts.forward: counts read on the host, one matmul pair per expert."""
    t, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.gate_up_proj.shape[0]).tolist()
    tokens, outs, start = x[order // k], [], 0
    for e, n in enumerate(counts):
        if n:
            gate, up = matmul(tokens[start:start + n], experts.gate_up_proj[e].T).chunk(2, dim=-1)
            outs.append(matmul(gelu_tanh(gate) * up, experts.down_proj[e].T))
            start += n
    y = torch.cat(outs) * weights.flatten()[order, None]
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return unsorted.view(t, k, -1).sum(1).to(x.dtype)


def setup(args, dtype):
    cfg = TextConfig(hidden_size=args.hidden, num_experts=args.experts, top_k_experts=args.top_k,
                     moe_intermediate_size=args.intermediate)
    experts = moe.Experts(cfg)
    with torch.no_grad():  # filled in the target dtype: no float32 copy of the stack lingers
        experts.to(dtype)
        for p in experts.parameters():
            p.normal_(0.0, 0.02)
    g = torch.Generator().manual_seed(0)
    weights, ids = torch.randn(args.tokens, args.experts, generator=g).softmax(-1).topk(args.top_k, dim=-1)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(dtype)
    return experts, x, weights / weights.sum(-1, keepdim=True), ids


def fresh_copy(experts, x, weights, ids):
    """The new forward converting bf16 stacks into fresh allocations instead of the reused workspace."""
    saved, moe._converted = moe._converted, lambda w, dtype: w.to(dtype)
    try:
        return experts(x, weights, ids)
    finally:
        moe._converted = saved


def time_interleaved(variants: dict, inputs, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, calls interleaved round-robin after one warm-up round."""
    times = {name: [] for name in variants}
    for r in range(repeats + 1):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn(*inputs)
            if r:
                times[name].append(time.perf_counter() - t0)
    return times


def count_ops(fn, inputs) -> int:
    with KernelCounter(views=True) as counter:
        fn(*inputs)
    return sum(counter.ops.values())


def run_dtype(args, dtype, peak: float) -> dict:
    experts, x, weights, ids = setup(args, dtype)
    inputs = (experts, x, weights, ids)
    variants = {"old": old_forward, "new": lambda e, *a: e(*a)}
    if dtype == torch.bfloat16 and not native_bf16("cpu"):
        variants["new_fresh_copy"] = fresh_copy
    with torch.no_grad():
        diff = (variants["new"](*inputs).float() - old_forward(*inputs).float()).abs().max().item()
        times = time_interleaved(variants, inputs, args.repeats)
        ops = {name: count_ops(variants[name], inputs) for name in ("old", "new")}
    flops = 6 * args.tokens * args.top_k * args.hidden * args.intermediate
    bound = flops / (peak * 1e9)
    median = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}  # like the peak, the best run: least disturbed by other load
    return {"seconds_per_layer": median, "seconds_per_layer_best": best,
            "ratio_to_flop_bound": {k: v / bound for k, v in median.items()},
            "ratio_to_flop_bound_best": {k: v / bound for k, v in best.items()}, "flops": flops,
            "flop_bound_s": bound, "aten_ops_per_forward": ops, "max_abs_diff_old_new": diff}


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "fma", "amx")))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("tokens", 256), ("experts", 128), ("top-k", 8), ("hidden", 2816),
                          ("intermediate", 704), ("repeats", 5), ("threads", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = matmul_peak(torch.float32)
    print(f"float32 matmul peak {peak['gflops']:.1f} GFLOP/s (best), {peak['gflops_median']:.1f} median",
          file=sys.stderr)
    out = {"shape": {k: getattr(args, k) for k in ("tokens", "experts", "top_k", "hidden", "intermediate")},
           "peak_gflops_float32": peak["gflops"], "peak_gflops_float32_median": peak["gflops_median"],
           "threads": torch.get_num_threads(), "cpu_flags": cpu_flags(), "native_bf16": native_bf16("cpu")}
    for name in args.dtypes.split(","):
        out[name] = run_dtype(args, parse_dtype(name), peak["gflops"])
        print(f"{name}: {json.dumps(out[name])}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
