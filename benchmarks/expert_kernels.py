"""Expert GEMMs at the real model's shape: float32 weights, int4 decoded + sgemm, int4 in torch's CPU int4 kernel;
with `--format nvfp4`, NVFP4 decoded + sgemm and the decode of one expert alone (float32 and bf16 outputs).

    python benchmarks/expert_kernels.py [--format int4|nvfp4] [--experts 8] [--rows 16] [--n 1408] [--k 2816]
        [--threads 1] [--repeats 7]

Each of `--experts` experts multiplies its `--rows` rows (a 256-token canvas, top-8 of 128 experts: ~16) by its
[n, k] weight (gate_up of the released model: 1,408 x 2,816). Median milliseconds for all experts. Last stdout
line: JSON.
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
from dgemma.model.moe import expert_matmul  # noqa: E402
from dgemma.quant import int4cpu, quantize_tensor  # noqa: E402
from dgemma.quant.fp import NVFP4Weight, quantize_nvfp4  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


def int4_rows(x, dense, ends, repeats: int) -> dict[str, float]:
    int4 = quantize_tensor(dense, 4)
    rows = {"int4 decode + sgemm": median_ms(lambda: expert_matmul(x, int4, ends), repeats)}
    if int4cpu.available():
        packed = int4cpu.CPUInt4Weight.from_int(int4)
        rows["int4 torch kernel"] = median_ms(lambda: expert_matmul(x, packed, ends), repeats)
    return rows


def nvfp4_rows(x, dense, ends, repeats: int) -> dict[str, float]:
    """One global scale per expert (as checkpoints store them); the decode of one expert is what moe.py runs per
    expert on the CPU, into the reused workspace."""
    e, n, _ = dense.shape
    glob = 448.0 * 6.0 / dense.abs().amax((-2, -1), keepdim=True)
    packed, scales = quantize_nvfp4(dense, glob)
    w = NVFP4Weight(packed, scales, glob.expand(e, n, 1).contiguous(), torch.float32, divide=True)
    one = torch.tensor([0])
    return {"nvfp4 decode + sgemm": median_ms(lambda: expert_matmul(x, w, ends), repeats),
            "nvfp4 decode 1 expert f32": median_ms(lambda: w.dequantize(one, torch.float32, fresh=False), repeats),
            "nvfp4 decode 1 expert bf16": median_ms(lambda: w.dequantize(one, torch.bfloat16, fresh=False), repeats)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=["int4", "nvfp4"], default="int4")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--n", type=int, default=1408)
    p.add_argument("--k", type=int, default=2816)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(args.experts, args.n, args.k, generator=g) * 0.02
    x = torch.randn(args.experts * args.rows, args.k, generator=g)
    ends = torch.arange(1, args.experts + 1) * args.rows
    rows = {"float32": median_ms(lambda: expert_matmul(x, dense, ends), args.repeats)}
    rows.update((nvfp4_rows if args.format == "nvfp4" else int4_rows)(x, dense, ends, args.repeats))
    for name, ms in rows.items():
        print(f"{name:>26} {ms:9.2f} ms", file=sys.stderr)
    print(json.dumps({"format": args.format, "shape": [args.experts, args.n, args.k], "rows_per_expert": args.rows,
                      "threads": args.threads, "cpu": torch.backends.cpu.get_cpu_capability(), "ms": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
