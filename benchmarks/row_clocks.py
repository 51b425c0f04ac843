"""Rows on their own clocks against the batch-wide boundary (`Engine(row_clocks=False)`: the scheduler's `BatchWide`
policy), side by side in one run on the bundled model:

- mixed: 8 concurrent requests (prompts of 8..64 tokens, 32..128 new tokens, the checkpoint's adaptive
  defaults): aggregate committed tokens per second;
- sustained: the same mix as 8 clients that each send their next request as soon as their last one finished
  (a closed loop, as benchmarks/load.py drives a server), 32 requests in all: aggregate tokens per second;
- short beside slow: a 32-token request at the adaptive defaults beside one that never becomes confident and
  runs 10x the short one's steps (measured alone first): the short one's time / its time alone.

    python benchmarks/row_clocks.py [--repeats 3] [--dtype auto]

Last stdout line: JSON with the medians and the ratios (new / old for throughput, busy / alone for the short).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import dgemma  # noqa: E402
from dgemma.engine import Engine  # noqa: E402


def _ids(model, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.module.cfg.text.vocab_size, (n,), generator=g).tolist()


def _engine(model, row_clocks: bool) -> Engine:
    return Engine(model.module, model.defaults.eos_token_ids or (), model.pad_id, 16, row_clocks=row_clocks)


def mixed(model, row_clocks: bool) -> dict:
    """8 requests at once; tokens per second over the whole run, and the engine's pass statistics."""
    engine = _engine(model, row_clocks)
    reqs = [_request(model, engine, i) for i in range(8)]
    t0 = time.perf_counter()
    for _ in engine.stream():
        pass
    seconds = time.perf_counter() - t0
    return {"tokens_per_second": sum(len(r.output) for r in reqs) / seconds, "stats": engine.stats.to_dict()}


def _request(model, engine: Engine, i: int):
    return engine.add_request(_ids(model, 8 + 8 * (i % 8), i), model.defaults.replace(
        seed=i, max_new_tokens=(32, 64, 96, 128)[i % 4]))


def sustained(model, row_clocks: bool, clients: int = 8, total: int = 32) -> dict:
    """`clients` closed-loop clients, `total` requests: each finish sends that client's next request."""
    engine = _engine(model, row_clocks)
    reqs = [_request(model, engine, i) for i in range(clients)]
    t0 = time.perf_counter()
    while engine.has_work():
        for ev in engine.step():
            if ev.kind == "finish" and len(reqs) < total:
                reqs.append(_request(model, engine, len(reqs)))
    seconds = time.perf_counter() - t0
    return {"tokens_per_second": sum(len(r.output) for r in reqs) / seconds, "stats": engine.stats.to_dict()}


def short_beside_slow(model, row_clocks: bool, slow_steps: int | None) -> tuple[float, int]:
    """(seconds until the short request finishes, its denoising steps), alone or beside a slow request that takes
    `slow_steps` steps."""
    engine = _engine(model, row_clocks)
    d = model.defaults.replace(eos_token_ids=())
    short = engine.add_request(_ids(model, 12, 1), d.replace(seed=1, max_new_tokens=32))
    if slow_steps:
        engine.add_request(_ids(model, 12, 2), d.replace(seed=2, max_new_tokens=32, max_denoising_steps=slow_steps,
                                                         confidence_threshold=1e-30))
    t0 = time.perf_counter()
    while not short.finished:
        engine.step()
    return time.perf_counter() - t0, sum(short.stats.steps_per_canvas)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    model = dgemma.load(dtype=args.dtype)
    slow_steps = 10 * short_beside_slow(model, True, None)[1]
    runs: dict[str, list] = {}
    for _ in range(args.repeats):  # interleaved, so both engines see the same machine load
        for name, row_clocks in (("new", True), ("old", False)):
            runs.setdefault(f"mixed_{name}", []).append(mixed(model, row_clocks))
            runs.setdefault(f"sustained_{name}", []).append(sustained(model, row_clocks))
            runs.setdefault(f"short_alone_{name}", []).append(short_beside_slow(model, row_clocks, None)[0])
            runs.setdefault(f"short_busy_{name}", []).append(short_beside_slow(model, row_clocks, slow_steps)[0])
    loads = ("mixed", "sustained")
    med = {k: statistics.median(v) for k, v in runs.items() if not k.startswith(loads)}
    tps = {k: statistics.median(r["tokens_per_second"] for r in v) for k, v in runs.items() if k.startswith(loads)}
    print(json.dumps({
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "dtype": str(model.module.dtype), "repeats": args.repeats, "slow_steps": slow_steps,
        "mixed_tokens_per_second": tps, "mixed_ratio_new_over_old": tps["mixed_new"] / tps["mixed_old"],
        "sustained_ratio_new_over_old": tps["sustained_new"] / tps["sustained_old"],
        "pass_stats": {k: v[-1]["stats"] for k, v in runs.items() if k.startswith(loads)},
        "short_seconds": med,
        "short_busy_over_alone": {n: med[f"short_busy_{n}"] / med[f"short_alone_{n}"] for n in ("new", "old")},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
