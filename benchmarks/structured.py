"""Constrained decoding: validity over generated JSON schemas and its cost.

python benchmarks/structured.py [--schemas 200] [--batch 16] [--cost-requests 8]

1. validity: `--schemas` random schemas (dgemma/bench/schemas.py) on the bundled model and on the same
   architecture with random weights (seeded); every output must parse and validate (jsonschema_rs) and end
   with finish_reason "stop".
2. cost, on the bundled model, side by side in one process: seconds per committed token of constrained and
   unconstrained batches (same prompts, seeds and sizes, alternated), and the grammar work per denoising step
   (time inside the valid-prefix rule) reported apart.
3. budget: `--schemas` random schemas with free strings (no maxLength) on the bundled model with max_tokens =
   2x the tokens of a minimal instance (dgemma/bench/schemas.py), with the budget rule off (before: no
   completion reserved) and on (sampling/budget.py); the cost of part 2 is also measured with the rule off.
The last stdout line is JSON. Timings on a shared CPU are noisy: quote the ratio, not the seconds.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import dgemma  # noqa: E402
from dgemma import Grammar  # noqa: E402
from dgemma.bench.schemas import minimal_tokens, random_schemas  # noqa: E402
from dgemma.sampling.budget import Completions  # noqa: E402
from dgemma.engine.features import grammar as grammar_feature  # noqa: E402

PROMPT = "Here is the record as JSON:"


def randomised(model, seed: int):
    """The model with every weight redrawn (norms near 1, the rest small, a sharper embedding)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            is_norm = name.endswith(("norm.weight", "scale")) or "layernorm" in name
            p.copy_((1.0 + 0.3 * noise) if is_norm else noise * (0.5 if "embed" in name else 0.1))
    return model


def run_batch(model, schemas, seed0: int, steps: int | None, budgets=None):
    runner = model.runner("diffusion", "fast", max_batch=len(schemas))
    ids = model.encode_prompt(PROMPT)
    options = {} if steps is None else {"max_denoising_steps": steps}
    budgets = budgets or [400] * len(schemas)
    reqs = [runner.add_request(ids, model.params(grammar=None if s is None else Grammar.json_schema(s),
                                                 seed=seed0 + i, max_new_tokens=b, **options))
            for i, (s, b) in enumerate(zip(schemas, budgets))]
    t0 = time.perf_counter()
    for _ in runner.stream():
        pass
    return reqs, time.perf_counter() - t0


def validity(model, schemas, batch: int, steps: int | None, budgets=None) -> dict:
    import jsonschema_rs

    valid = 0
    failures = []
    for lo in range(0, len(schemas), batch):
        part = schemas[lo:lo + batch]
        reqs, _ = run_batch(model, part, lo, steps, budgets and budgets[lo:lo + batch])
        for schema, r in zip(part, reqs):
            text = model.tokenizer.decode(r.output)
            try:
                ok = r.finish_reason == "stop" and jsonschema_rs.is_valid(schema, json.loads(text))
            except json.JSONDecodeError:
                ok = False
            valid += ok
            if not ok and len(failures) < 3:
                failures.append({"schema": schema, "text": text, "finish_reason": r.finish_reason})
    return {"schemas": len(schemas), "valid": valid, "rate": valid / len(schemas), "failures": failures}


class GrammarClock:
    """Wall time inside the engine's grammar hooks (constrain_step, complete_rows) and the number of steps."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        for name in ("constrain_step", "complete_rows"):
            setattr(grammar_feature, name, self._timed(getattr(grammar_feature, name), name == "constrain_step"))

    def _timed(self, fn, counts: bool):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += counts
        return timed


def cost(model, schemas, batch: int, rounds: int, steps: int | None) -> dict:
    clock = GrammarClock()
    per_token = {"constrained": [], "unconstrained": []}
    run_batch(model, schemas[:batch], 0, steps)  # warm-up: the grammar vocabulary, first allocations
    clock.seconds, clock.calls = 0.0, 0
    for r in range(rounds):
        part = schemas[r * batch:(r + 1) * batch]
        for kind, row in (("constrained", part), ("unconstrained", [None] * len(part))):
            reqs, seconds = run_batch(model, row, 100 * r, steps)
            per_token[kind].append(seconds / max(1, sum(len(q.output) for q in reqs)))
    med = {k: statistics.median(v) for k, v in per_token.items()}
    return {"seconds_per_token": med, "ratio": med["constrained"] / med["unconstrained"],
            "grammar_ms_per_step": 1000 * clock.seconds / max(1, clock.calls), "grammar_steps": clock.calls}


def budget(model, n: int, batch: int, steps: int | None) -> dict:
    """Free-string schemas at max_tokens = 2x a minimal instance's tokens, the budget rule off, then on."""
    schemas = random_schemas(n, seed=1, free=True)
    budgets = [2 * minimal_tokens(model.tokenizer, s) for s in schemas]
    with budget_rule_off():
        off = validity(model, schemas, batch, steps, budgets)
    on = validity(model, schemas, batch, steps, budgets)
    return {"rule_off": off, "rule_on": on}


@contextlib.contextmanager
def budget_rule_off():
    """Constrained decoding as before the budget rule: no completion is ever found, so nothing is reserved."""
    search = Completions.shortest
    Completions.shortest = lambda *args, **kwargs: None
    try:
        yield
    finally:
        Completions.shortest = search


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemas", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--cost-rounds", type=int, default=3, help="constrained / unconstrained batch pairs")
    p.add_argument("--steps", type=int, help="max denoising steps per canvas (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the models are tiny)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    schemas = random_schemas(args.schemas, seed=0)
    demo = dgemma.load()
    report = {"cpu_threads": torch.get_num_threads(), "schemas": args.schemas, "batch": args.batch}
    report["cost_bundled"] = cost(demo, schemas, args.batch, args.cost_rounds, args.steps)
    print("cost", report["cost_bundled"], flush=True)
    with budget_rule_off():
        report["cost_bundled_rule_off"] = cost(demo, schemas, args.batch, args.cost_rounds, args.steps)
    print("cost, budget rule off", report["cost_bundled_rule_off"], flush=True)
    report["validity_bundled"] = validity(demo, schemas, args.batch, args.steps)
    print("bundled", {k: v for k, v in report["validity_bundled"].items() if k != "failures"}, flush=True)
    report["budget_bundled"] = budget(demo, args.schemas, args.batch, args.steps)
    print("budget", {k: (v["valid"], v["schemas"]) for k, v in report["budget_bundled"].items()}, flush=True)
    report["validity_random"] = validity(randomised(dgemma.load(), seed=1), schemas, args.batch, args.steps)
    print("random", {k: v for k, v in report["validity_random"].items() if k != "failures"}, flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
