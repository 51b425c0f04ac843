"""The machine's matmul peak alone (the number `dgemma bench` divides FLOPs by): GFLOP/s of square matmuls.

    python benchmarks/matmul_peak.py [--device cpu] [--dtype float32,bfloat16] [--max-size 2048] [--threads N]

Last stdout line: JSON {device, threads, matmul: {dtype: {gflops (best run), gflops_median, size}}}.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from dgemma.bench.flops import measure_machine  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--max-size", type=int, default=None, help="largest square size (default 2048 CPU, 8192 GPU)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(measure_machine(args.device, args.max_size, args.dtype.split(","))))
