#!/usr/bin/env python3
"""One process against N ranks under torchrun: the same `dgemma train` run (same seed, same global batch), its
per-step losses side by side and its tokens/s.

    python benchmarks/train_scaling.py                          # bundled model, full fine-tuning, 20 steps, 2 ranks
    python benchmarks/train_scaling.py --lora --parallel ddp

Every rank, and the one process, runs one thread (one core per rank: the scaling of ranks, not of threads; two
threads per process on a busy 2-core machine spend most of their time in OpenMP barriers). tokens/s is the global
batch's clean tokens over the wall time of steps 2..last (the first step pays for warm-up); with --device cpu the
ranks talk through gloo. The losses come from log.jsonl (5 decimals). The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_memory import write_corpus  # noqa: E402


def run(args, data: Path, out: Path, ranks: int) -> dict:
    config = out.with_suffix(".json")
    config.write_text('{"log_every": 1}')
    flags = ["train", "--model", args.model, "--data", str(data), "--out", str(out), "--steps", str(args.steps),
             "--batch-size", str(args.batch_size), "--canvases", str(args.canvases), "--max-prompt",
             str(args.prompt), "--precision", "float32", "--seed", "0", "--eval-every", "0", "--save-every", "0",
             "--warmup", "2", "--lr", str(args.lr), "--config", str(config), "--device", args.device,
             "--parallel", args.parallel, "--no-progress", *(["--lora"] if args.lora else [])]
    if ranks == 1:
        cmd = [sys.executable, "-m", "dgemma", *flags, "--threads", "1"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "dgemma", *flags, "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{ranks} rank(s): training failed\n{proc.stderr[-3000:]}")
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    seconds = steps[-1]["elapsed"] - steps[0]["elapsed"]
    return {"losses": [r["loss"] for r in steps],
            "tokens_per_s": round(sum(r["tokens"] for r in steps[1:]) / seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "dgemma/assets/demo"))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4, help="the global micro-batch")
    p.add_argument("--canvases", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--parallel", default="fsdp", choices=["fsdp", "ddp"])
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = write_corpus(Path(tmp) / "corpus.txt")
        one = run(args, data, Path(tmp) / "one", 1)
        many = run(args, data, Path(tmp) / "many", args.ranks)
    rel = [abs(a - b) / abs(a) for a, b in zip(one["losses"], many["losses"])]
    for step, (a, b) in enumerate(zip(one["losses"], many["losses"]), 1):
        print(f"step {step:3d}: 1 process {a:.5f}   {args.ranks} ranks {b:.5f}", file=sys.stderr)
    print(json.dumps({"benchmark": "train_scaling", "model": args.model, "ranks": args.ranks,
                      "parallel": args.parallel, "lora": args.lora, "steps": args.steps,
                      "batch_size": args.batch_size, "canvases": args.canvases,
                      "max_rel_loss_diff": max(rel), "tokens_per_s_1": one["tokens_per_s"],
                      f"tokens_per_s_{args.ranks}": many["tokens_per_s"],
                      "speedup": round(many["tokens_per_s"] / one["tokens_per_s"], 2)}))


if __name__ == "__main__":
    main()
