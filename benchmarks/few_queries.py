"""Autoregressive tokens with attention of a few queries by SDPA (what ran before) and by the float32 block softmax
(`model/attention.py`, FEW_QUERIES), alternated round by round in one process on one cache, so the machine's load
falls on both alike: seconds per token of each, median over the rounds, and the median of the paired ratios.

    python benchmarks/few_queries.py --model DIR [--prompt-len 1024] [--rounds 6] [--threads 1]

Last stdout line: JSON.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
import dgemma  # noqa: E402
from dgemma.model import attention  # noqa: E402
from decode_bound import prompt  # noqa: E402

TOKENS = 4  # a round's tokens per path


def sdpa_attend(q, k, v, span):
    """`attention.attend` as it was: SDPA for every call (its unmasked form for a few queries)."""
    if q.shape[2] <= attention.FEW_QUERIES and span.mask is None:
        return attention._sdpa(q, k, v, None, span.causal)
    assert q.shape[2] > attention.FEW_QUERIES, "a masked few-query call: not what a decoded token makes"
    return block_attend(q, k, v, span)


block_attend = attention.attend


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    module = dgemma.load(args.model).module
    ids = prompt(args.prompt_len)
    cache = module.new_cache(1, ids.shape[1] + 2 * TOKENS * (args.rounds + 1))
    hidden = module.prefill(ids, cache)
    times: dict[str, list[float]] = {"sdpa": [], "blocks": []}
    for r in range(args.rounds + 1):  # round 0 warms both paths up
        for name, attend in (("sdpa", sdpa_attend), ("blocks", block_attend)):
            attention.attend = attend
            t0 = time.perf_counter()
            for _ in range(TOKENS):
                hidden = module.encode(module.head(hidden).argmax(-1)[:, None], cache)[:, -1]
            if r:
                times[name].append((time.perf_counter() - t0) / TOKENS)
    attention.attend = block_attend
    ratio = statistics.median(b / a for a, b in zip(times["sdpa"], times["blocks"]))
    print(json.dumps({"model": args.model, "prompt_len": args.prompt_len, "threads": args.threads,
                      "seconds_per_token": {n: round(statistics.median(t), 4) for n, t in times.items()},
                      "paired_ratio_blocks_over_sdpa": round(ratio, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
