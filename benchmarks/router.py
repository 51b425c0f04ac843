"""One server vs replicas behind a router, on a multi-turn chat workload: for 1 replica (1 thread, then all the
cores) and for 2 behind the router with each policy (cache_aware also with the router's own balance thresholds),
the prompt tokens the replicas' prefix caches reused, time to first token (first streamed text)
and output tokens/s, measured client-side. Conversations run side by side, each turn after the previous answer;
all share a system prompt. Last stdout line: JSON.

    python benchmarks/router.py [--conversations 8 --turns 6 --max-tokens 16] [--router vllm-router] [--cores 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fleet import Fleet, router_binary  # noqa: E402

SYSTEM = ("You are a patient assistant for a small zoo. Answer in short sentences, name the animal first, and say "
          "when you do not know. The zoo has foxes, dogs, owls and a very old tortoise called Block. ") * 4
ROUTER_DEFAULTS = "--balance-abs-threshold 64 --balance-rel-threshold 1.5"  # cache_aware as the routers ship it
POLICIES = {"vllm-router": ("cache_aware", "consistent_hash", "round_robin", "power_of_two"),
            "sglang-router": ("cache_aware", "round_robin", "power_of_two")}


def conversation(client, index: int, turns: int, max_tokens: int) -> list[tuple[float, int]]:
    """(time to first text, completion tokens) per turn of one conversation."""
    messages, out = [{"role": "system", "content": SYSTEM}], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Visitor {index}, question {turn}: what does the fox eat?"})
        t0, first, text, tokens = time.perf_counter(), None, "", 0
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, stream=True,
                                                temperature=0, seed=index, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        out.append((first or time.perf_counter() - t0, tokens))
        messages.append({"role": "assistant", "content": text})
    return out


def measure(fleet: Fleet, args: argparse.Namespace) -> dict:
    import openai

    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for _, url in fleet.workers:  # each replica's first request (lazy set-up) is not part of the figures
        openai.OpenAI(base_url=url + "/v1", api_key="unused").completions.create(model="tiny", prompt="Warm up.",
                                                                                 max_tokens=2)
    before = fleet.counters()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.conversations) as pool:
        results = list(pool.map(lambda i: conversation(client, i, args.turns, args.max_tokens),
                                range(args.conversations)))
    wall = time.perf_counter() - t0
    after = fleet.counters()
    turns = [t for r in results for t in r]
    ttft = sorted(t for t, _ in turns)
    reused = [a["tokens_reused"] - b["tokens_reused"] for a, b in zip(after, before)]
    hits = [a["hits"] - b["hits"] for a, b in zip(after, before)]
    return {"prefix_tokens_reused": sum(reused), "per_replica_reused": reused, "prefix_hits": sum(hits),
            "requests": len(turns), "ttft_median_s": round(statistics.median(ttft), 4),
            "ttft_p90_s": round(ttft[int(0.9 * (len(ttft) - 1))], 4),
            "output_tokens_per_s": round(sum(n for _, n in turns) / wall, 1), "wall_s": round(wall, 2)}


def run_config(checkpoint: Path, replicas: int, policy: str | None, args: argparse.Namespace,
               threads: int | None = None, router_args: str = "") -> dict:
    """One row: `replicas` behind the router with `policy` (the launcher splits the cores), or one server with
    `threads`."""
    fleet = Fleet(checkpoint, replicas, "--max-concurrency", str(args.conversations), router=args.router,
                  policy=policy or "cache_aware", threads=threads, router_args=router_args).wait_ready()
    try:
        result = measure(fleet, args)
    finally:
        fleet.stop()
    row = {"replicas": replicas, "threads_per_replica": threads or max(1, args.cores // replicas),
           "router": args.router if replicas > 1 else None, "policy": policy, "router_args": router_args, **result}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=None, help="a served checkpoint (default: the test suite's "
                   "tiny one, built in a temporary directory)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--router", default="vllm-router", choices=tuple(POLICIES))
    p.add_argument("--cores", type=int, default=2, help="the machine's cores: 1 replica runs with 1 thread, then "
                   "with this many; 2 replicas get half each (default 2)")
    args = p.parse_args()
    if router_binary(args.router) is None:
        raise SystemExit(f"error: this benchmark needs {args.router}: pip install {args.router}")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from server_fixtures import build_served_checkpoint

            checkpoint = build_served_checkpoint(Path(tmp) / "tiny", max_new_tokens=args.max_tokens)
        rows = [run_config(checkpoint, 1, None, args, threads) for threads in sorted({1, args.cores})]
        rows += [run_config(checkpoint, 2, policy, args) for policy in POLICIES[args.router]]
        rows.append(run_config(checkpoint, 2, "cache_aware", args, router_args=ROUTER_DEFAULTS))
    print(json.dumps({"workload": {"conversations": args.conversations, "turns": args.turns,
                                   "max_tokens": args.max_tokens, "checkpoint": str(args.checkpoint or "tiny")},
                      "results": rows}))


if __name__ == "__main__":
    main()
