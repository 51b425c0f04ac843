"""`dgemma bench --scenario multi-turn`: one chat of --turns turns, with the prefix cache and without: each turn's
prompt tokens, how many came from the cache, its time to first token, and whether the answers are the same. The
chat is decoded by diffusion, or by the one engine --engines names (autoregressive or speculative).

Turn 1's prompt is --prompt-len random ids (a long system prompt and first message); every later prompt is the
previous one, its answer and --turn-tokens new ids, as a chat template renders the history. EOS is ignored, so
every answer has --max-new-tokens tokens; --steps takes one value (auto, or N fixed steps per canvas). Progress
and a per-turn table go to stderr, then one JSON line to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dgemma.bench.job import FIXED_STEPS_THRESHOLD, TOKEN_ENGINES, log
from dgemma.options import apply_threads


def chat(model, prefix_mb: int, args: argparse.Namespace) -> list[dict]:
    """One chat on a fresh engine (and a fresh prefix cache of `prefix_mb` MiB; 0: none)."""
    from dgemma.engine import PrefixCache

    mode = chat_mode(args.engines)
    engine = model.runner(mode, "fast", 1, PrefixCache(prefix_mb << 20) if prefix_mb else None)
    g = torch.Generator().manual_seed(args.seed)
    new_ids = lambda n: torch.randint(3, model.module.cfg.text.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    steps = {} if args.steps == "auto" or mode != "diffusion" else {
        "max_denoising_steps": int(args.steps), "confidence_threshold": FIXED_STEPS_THRESHOLD}
    history, turns = new_ids(args.prompt_len), []
    for turn in range(args.turns):
        params = model.params(max_new_tokens=args.max_new_tokens, seed=args.seed + turn, eos_token_ids=(), **steps)
        req = engine.add_request(history, params)
        for _ in engine.stream():
            pass
        stats = req.stats.to_dict(len(req.output))
        turns.append({"turn": turn + 1, "prompt_tokens": len(history), "cached_tokens": stats["cached_tokens"],
                      "ttft_seconds": round(stats["ttft_seconds"], 4), "output": req.output})
        history = history + req.output + new_ids(args.turn_tokens)
    return turns


def chat_mode(engines: str) -> str:
    """--engines naming autoregressive or speculative alone: that mode; anything else: diffusion."""
    names = [e for e in engines.split(",") if e]
    return names[0] if len(names) == 1 and names[0] in TOKEN_ENGINES else "diffusion"


def summary(turns: list[dict]) -> dict:
    later = turns[1:]
    prompt = sum(t["prompt_tokens"] for t in later)
    return {"ttft_first_s": turns[0]["ttft_seconds"], "ttft_last_s": turns[-1]["ttft_seconds"],
            "ttft_last_over_first": round(turns[-1]["ttft_seconds"] / turns[0]["ttft_seconds"], 3),
            "ttft_median_s": statistics.median(t["ttft_seconds"] for t in turns),
            "later_turns_cached_fraction": round(sum(t["cached_tokens"] for t in later) / prompt, 3) if prompt else 0}


def run(args: argparse.Namespace, directory) -> int:
    import dgemma

    apply_threads(args)
    dtype = args.dtype.split(",")[0]
    model, mode = dgemma.load(directory, dtype=dtype, device=args.device), chat_mode(args.engines)
    log(f"multi-turn: {args.turns} turns on {directory} ({dtype}, {args.device}, {mode}); warm-up")
    args_warm = argparse.Namespace(**{**vars(args), "turns": 1, "prompt_len": 8, "max_new_tokens": 1})
    chat(model, 0, args_warm)
    runs = {}
    for name, mb in (("without", 0), ("with", args.prefix_cache_mb)):
        log(f"  chat {name} the prefix cache")
        runs[name] = chat(model, mb, args)
    same = [a["output"] == b["output"] for a, b in zip(runs["with"], runs["without"])]
    for name, turns in runs.items():
        for t in turns:
            log(f"  {name:8} turn {t['turn']:2}: prompt {t['prompt_tokens']:6}, cached {t['cached_tokens']:6}, "
                f"ttft {t['ttft_seconds']:.3f} s")
            t.pop("output")
    report = {"scenario": "multi-turn", "mode": mode, "model": str(directory), "dtype": dtype, "device": args.device,
              "turns": args.turns, "prompt_len": args.prompt_len, "turn_tokens": args.turn_tokens,
              "max_new_tokens": args.max_new_tokens, "steps": args.steps, "threads": torch.get_num_threads(),
              "identical_outputs": all(same), "with": summary(runs["with"]), "without": summary(runs["without"]),
              "per_turn": runs}
    print(json.dumps(report))
    return 0
