#!/usr/bin/env python3
"""Peak memory of LoRA training (and its merged export) on the benchmark checkpoint, and the losses it logs.

    python benchmarks/build_bench_checkpoint.py --out /tmp/bench-ckpt
    git worktree add /tmp/train-old 777a050                      # the code before the memory work
    python benchmarks/train_memory.py --model /tmp/bench-ckpt --baseline /tmp/train-old

Activation checkpointing: the same checkout without and with `--activation-checkpointing`, e.g. full fine-tuning of
the bundled model on long sequences (8 canvases):

    python benchmarks/train_memory.py --model dgemma/assets/demo --full --canvases 8 --batch-size 8 --checkpointing

Each checkout runs `dgemma train --lora` in a fresh process (its own code on PYTHONPATH) on a synthetic corpus
tokenized with the bundled demo tokenizer; the peak is that process's peak RSS (CPU) or
torch.cuda.max_memory_allocated (CUDA). With --baseline, both runs use the same seed and data, so their per-step
losses must agree (in float32). The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Runs `python -m dgemma ...` in this process, then reports its peak memory on the last stderr line. The global
# seed makes peft's LoRA init the same in checkouts whose trainer does not seed it (before 'wip-train').
RUNNER = """
import json, resource, runpy, sys
import torch
torch.manual_seed(0)
sys.argv = ["dgemma", *sys.argv[1:]]
try:
    runpy.run_module("dgemma", run_name="__main__")
finally:
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_rss": rss, "peak_cuda": cuda}), file=sys.stderr)
"""
LEGACY_PRECISION = {"float32": "fp32", "bfloat16": "bf16"}  # spellings of checkouts before dgemma.dtypes


def write_corpus(path: Path, docs: int = 24, words: int = 400, seed: int = 0) -> Path:
    rng = random.Random(seed)
    vocab = ["the", "model", "denoises", "a", "canvas", "of", "tokens", "in", "parallel", "and", "commits", "it",
             "to", "cache", "through", "causal", "encoder", "river", "stone", "light", "north", "quiet", "seven"]
    path.write_text("\n\n\n".join(" ".join(rng.choice(vocab) for _ in range(words)) + "." for _ in range(docs)))
    return path


def train_argv(args, data: Path, out: Path, precision: str) -> list[str]:
    config = data.with_name("log_every.json")  # a per-step loss in log.jsonl (no flag for it)
    config.write_text('{"log_every": 1}')
    return ["train", "--model", args.model, "--tokenizer", str(ROOT / "dgemma/assets/demo"), "--data", str(data),
            "--out", str(out), *([] if args.full else ["--lora", "--lora-r", "16"]), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--canvases", str(args.canvases), "--max-prompt", str(args.prompt),
            "--precision", precision, "--seed", "0", "--eval-every", "0", "--save-every", "0", "--warmup", "1",
            "--config", str(config), "--device", args.device, "--threads", str(args.threads), "--no-progress"]


def measure(repo: Path, args, data: Path, out: Path, extra: tuple[str, ...] = ()) -> dict:
    """One training run of the checkout `repo` (with `extra` flags): peak memory and the logged per-step losses."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    spellings = [args.precision] + ([LEGACY_PRECISION[args.precision]] if args.precision in LEGACY_PRECISION else [])
    for precision in spellings:
        proc = subprocess.run([sys.executable, "-c", RUNNER, *train_argv(args, data, out, precision), *extra],
                              cwd=repo, env=env, capture_output=True, text=True)
        if proc.returncode == 0 or "precision=" not in proc.stderr:
            break
    if proc.returncode != 0:
        raise SystemExit(f"{repo}: training failed\n{proc.stderr[-3000:]}")
    peak = json.loads(proc.stderr.strip().splitlines()[-1])
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    mib = (peak["peak_cuda"] or peak["peak_rss"]) / 2**20
    return {"repo": str(repo), "peak_mib": round(mib, 1), "kind": "cuda" if peak["peak_cuda"] else "rss",
            "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/bench-ckpt", help="benchmark checkpoint (build_bench_checkpoint.py)")
    p.add_argument("--baseline", type=Path, help="another checkout to measure the same way (e.g. the old commit)")
    p.add_argument("--precision", default="float32", help="auto | float32 | bfloat16")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens at most")
    p.add_argument("--canvases", type=int, default=1, help="canvases per example")
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    p.add_argument("--checkpointing", action="store_true",
                   help="compare this checkout without ('before') and with ('after') --activation-checkpointing")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = write_corpus(Path(tmp) / "corpus.txt")
        rows = {"after": measure(ROOT, args, data, Path(tmp) / "after",
                                 ("--activation-checkpointing",) if args.checkpointing else ())}
        if args.checkpointing:
            rows["before"] = measure(ROOT, args, data, Path(tmp) / "before")
        elif args.baseline:
            rows["before"] = measure(args.baseline.resolve(), args, data, Path(tmp) / "before")
    for name, row in rows.items():
        print(f"{name}: peak {row['peak_mib']} MiB ({row['kind']}), losses {row['losses']}", file=sys.stderr)
    result = {"benchmark": "train_memory", "model": args.model, "precision": args.precision, "steps": args.steps,
              "batch_size": args.batch_size, "canvases": args.canvases, "full": args.full,
              "checkpointing": args.checkpointing, **{f"{k}_peak_mib": r["peak_mib"] for k, r in rows.items()}}
    if "before" in rows:
        before, after = rows["before"], rows["after"]
        result["peak_reduction"] = round(1 - after["peak_mib"] / before["peak_mib"], 3)
        result["max_loss_diff"] = max(abs(a - b) for a, b in zip(after["losses"], before["losses"]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
