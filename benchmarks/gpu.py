"""Short prepared GPU benchmark: dgemma tokens/s on CUDA in bfloat16, beside the reference and autoregressive decoding.

Builds the benchmark checkpoint (real vocabulary, a larger body than on CPU) in a temporary directory unless --model
is given, then runs `dgemma bench` in-process on cuda (device memory peaks are per configuration there). Without a
CUDA device it says so and exits 0. Last stdout line: JSON (the `dgemma bench` report, or {"skipped": ...}).

    python benchmarks/gpu.py [--model DIR] [--batch 1,4,16] [--steps 16] [--max-new-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from build_bench_checkpoint import build  # noqa: E402

from dgemma import bench  # noqa: E402
from dgemma.bench.report import SCHEMA  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: build one in a temp dir)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size of the built checkpoint")
    p.add_argument("--layers", type=int, default=6, help="layers of the built checkpoint")
    p.add_argument("--batch", default="1,4,16")
    p.add_argument("--steps", default="16")
    p.add_argument("--max-new-tokens", default="512")
    p.add_argument("--prompt-len", default="128")
    p.add_argument("--engines", default="dgemma,reference,autoregressive")
    p.add_argument("--repeats", default="3")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (run this on a GPU machine)", file=sys.stderr)
        print(json.dumps({"schema": SCHEMA, "skipped": "no CUDA device", "torch": torch.__version__}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            info = build(Path(tmp) / "ckpt", dtype=torch.bfloat16, hidden=args.hidden, layers=args.layers)
            print(f"built {info['path']}: {info['parameters'] / 1e6:.0f}M parameters in {info['seconds']} s",
                  file=sys.stderr)
            model = info["path"]
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        bench_args = parser.parse_args([
            "--model", model, "--device", "cuda", "--dtype", "bfloat16", "--reference-dtype", "bfloat16,float32",
            "--batch", args.batch, "--steps", args.steps, "--max-new-tokens", args.max_new_tokens,
            "--prompt-len", args.prompt_len, "--engines", args.engines, "--repeats", args.repeats, "--in-process",
        ])
        return bench.run(bench_args)


if __name__ == "__main__":
    sys.exit(main())
