"""Memory of quantized weights: peak RSS minus the runtime's RSS, over the model's bfloat16 weight bytes.

Each scheme runs in its own process: RSS before loading (python + torch: the runtime), then load, then one
canvas of generation at 2 denoising steps; the peak (VmHWM) minus the runtime, and the held weight bytes.

    python benchmarks/quant_memory.py [--model DIR] [--schemes none,int8,int4]

Last stdout line: JSON {bf16_weight_bytes, results: {scheme: {weights_bytes, peak_minus_runtime_bytes, ratio}}}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def one(model: str | None, scheme: str) -> dict:
    """Runs in the child process."""
    import torch

    sys.path.insert(0, str(ROOT))
    import dgemma
    from dgemma.bench.trials import tensor_bytes

    torch.set_num_threads(1)
    base = rss("VmRSS")
    m = dgemma.load(model, dtype="float32", quantize=None if scheme == "none" else scheme)
    m.generate([2, 651, 1024, 300], max_new_tokens=m.module.cfg.canvas_length, max_denoising_steps=2, seed=0)
    params = sum(p.numel() for p in m.module.parameters()) + sum(
        q.numel() for q in m.module.modules() if isinstance(q, dgemma.quant.QuantizedWeight))
    return {"runtime_bytes": base, "peak_minus_runtime_bytes": rss("VmHWM") - base,
            "weights_bytes": tensor_bytes(m.module), "parameters": params}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--schemes", default="none,int8,int4")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(one(args.model, args.child)))
        return 0
    results = {}
    for scheme in args.schemes.split(","):
        cmd = [sys.executable, __file__, "--child", scheme] + (["--model", args.model] if args.model else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results[scheme] = json.loads(out)
    bf16 = 2 * results[next(iter(results))]["parameters"]
    for r in results.values():
        r["ratio_to_bf16_weights"] = round(r["peak_minus_runtime_bytes"] / bf16, 3)
        r["weights_ratio"] = round(r["weights_bytes"] / bf16, 3)
        print(f"peak - runtime {r['peak_minus_runtime_bytes'] / 2**20:8.1f} MB ({r['ratio_to_bf16_weights']}x), "
              f"weights {r['weights_bytes'] / 2**20:8.1f} MB ({r['weights_ratio']}x)", file=sys.stderr)
    print(json.dumps({"model": args.model or "bundled", "bf16_weight_bytes": bf16, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
