"""Seconds per denoising step on the same GGUF files: llama.cpp's `llama-diffusion-cli` against dgemma.

    python benchmarks/gguf_speed.py --checkpoint DIR --gguf Q8_0=model-q8_0.gguf --gguf Q4_K_M=model-Q4_K_M.gguf \\
        [--llama-bin BUILD/bin] [--threads 2] [--steps 8] [--repeats 3] [--a8]

Rows: llama.cpp on each file (skipped, with a note, without --llama-bin); dgemma in float32 on the original
checkpoint (--checkpoint; optional); dgemma on each file, in the form dgemma keeps it (Q8_0 / Q4_0 as int8 / int4
exactly; k-quants as dgemma's loader maps them). Both get the same chat prompt (the file's template), the same
threads, one canvas and a fixed number of steps (confidence thresholds 1e-30 / 0: no early stop). Seconds per
step are steady-state: llama.cpp's from the timestamps of its per-step progress lines (first to last), dgemma's
from a turn of N steps minus a turn of one step, over N - 1 (median of --repeats after a warm-up); prompt
prefill and the first step are left out of both. Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

PROMPT = "Write a short story about a robot who learns to paint."
_STEP = re.compile(r"(\d+)\.(\d+)\.(\d+)\.(\d+) I \s*diffusion step: (\d+)/(\d+)")


def llama_cpp_step(binary: Path, gguf: Path, threads: int, steps: int, canvas: int) -> dict:
    """Seconds per step of one llama-diffusion-cli turn: from the timestamps of its per-step progress lines (its
    own end-of-turn "time per step" line is lost: the binary exits before its asynchronous log is flushed)."""
    cmd = [str(binary), "-m", str(gguf), "-p", PROMPT, "-t", str(threads), "-tb", str(threads), "-n", str(canvas),
           "--diffusion-eb-max-steps", str(steps), "--diffusion-eb-confidence", "0", "--seed", "0", "-no-cnv",
           "-ngl", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=3600)
    marks = {int(m[4]): int(m[0]) * 60 + int(m[1]) + int(m[2]) / 1e3 + int(m[3]) / 1e6
             for m in _STEP.findall(proc.stdout + proc.stderr)}
    if proc.returncode != 0 or len(marks) < 2:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"llama-diffusion-cli exited {proc.returncode} with {len(marks)} step lines: "
                         f"{' | '.join(tail)}"}
    last = max(marks)
    return {"s_per_step": (marks[last] - marks[0]) / last, "steps_timed": last, "command": " ".join(cmd)}


def dgemma_step(model_path: Path, threads: int, steps: int, repeats: int, quantize: str | None = None) -> dict:
    """Seconds per step of one canvas with dgemma (fast engine, float32 activations), the same way: a turn of
    `steps` steps minus a turn of one step, over steps - 1 (prefill and the first step cancel); median of repeats."""
    import torch

    import dgemma
    from dgemma.bench.job import FIXED_STEPS_THRESHOLD

    torch.set_num_threads(threads)
    options = {"quantize": quantize} if quantize else {}
    model = dgemma.load(model_path, dtype="float32", **options)
    canvas = model.module.cfg.canvas_length
    messages = [{"role": "user", "content": PROMPT}]

    def turn(n: int, seed: int) -> float:
        t0 = time.perf_counter()
        model.generate(messages, max_new_tokens=canvas, max_denoising_steps=n,
                       confidence_threshold=FIXED_STEPS_THRESHOLD, seed=seed)
        return time.perf_counter() - t0

    turn(1, 0)  # warm-up
    times = [(turn(steps, i) - turn(1, i)) / (steps - 1) for i in range(repeats)]
    return {"s_per_step": statistics.median(times), "steps": steps, "weight_mb": _weight_summary(model.module)}


def _weight_summary(module) -> dict:
    """Bytes of the weights by storage kind (float parameters, quantized formats)."""
    kinds: dict[str, int] = {}
    for _, p in module.named_parameters():
        kinds[str(p.dtype).removeprefix("torch.")] = kinds.get(str(p.dtype).removeprefix("torch."), 0) + p.nbytes
    for m in module.modules():
        fmt = getattr(m, "format", None)
        if isinstance(fmt, str) and hasattr(m, "nbytes") and m is not module:
            kinds[fmt] = kinds.get(fmt, 0) + m.nbytes
    return {k: round(v / 1e6, 1) for k, v in kinds.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", action="append", default=[], metavar="NAME=FILE", help="a GGUF file to run both on")
    p.add_argument("--checkpoint", type=Path, default=None, help="the float checkpoint the files came from (dgemma "
                   "float32 row)")
    p.add_argument("--llama-bin", type=Path, default=None, help="folder with llama-diffusion-cli (row skipped without)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="denoising steps per canvas (fixed; at least 3)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", default="llama.cpp,dgemma", help="subset of llama.cpp,dgemma")
    p.add_argument("--a8", action="store_true", help="also run dgemma on each file with int8 activations "
                   "(--quantize a8: the file's weights, int8 x int8 GEMMs)")
    args = p.parse_args(argv)
    files = dict(item.split("=", 1) for item in args.gguf)
    engines = args.engines.split(",")
    rows = []
    binary = args.llama_bin / "llama-diffusion-cli" if args.llama_bin else None
    for name, path in files.items():
        if "llama.cpp" not in engines:
            break
        if binary is None or not binary.is_file():
            rows.append({"engine": "llama.cpp", "weights": name, "skipped": "no llama-diffusion-cli (--llama-bin)"})
            continue
        runs = [llama_cpp_step(binary, Path(path), args.threads, args.steps, _canvas(path)) for _ in
                range(args.repeats)]
        ok = [r["s_per_step"] for r in runs if "s_per_step" in r]
        row = {"engine": "llama.cpp", "weights": name, **runs[-1]}
        if ok:
            row["s_per_step"] = statistics.median(ok)
        rows.append(row)
        _log(rows[-1])
    if "dgemma" in engines:
        if args.checkpoint is not None:
            rows.append({"engine": "dgemma", "weights": "float32", **dgemma_step(args.checkpoint, args.threads,
                                                                                   args.steps, args.repeats)})
            _log(rows[-1])
        for name, path in files.items():
            for quantize in (None, "a8") if args.a8 else (None,):
                rows.append({"engine": "dgemma", "weights": name + ("+a8" if quantize else ""),
                             **dgemma_step(Path(path), args.threads, args.steps, args.repeats, quantize)})
                _log(rows[-1])
    print(json.dumps({"threads": args.threads, "steps": args.steps, "rows": rows}))
    return 0


def _canvas(path: str) -> int:
    from dgemma.weights.gguf import GGUFFile

    return int(GGUFFile(path).value("diffusion.canvas_length"))


def _log(row: dict) -> None:
    shown = f"{row['s_per_step']:.3f} s/step" if "s_per_step" in row else row.get("skipped") or row.get("error")
    print(f"{row['engine']:>9} {row['weights']:<10} {shown}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
