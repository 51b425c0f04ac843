"""The report: ratios between runs, a human table and the JSON object (measurements and ratios only)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from dgemma.bench.job import TOKEN_ENGINES
from dgemma.config import ModelConfig

SCHEMA = "dgemma.bench/2"


def build_report(options: dict[str, Any], directory: Path, cfg: ModelConfig, machine: dict,
                 runs: list[dict]) -> dict[str, Any]:
    """`options`: the command's arguments; each run also carries the generation settings it used."""
    t = cfg.text
    model = {"path": str(directory), "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
             "layers": t.num_hidden_layers, "experts": t.num_experts, "top_k_experts": t.top_k_experts,
             "canvas_length": cfg.canvas_length,
             "checkpoint_bytes": sum(f.stat().st_size for f in directory.glob("*.safetensors"))}
    settings = {"prompt": f"{options['prompt_len']} random token ids (seeded)",
                "steps_meaning": "auto: the checkpoint's adaptive defaults; N: exactly N steps per canvas",
                "ignore_eos": not options["respect_eos"], "statistic": "median seconds over repeats x rounds",
                **{k: options[k] for k in ("prompt_len", "max_new_tokens", "steps", "sampling", "repeats", "rounds",
                                           "warmup", "seed", "in_process", "device", "threads")}}
    return {"schema": SCHEMA, "model": model, "settings": settings, "machine": machine, "runs": runs,
            "ratios": compute_ratios(runs)}


def compute_ratios(runs: list[dict]) -> dict[str, float]:
    """tokens/s ratios of dgemma runs: at batch 1 over autoregressive and speculative decoding in the same dtype
    (`diffusion_vs_autoregressive_<dtype>`, `diffusion_vs_speculative_<dtype>`; and speculative over
    autoregressive, which give the same ids) and over the reference at the same steps; at batch B over batch 1.
    Keys of runs at fixed steps start `fixed_<N>_steps_`: only unprefixed keys compare what a user runs."""
    ok = [r for r in runs if r.get("tokens_per_second")]
    out = {}
    for a in (r for r in ok if r["engine"] == "dgemma"):
        tag, dtype = "" if a["steps"] is None else f"fixed_{a['steps']}_steps_", a["dtype"]
        if a.get("quantize"):  # quantized over the same run unquantized
            if (base := _find(ok, "dgemma", dtype, a["steps"], a["batch"])) is not None:
                out[f"{tag}batch{a['batch']}_dgemma_{dtype}_{a['quantize']}_vs_{dtype}"] = _speedup(a, base)
            continue
        if a["batch"] > 1:
            if (one := _find(ok, "dgemma", dtype, a["steps"])) is not None:
                out[f"{tag}batch{a['batch']}_vs_batch1_dgemma_{dtype}"] = _speedup(a, one)
            continue
        if (ar := _find(ok, "autoregressive", dtype, None)) is not None:
            out[f"{tag}diffusion_vs_autoregressive_{dtype}"] = _speedup(a, ar)
        if (spec := _find(ok, "speculative", dtype, None)) is not None:
            out[f"{tag}diffusion_vs_speculative_{dtype}"] = _speedup(a, spec)
        for ref in (r for r in ok if r["engine"] == "reference" and r["batch"] == 1 and r["steps"] == a["steps"]):
            out[f"{tag}dgemma_{dtype}_vs_reference_{ref['dtype']}"] = _speedup(a, ref)
    for spec in (r for r in ok if r["engine"] == "speculative"):  # same ids as autoregressive decoding
        if (ar := _find(ok, "autoregressive", spec["dtype"], None)) is not None:
            out[f"speculative_vs_autoregressive_{spec['dtype']}"] = _speedup(spec, ar)
    return out


def _find(runs: list[dict], engine: str, dtype: str, steps: int | None, batch: int = 1) -> dict | None:
    """The unquantized run of this engine, dtype, batch and steps."""
    key = (engine, dtype, batch, steps, None)
    return next((r for r in runs if (r["engine"], r["dtype"], r["batch"], r["steps"], r.get("quantize")) == key),
                None)


def _speedup(a: dict, b: dict) -> float:
    return a["tokens_per_second"] / b["tokens_per_second"]


# ---- the human table --------------------------------------------------------------------------------------------
HEAD = ("engine", "dtype", "batch", "steps", "tok/s", "s/step", "steps/canvas", "steps/row", "rows/pass",
        "done-row s", "tok/fwd", "TTFT s", "peak MB", "weights MB", "bound s/step", "x bound")
# peak MB: process RSS (on CUDA: device memory); steps/row: decoder passes per row; done-row s: seconds spent on
# rows already done (their share of the passes' rows times the run's time)


def format_table(report: dict[str, Any]) -> str:
    rows = [HEAD] + [_row(r) for r in report["runs"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEAD))]
    lines = _preamble(report)
    lines += ["  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines += [f"  {r['engine']} {r['dtype']} batch {r['batch']}: {r['error']}"
              for r in report["runs"] if r.get("error")]
    lines += ["", "ratios (tokens/s):"] + [f"  {k}: {v:.2f}x" for k, v in report["ratios"].items()]
    return "\n".join(lines)


def _preamble(report: dict[str, Any]) -> list[str]:
    s, m, mc = report["settings"], report["model"], report["machine"]
    peaks = ", ".join(f"{k} {v['gflops']:.1f} GFLOP/s" for k, v in mc["matmul"].items())
    return [f"model {m['path']}: vocab {m['vocab_size']}, hidden {m['hidden_size']}, {m['layers']} layers, "
            f"canvas {m['canvas_length']}",
            f"prompt {s['prompt']}, {s['max_new_tokens']} new tokens, diffusion steps per canvas: {s['steps']}, "
            f"EOS {'ignored' if s['ignore_eos'] else 'respected'}, {s['statistic']} ({s['repeats']} x {s['rounds']})",
            f"machine: {mc['cpu']} ({mc['cpu_capability']}, native bf16 {mc['native_bf16']}), {mc['cores']} cores, "
            f"{mc['threads']} threads, load average {mc['load_average_start']} at start, "
            f"{mc.get('load_average_end')} at end; matmul peak {peaks}", ""]


def _row(r: dict[str, Any]) -> tuple[str, ...]:
    steps = _steps_label(r)
    dtype = r["dtype"] + (f"+{r['quantize']}" if r.get("quantize") else "")
    if r.get("error"):
        return (r["engine"], dtype, str(r["batch"]), steps, "error", *["-"] * 11)
    spc = [n for row in r["steps_per_canvas"] for n in row]
    return (r["engine"], dtype, str(r["batch"]), steps, f"{r['tokens_per_second']:.2f}",
            _num(r["seconds_per_step"]), (f"{statistics.mean(spc):.1f}" if spc else "-"),
            _num(r["passes"] / r["batch"] if r.get("passes") else None, 1), _num(r.get("rows_per_pass"), 2),
            _num(r.get("done_row_seconds"), 2), _num(r["tokens_per_forward"], 2), _num(r["ttft_seconds"], 2),
            _mb(r.get("device_peak_bytes", r["peak_rss_bytes"])), _mb(r["weights_bytes"]),
            _num(r.get("flop_bound_seconds_per_step")), _num(r.get("bound_ratio"), 2))


def _steps_label(r: dict[str, Any]) -> str:
    """What bounded each canvas: 'adaptive <=N' (checkpoint defaults), 'N fixed', or '-' (autoregressive)."""
    if r["engine"] in TOKEN_ENGINES:
        return "-"
    if r["steps"] is not None:
        return f"{r['steps']} fixed"
    limit = r.get("settings", {}).get("max_denoising_steps")
    return f"adaptive <={limit}" if limit else "adaptive"


def _num(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if x >= 0.01 or digits < 3 else f"{x:.2e}"


def _mb(x: int | None) -> str:
    return "-" if x is None else f"{x / 1e6:.0f}"
