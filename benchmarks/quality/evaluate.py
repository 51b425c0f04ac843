"""The quality harness: decode the exactly-checkable tasks of tasks.py with a checkpoint under several decoding
variants, side by side with the checkpoint's exact defaults, and report per task and overall the exact-match
accuracy, tokens per decoder pass, FLOPs per committed token (dgemma.bench.flops), time to the first committed
token (the first "text" event of Model.stream) and tokens/s; FLOPs per committed token are also projected onto the
released 26B-A4B shape (body-heavy: benchmarks/real_shape.py) at the checkpoint's canvas, from the same decoding
(the same steps, settled and skipped positions); plus the held-out likelihood of a model under the
training objective (dgemma.train.objective). Last stdout line JSON.

    python benchmarks/quality/evaluate.py --model runs/quality/final
    python benchmarks/quality/evaluate.py --model CKPT --variants defaults,max_steps_8,early_commit_2 \\
        --variant 'early_commit_4={"early_commit": 4}'

A variant is a dict of Model.stream keywords: SamplingParams fields, plus `mode` and `sampling`. A new decoding
option is one entry in VARIANTS (or one --variant flag). Every variant decodes the same examples with the same
seeds, round-robin over variants per example so that a shared machine's load falls on all of them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tasks  # noqa: E402
from real_shape import real_config  # noqa: E402
from dgemma.bench.flops import (autoregressive_flops, cpu_name, diffusion_flops, load_average,  # noqa: E402
                                saved_flops, speculative_flops)
from dgemma.errors import DgemmaError  # noqa: E402
from dgemma.options import MODES, SAMPLINGS  # noqa: E402

SCHEMA = "dgemma.quality/1"
HELDOUT = Path(__file__).resolve().parent / "heldout.txt"
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},  # the checkpoint's generation_config.json: what every other variant is compared with
    "max_steps_16": {"max_denoising_steps": 16},
    "max_steps_8": {"max_denoising_steps": 8},
    "entropy_bound_2": {"entropy_bound": 2.0},
    "constant_t_0.3": {"t_min": 0.3, "t_max": 0.3},
    "reference_sampling": {"sampling": "reference"},
    "autoregressive": {"mode": "autoregressive"},
    "speculative": {"mode": "speculative"},
    "early_commit_1": {"early_commit": 1},
    "early_commit_2": {"early_commit": 2},
    "early_commit_3": {"early_commit": 3},
    "early_commit_1_cache": {"early_commit": 1, "early_commit_cache": True},
    "early_first_token": {"early_first_token": True},
    "early_first_token_commit_2": {"early_first_token": True, "early_commit": 2},
    "early_stop_0.05": {"early_stop": 0.05},
    "early_stop_0.2": {"early_stop": 0.2},
    "target_canvas_ms_50": {"target_canvas_ms": 50.0},
}
DEFAULT_VARIANTS = ("defaults", "max_steps_16", "max_steps_8", "entropy_bound_2", "autoregressive")


# ---- one example --------------------------------------------------------------------------------------------------
def decode(model, example: tasks.Example, variant: dict[str, Any], seed: int) -> dict[str, Any]:
    """Stream one answer; the measurements of this example under this variant. The chat prompt is tokenized
    before the clock starts: the times are the engine's, from token ids."""
    prompt = model.encode_prompt(example.messages()[:1])
    t0 = time.perf_counter()
    ttft, result = None, None
    for event in model.stream(prompt, drafts=False, seed=seed, **variant):
        if event.kind == "text" and event.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        elif event.kind == "done":
            result = event.result
    seconds = time.perf_counter() - t0
    mode = variant.get("mode", MODES[0])
    released = released_shape(model.module.cfg.canvas_length)
    return {"correct": tasks.is_correct(example, result.text or ""), "output": result.text,
            "tokens": len(result.token_ids), "passes": result.stats["decoder_passes"],
            "steps_per_canvas": result.stats["steps_per_canvas"],
            "flops": flops(model.module.cfg, result, mode, variant.get("soft_top_k")), "ttft": ttft,
            "released_flops": flops(released, result, mode, variant.get("soft_top_k")),
            "one_pass_flops": one_pass_flops(model.module.cfg, result, mode), "seconds": seconds}


def flops(cfg, result, mode: str, soft_top_k: int | None = None) -> float:
    """Matmul FLOPs of this request under the one FLOP model (prefill, each decoder pass, commits), less what its
    opt-in savings spared (settled positions, a sparse soft embedding)."""
    if mode == "autoregressive":  # one pass per generated token, the final EOS included
        return autoregressive_flops(cfg, result.prompt_tokens, result.stats["decoder_passes"])["total"]
    if mode == "speculative":
        return speculative_flops(cfg, result.prompt_tokens, result.stats["cycles"])["total"]
    full = diffusion_flops(cfg, result.prompt_tokens, result.stats["steps_per_canvas"])["total"]
    return full - saved_flops(cfg, result.stats, soft_top_k, result.prompt_tokens)


@functools.cache
def released_shape(canvas: int):
    """The released 26B-A4B shape (30 layers, 262K vocabulary) with this canvas: the body-heavy cost side."""
    return dataclasses.replace(real_config(30), canvas_length=canvas)


def one_pass_flops(cfg, result, mode: str) -> float:
    """The least a canvas decoder could spend on this answer: its prompt and canvases, one decoder pass each."""
    if mode != "diffusion":
        return flops(cfg, result, mode)
    return diffusion_flops(cfg, result.prompt_tokens, [1] * len(result.stats["steps_per_canvas"]))["total"]


# ---- aggregation --------------------------------------------------------------------------------------------------
def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy; tokens (EOS excluded) per decoder pass; FLOPs per committed token and per answer; median time to
    the first committed token (answers with none left out); tokens/s over the summed decoding time."""
    tokens, passes = sum(r["tokens"] for r in rows), sum(r["passes"] for r in rows)
    total_flops, seconds = sum(r["flops"] for r in rows), sum(r["seconds"] for r in rows)
    ttfts = [r["ttft"] for r in rows if r["ttft"] is not None]
    return {"examples": len(rows), "correct": sum(r["correct"] for r in rows),
            "accuracy": sum(r["correct"] for r in rows) / len(rows),
            "tokens": tokens, "decoder_passes": passes, "tokens_per_pass": tokens / passes if passes else None,
            "flops_per_token": total_flops / tokens if tokens else None, "flops_per_answer": total_flops / len(rows),
            "one_pass_flops_per_token": sum(r["one_pass_flops"] for r in rows) / tokens if tokens else None,
            "released_shape_flops_per_token": sum(r["released_flops"] for r in rows) / tokens if tokens else None,
            "ttft_seconds_median": statistics.median(ttfts) if ttfts else None,
            "tokens_per_second": tokens / seconds if seconds > 0 else None}


def per_task(examples: list[tasks.Example], rows: list[dict[str, Any]]) -> dict[str, Any]:
    names = list(dict.fromkeys(e.task for e in examples))
    return {"overall": summarise(rows),
            "tasks": {t: summarise([r for e, r in zip(examples, rows) if e.task == t]) for t in names}}


def versus_defaults(results: dict[str, Any]) -> dict[str, Any]:
    """Each variant against the defaults: accuracy in points, and ratios (variant / defaults)."""
    base = results["defaults"]["overall"]
    out = {}
    for name, res in results.items():
        v = res["overall"]
        out[name] = {"accuracy_points": 100 * (v["accuracy"] - base["accuracy"]),
                     **{f"{k}_ratio": _ratio(v[k], base[k]) for k in
                        ("flops_per_token", "flops_per_answer", "ttft_seconds_median", "tokens_per_second",
                         "tokens_per_pass", "released_shape_flops_per_token")},
                     # the FLOP ratio no option could go below with these answers' canvases (one pass each)
                     "one_pass_floor_ratio": _ratio(v["one_pass_flops_per_token"], base["flops_per_token"])}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- the run ------------------------------------------------------------------------------------------------------
def evaluate(model, examples: list[tasks.Example], variants: dict[str, dict[str, Any]], seed: int = 0,
             common: dict[str, Any] | None = None, log=None) -> dict[str, Any]:
    """Every variant on every example (example i decoded with seed + i under each variant), after one warm-up
    decode per variant. `variants` must contain "defaults"; `common` options apply to all of them."""
    variants = {name: {**(common or {}), **v} for name, v in variants.items()}
    for variant in variants.values():
        decode(model, examples[0], variant, seed)
    rows: dict[str, list] = {name: [] for name in variants}
    for i, example in enumerate(examples):
        for name, variant in variants.items():
            rows[name].append(decode(model, example, variant, seed + i))
        if log and (i + 1) % 20 == 0:
            log(f"{i + 1}/{len(examples)} examples")
    results = {name: {"options": variants[name], **per_task(examples, r)} for name, r in rows.items()}
    outputs = {name: [r["output"] for r in rs] for name, rs in rows.items()}
    vs = versus_defaults(results)
    for name, out in outputs.items():  # answers unchanged bound the accuracy change: |points| <= 100 - this
        vs[name]["same_answer_percent"] = 100 * sum(a == b for a, b in zip(out, outputs["defaults"])) / len(out)
    return {"variants": results, "vs_defaults": vs,  # per example, in order: paired
            "outputs": outputs, "correct": {name: [r["correct"] for r in rs] for name, rs in rows.items()}}


@torch.no_grad()
def heldout_nll(model_path: str | None, text: Path, dtype: str, draws: int = 4, batch_size: int = 8,
                max_windows: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Nats per token of the training objective on held-out plain text: the diffusion loss (canvas cross-entropy
    at t ~ U(eps, 1 - eps), `draws` noise draws per window, fixed seed) and the encoder's next-token loss. One
    canvas per window, prompts of 0-63 preceding tokens, as the trainer's held-out evaluation."""
    import dgemma
    from dgemma.train.data import collate, load_dataset
    from dgemma.train.objective import ObjectiveConfig, compute_losses

    model = dgemma.load(model_path, dtype=dtype)
    module, tok = model.module.eval(), model.tokenizer
    c, eos = module.cfg.canvas_length, tok.token_id(tok.eos_token)
    data = load_dataset(text, tok, c, 1, 64, seed)
    n = min(len(data), max_windows or len(data))
    batches = [collate([data.get(j, 0) for j in range(i, min(n, i + batch_size))], c, eos)
               for i in range(0, n, batch_size)]
    g = torch.Generator().manual_seed(seed)
    sums = {"diffusion": 0.0, "autoregressive": 0.0, "canvas_tokens": 0, "ar_tokens": 0}
    for batch in batches:
        for _ in range(draws):
            losses = compute_losses(module, batch, ObjectiveConfig(), g)
            sums["diffusion"] += losses.diffusion * losses.canvas_tokens
            sums["autoregressive"] += losses.autoregressive * losses.ar_tokens
            sums["canvas_tokens"] += losses.canvas_tokens
            sums["ar_tokens"] += losses.ar_tokens
    return {"model": str(model.directory), "text": str(text), "windows": n, "draws": draws,
            "diffusion_nats_per_token": sums["diffusion"] / sums["canvas_tokens"],
            "autoregressive_nats_per_token": sums["autoregressive"] / max(1, sums["ar_tokens"])}


# ---- command line -------------------------------------------------------------------------------------------------
def choose_variants(names: str, extra: list[str]) -> dict[str, dict[str, Any]]:
    """`names`: comma-separated keys of VARIANTS; `extra`: NAME=JSON (a dict of Model.stream keywords)."""
    chosen = {"defaults": {}}
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name not in VARIANTS:
            raise DgemmaError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)}; add one with --variant)")
        chosen[name] = VARIANTS[name]
    for item in extra:
        name, _, spec = item.partition("=")
        try:
            options = json.loads(spec)
        except json.JSONDecodeError:
            options = None
        if not name or not isinstance(options, dict):
            raise DgemmaError(f"--variant {item!r}: expected NAME={{JSON object of decoding options}}")
        chosen[name] = options
    return chosen


def check_variants(model, variants: dict[str, dict[str, Any]]) -> None:
    """Refuse unknown or invalid options before any decoding (the API's own validation)."""
    for name, variant in variants.items():
        options = {k: v for k, v in variant.items() if k not in ("mode", "sampling")}
        try:
            model.params(**options)
            model.runner(variant.get("mode", MODES[0]), variant.get("sampling", SAMPLINGS[0]))
        except ValueError as e:
            raise DgemmaError(f"variant {name}: {e}") from None


def table(report: dict[str, Any]) -> str:
    variants = report["variants"]
    names = list(next(iter(variants.values()))["tasks"])
    width = max(len(n) for n in variants)
    head = [*names, "overall", "tok/pass", "MFLOP/tok", "TTFT ms", "tok/s"]
    lines = [f"{'accuracy %':<{width}}  " + "  ".join(f"{h:>9}" for h in head)]
    for name, res in variants.items():
        o = res["overall"]
        cells = [f"{100 * res['tasks'][t]['accuracy']:.1f}" for t in names] + [f"{100 * o['accuracy']:.1f}"]
        cells += [_fmt(o["tokens_per_pass"], 1), _fmt(o["flops_per_token"], 1e-6),
                  _fmt(o["ttft_seconds_median"], 1e3), _fmt(o["tokens_per_second"], 1)]
        lines.append(f"{name:<{width}}  " + "  ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)


def _fmt(x: float | None, scale: float) -> str:
    return "-" if x is None else f"{x * scale:.3g}"


def machine() -> dict[str, Any]:
    return {"cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "load_average": load_average()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/quality/final", help="the harness checkpoint (train.py's final/)")
    p.add_argument("--per-task", type=int, default=50, help="examples per task")
    p.add_argument("--tasks", default=None, help="comma-separated task names (default: the tasks the checkpoint "
                   "learned)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from: {', '.join(VARIANTS)} (defaults always runs)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="an extra variant, e.g. 'fewer={\"max_denoising_steps\": 4}' (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="for every variant (default: the checkpoint's)")
    p.add_argument("--dtype", default="float32", help="weights dtype (float32: the same numbers on every CPU)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="decoding seeds: seed + example index")
    p.add_argument("--train-examples", type=int, default=None,
                   help="the checkpoint's training set size (train.py --train-examples; default: what the checkpoint "
                   "records): its prompts are never asked")
    p.add_argument("--nll-model", default=None, help="model of the held-out likelihood (default: the bundled one)")
    p.add_argument("--nll-text", type=Path, default=HELDOUT, help="held-out plain text")
    p.add_argument("--no-nll", action="store_true", help="skip the held-out likelihood")
    p.add_argument("--show", type=int, default=0, help="print this many outputs per variant")
    args = p.parse_args()
    try:
        return run(args)
    except DgemmaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    import dgemma

    torch.set_num_threads(args.threads)
    try:
        names = tasks.parse_tasks(args.tasks) if args.tasks is not None else None
    except ValueError as e:
        raise DgemmaError(str(e)) from None
    model = dgemma.load(args.model, dtype=args.dtype)
    common = {"max_new_tokens": args.max_new_tokens} if args.max_new_tokens else {}
    variants = choose_variants(args.variants, args.variant)
    check_variants(model, {name: {**common, **v} for name, v in variants.items()})
    harness, n_train, learned = tasks.read_harness(model.directory)
    n_train, names = args.train_examples or n_train, names or learned
    try:
        examples = tasks.evaluation_set(args.per_task, names, n_train, tasks.HARNESSES[harness], learned)
    except ValueError as e:
        raise DgemmaError(f"{e}: score fewer examples (--per-task) or leave the task out (--tasks)") from None
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    start_load = load_average()
    report = {"schema": SCHEMA, "model": str(model.directory), "machine": machine(),
              "settings": {"per_task": args.per_task, "tasks": list(names), "examples_seed": tasks.EVAL_SEED,
                           "harness": harness, "train_examples_excluded": n_train,
                           "decode_seed": args.seed, "dtype": args.dtype, "batch": 1, "common": common},
              **evaluate(model, examples, variants, args.seed, common, log)}
    report["machine"]["load_average"] = [start_load, load_average()]
    if not args.no_nll:
        report["heldout_nll"] = heldout_nll(args.nll_model, args.nll_text, args.dtype)
    for name in variants if args.show else ():
        print(f"{name}: {[(e.prompt, o) for e, o in zip(examples, report['outputs'][name][:args.show])]}")
    print(table(report))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
