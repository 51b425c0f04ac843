"""The cost side of the opt-in savings (`soft_top_k`, `skip_settled`) on any checkpoint, tokenizer or not (the
benchmark checkpoint: the real 262,144-entry vocabulary on a small body, benchmarks/build_bench_checkpoint.py): per
variant, decoder passes, seconds per pass, matmul FLOPs per committed token (dgemma.bench.flops, less what the
savings spared) and tokens/s, on the same seeded random prompts, round-robin over variants per prompt. Quality is
the harness's job (benchmarks/quality/evaluate.py, whose --variant syntax this takes). Last stdout line JSON.

    python benchmarks/savings_cost.py --model /tmp/dgemma-bench --variant 'top_k_32={"soft_top_k": 32}'
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent / "quality"))
from evaluate import choose_variants, flops  # noqa: E402

import dgemma  # noqa: E402
from dgemma.bench.flops import cpu_name, load_average  # noqa: E402


def run(model, prompts: list[list[int]], variants: dict, max_new_tokens: int) -> dict:
    sums = {name: {"tokens": 0, "passes": 0, "flops": 0.0, "seconds": 0.0, "skipped_head_rows": 0} for name in variants}
    for i, prompt in enumerate(prompts):
        for name, variant in variants.items():
            t0 = time.perf_counter()
            r = model.generate(prompt, max_new_tokens=max_new_tokens, seed=i, **variant)
            s = sums[name]
            s["seconds"] += time.perf_counter() - t0
            s["tokens"] += len(r.token_ids)
            s["passes"] += r.stats["decoder_passes"]
            s["skipped_head_rows"] += r.stats["skipped_head_rows"]
            s["flops"] += flops(model.module.cfg, r, False, variant.get("soft_top_k"))
    out = {}
    for name, s in sums.items():
        out[name] = {**s, "options": variants[name], "seconds_per_pass": s["seconds"] / s["passes"],
                     "flops_per_token": s["flops"] / s["tokens"], "tokens_per_second": s["tokens"] / s["seconds"]}
    base = out["defaults"]
    for v in out.values():
        v["flops_per_token_ratio"] = v["flops_per_token"] / base["flops_per_token"]
        v["seconds_per_pass_ratio"] = v["seconds_per_pass"] / base["seconds_per_pass"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--variant", action="append", default=[], help="NAME=JSON of decoding options (repeatable)")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: one canvas")
    p.add_argument("--steps", type=int, default=None, help="max denoising steps (default: the checkpoint's)")
    args = p.parse_args()
    model = dgemma.load(args.model)
    variants = choose_variants("", args.variant)
    if args.steps:
        variants = {k: {"max_denoising_steps": args.steps, **v} for k, v in variants.items()}
    g = torch.Generator().manual_seed(0)
    vocab = model.module.cfg.text.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    model.generate(prompts[0], max_new_tokens=4, max_denoising_steps=1)  # warm-up
    report = {"model": args.model, "cpu": cpu_name(), "threads": torch.get_num_threads(),
              "load_average": load_average(), "variants": run(model, prompts, variants,
                                                                args.max_new_tokens or model.module.cfg.canvas_length)}
    for name, v in report["variants"].items():
        print(f"{name:>16}: {v['flops_per_token']:.3e} FLOP/token ({v['flops_per_token_ratio']:.2f}x), "
              f"{v['seconds_per_pass']:.3f} s/pass ({v['seconds_per_pass_ratio']:.2f}x), {v['passes']} passes",
              file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
