"""`dgemma bench` arguments, the plan (one Job per engine, dtype, batch and steps) and the run that prints the report.

Every engine gets the same checkpoint, prompts and settings. By default each diffusion engine runs at the
checkpoint's own adaptive defaults (its generation_config.json: step budget, early exit, entropy bound), as a
user would; `--steps N` instead forces exactly N steps per canvas (fixed work, for comparing against the
reference and the FLOP bound), and `--steps auto,4` runs both side by side. EOS is ignored unless
`--respect-eos`, so every engine produces `--max-new-tokens` tokens. A table goes to stdout, then one JSON line;
progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dgemma.bench.job import ENGINES, Job, log
from dgemma.dtypes import NAMES
from dgemma.errors import DgemmaError
from dgemma.options import add_threads_option, apply_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--device", default="cpu", help="torch device for every engine, e.g. cpu or cuda")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens (random ids, seeded)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate per prompt")
    p.add_argument("--steps", default="auto",
                   help="denoising steps per canvas, comma-separated: auto = the checkpoint's adaptive defaults, "
                        "as a user runs it (default); N = exactly N steps, fixed work")
    p.add_argument("--batch", default="1,4", help="dgemma batch sizes (concurrent prompts), comma-separated")
    p.add_argument("--dtype", default=",".join(NAMES), help=f"dgemma and autoregressive dtypes ({', '.join(NAMES)})")
    p.add_argument("--quantize", default="none",
                   help="dgemma weight quantization on load, comma-separated: none, int8, int4 (see dgemma generate "
                        "--help), e.g. none,int8,int4 to compare them side by side")
    p.add_argument("--reference-dtype", default="float32", help="reference dtypes (its default is float32)")
    p.add_argument("--reference-batch", default="1", help="reference batch sizes")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {','.join(ENGINES)}")
    p.add_argument("--sampling", choices=["fast", "reference"], default="fast", help="dgemma sampling path")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (medians reported)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole plan this many times, interleaved, pooling the repeats (on a shared machine "
                        "the load drifts: rounds spread it over every configuration)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs (1 step per canvas) first")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts and sampling")
    p.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: ignore it, fixed length)")
    p.add_argument("--in-process", action="store_true",
                   help="run every configuration in this process (faster; peak memory is then shared)")
    add_threads_option(p)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration before it is killed")
    p.add_argument("--scenario", choices=["throughput", "multi-turn"], default="throughput",
                   help="throughput: the engines side by side (default); multi-turn: one chat of --turns turns with "
                        "and without the prefix cache (time to first token, prompt tokens reused)")
    p.add_argument("--turns", type=int, default=10, help="multi-turn: turns in the chat (default 10)")
    p.add_argument("--turn-tokens", type=int, default=32, help="multi-turn: new tokens each later turn adds")
    p.add_argument("--prefix-cache-mb", type=int, default=1024, help="multi-turn: prefix cache budget (MiB)")
    p.add_argument("--matmul-size", type=int, default=None,
                   help="largest square matmul for the peak (default 2048 on CPU, 8192 on GPU)")


def run(args: argparse.Namespace) -> int:
    import torch

    from dgemma.bench import flops, report, trials
    from dgemma.weights.hf import read_config

    directory = _model_dir(args.model)
    if args.scenario == "multi-turn":
        from dgemma.bench import multiturn

        return multiturn.run(args, directory)
    cfg = read_config(directory)
    jobs = plan(args, str(directory))
    apply_threads(args)
    log(f"dgemma bench: {len(jobs)} configurations on {directory} ({args.device}, {torch.get_num_threads()} "
        f"threads); diffusion steps per canvas: {args.steps}")
    machine = flops.measure_machine(args.device, args.matmul_size, _csv(args.dtype) + _csv(args.reference_dtype))
    runs = [flops.add_bounds(trials.pool(outs), cfg, machine) for outs in _measure_rounds(args, jobs)]
    machine["load_average_end"] = flops.load_average()
    result = report.build_report(vars(args), directory, cfg, machine, runs)
    print(report.format_table(result))
    print(json.dumps(result))
    return 0


def _measure_rounds(args: argparse.Namespace, jobs: list[Job]) -> list[list[dict]]:
    """Every job once per round, in plan order; per job, its results from every round."""
    from dgemma.bench import trials

    outs: list[list[dict]] = [[] for _ in jobs]
    for r in range(args.rounds):
        for i, job in enumerate(jobs):
            log(f"[round {r + 1}/{args.rounds}, {i + 1}/{len(jobs)}] {job.label}")
            outs[i].append(trials.run_job(job) if args.in_process else trials.run_isolated(job, args.timeout))
    return outs


def _model_dir(model: str | None) -> Path:
    from dgemma.api.checkpoint import locate

    return locate(model)[0]


def plan(args: argparse.Namespace, model: str) -> list[Job]:
    """One Job per (engine, dtype, batch, steps); autoregressive and speculative decoding run at batch 1 and have no
    steps."""
    engines, dtypes, ref_dtypes = _csv(args.engines), _csv(args.dtype), _csv(args.reference_dtype)
    batches, ref_batches = _csv(args.batch, int), _csv(args.reference_batch, int)
    steps = parse_steps(args.steps)
    _check(args, engines, dtypes + ref_dtypes, batches + ref_batches)
    common = dict(model=model, device=args.device, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                  repeats=args.repeats, warmup=args.warmup, seed=args.seed, sampling=args.sampling,
                  ignore_eos=not args.respect_eos, threads=args.threads)
    quants = [None if q == "none" else q for q in _csv(args.quantize)]
    shapes = {"dgemma": [(d, b, n, q) for d in dtypes for q in quants for b in batches for n in steps],
              "autoregressive": [(d, 1, None, None) for d in dtypes],
              "speculative": [(d, 1, None, None) for d in dtypes],
              "reference": [(d, b, n, None) for d in ref_dtypes for b in ref_batches for n in steps]}
    return [Job(e, d, b, steps=n, quantize=q, **common) for e in ENGINES if e in engines
            for d, b, n, q in shapes[e]]


def parse_steps(text: str) -> list[int | None]:
    """'auto,4' -> [None, 4]: None runs the checkpoint's adaptive defaults, N exactly N steps per canvas."""
    out = [None if x == "auto" else _csv(x, int)[0] for x in _csv(text)]
    if not out or any(n is not None and n < 1 for n in out):
        raise DgemmaError(f"--steps {text!r}: expected auto or whole numbers of at least 1, comma-separated")
    return out


def _check(args: argparse.Namespace, engines: list[str], dtypes: list[str], batches: list[int]) -> None:
    if bad := set(engines) - set(ENGINES):
        raise DgemmaError(f"unknown engine(s) {sorted(bad)}; choose from {', '.join(ENGINES)}")
    if bad := set(dtypes) - set(NAMES):
        raise DgemmaError(f"unknown dtype(s) {sorted(bad)}; choose from {', '.join(NAMES)}")
    for name in ("prompt_len", "max_new_tokens", "repeats", "rounds"):
        if getattr(args, name) < 1:
            raise DgemmaError(f"--{name.replace('_', '-')} must be at least 1")
    from dgemma.quant.spec import parse_quantize

    for q in _csv(args.quantize):
        if q != "none":
            parse_quantize(q)
    if min(batches, default=1) < 1:
        raise DgemmaError("batch sizes must be at least 1")


def _csv(text: str, kind: type = str) -> list:
    try:
        return [kind(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise DgemmaError(f"expected a comma-separated list of {kind.__name__}, got {text!r}") from None
