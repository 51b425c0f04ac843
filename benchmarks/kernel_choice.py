"""The numbers behind quant/kernels.py: a quantized 2D weight's matmul through each path, by rows M, side by side.

For each M and compute dtype: decode + GEMM from the group-local layout (`IntWeight`, what every call ran before
the kernel choice), decode + GEMM from torch's int4 layout (`CPUInt4Weight`'s large-M path; `--bits 8`: the int8
weight split in two int4 halves, `CPUInt8SplitWeight`) and torch's int4 kernel (its small-M path), and `+a8`'s
oneDNN int8 GEMM where it exists. Median milliseconds, one process,
interleaved per M.

    python benchmarks/kernel_choice.py [--n 4096] [--k 2816] [--rows 1,4,16,32,64,128,256] [--dtypes float32,bfloat16]
        [--threads 1] [--repeats 5] [--bits 4]

Last stdout line: JSON {cpu, threads, shape, ms: {dtype: {M: {path: ms}}}, crossover: {dtype: largest M where the
kernel was faster than decode + GEMM from its own layout}}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dgemma.quant import QuantizedWeight, a8, int4cpu, kernels, quantize_tensor  # noqa: E402
from expert_kernels import median_ms  # noqa: E402


def paths(n: int, k: int, dtype: torch.dtype, bits: int) -> dict:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    intw = quantize_tensor(w.to(dtype), bits)
    packed = int4cpu.converted(intw)
    packed._choice = kernels.Choice(kernels.DECODE, 0, kernels.DECODE)  # `linear` decodes at every M
    fns = {"decode + GEMM (group-local)": intw.linear,
           "decode + GEMM (torch layout)": lambda x: QuantizedWeight.linear(packed, x),
           "kernel": lambda x: packed.kernel_mm(x)}
    if a8.available(w.device):  # +a8: oneDNN int8 x int8 on a per-channel int8 copy
        fns["a8 (oneDNN int8)"] = a8.Int8Activations(intw, n, transposed=False).linear
    return fns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=2816)
    p.add_argument("--rows", default="1,4,16,32,64,128,256")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out, crossover = {}, {}
    with torch.inference_mode():
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            fns = paths(args.n, args.k, dtype, args.bits)
            out[name] = {}
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, args.k, generator=torch.Generator().manual_seed(m)).to(dtype)
                out[name][m] = {path: median_ms(lambda: fn(x), args.repeats) for path, fn in fns.items()}
                print(name, m, out[name][m], file=sys.stderr)
            wins = [m for m, t in out[name].items() if t["kernel"] < t["decode + GEMM (torch layout)"]]
            crossover[name] = max(wins, default=0)
    print(json.dumps({"cpu": torch.backends.cpu.get_cpu_capability(), "threads": args.threads,
                      "shape": [args.n, args.k], "bits": args.bits, "ms": out, "crossover": crossover}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
