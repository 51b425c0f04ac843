"""The FLOP model (matmul FLOPs of prefill, denoising steps, commits and autoregressive tokens) and the machine
it is divided by: the measured square-matmul peak, CPU and thread facts, load average."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dgemma.bench.job import log, sync
from dgemma.config import ModelConfig, TextConfig
from dgemma.dtypes import native_bf16, parse_dtype
from dgemma.engine.features import COUNTERS


# ---- FLOP model -------------------------------------------------------------------------------------------------
def body_flops(t: TextConfig, n: int, context: int, causal: bool) -> float:
    """Matmul FLOPs of the layer stack for n new tokens after `context` cached ones: projections, attention
    (QK and PV over the keys each query sees; sliding layers see at most `sliding_window`), dense MLP, router,
    and the top-k experts only."""
    h, total = t.hidden_size, 0.0
    for i in range(t.num_hidden_layers):
        spec = t.layer(i)
        q, kv = t.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        total += 2 * n * h * (2 * q + kv * (2 if spec.sliding else 1))  # q, o, k (+ v on sliding layers)
        total += 4 * _pairs(n, context, t.sliding_window if spec.sliding else None, causal) * spec.head_dim \
            * t.num_attention_heads
        total += 6 * n * h * t.intermediate_size + 2 * n * h * t.num_experts
        total += 6 * n * h * t.moe_intermediate_size * t.top_k_experts
    return total


def _pairs(n: int, context: int, window: int | None, causal: bool) -> int:
    """(query, key) pairs: causal queries see the context and earlier new tokens; the canvas sees all of itself."""
    if not causal:
        return n * (min(context, window or context) + n)
    return sum(min(context + j, window or context + j) for j in range(1, n + 1))


def diffusion_flops(cfg: ModelConfig, prompt_len: int, steps_per_canvas: list[int]) -> dict[str, float]:
    """One prompt: prefill, then per canvas its decoder passes (LM head each; self-conditioning soft embedding
    C x V x H and its MLP on all but the canvas's last step), and an encoder commit of every canvas but the last."""
    t, c = cfg.text, cfg.canvas_length
    head = 2 * c * t.hidden_size * t.vocab_size
    self_cond = 2 * c * t.vocab_size * t.hidden_size + 6 * c * t.hidden_size * t.intermediate_size
    total = body_flops(t, prompt_len, 0, causal=True)
    for k, steps in enumerate(steps_per_canvas):
        context = prompt_len + k * c
        total += steps * (body_flops(t, c, context, causal=False) + head) + max(steps - 1, 0) * self_cond
        if k < len(steps_per_canvas) - 1:
            total += body_flops(t, c, context, causal=True)
    step = body_flops(t, c, prompt_len, causal=False) + head + self_cond
    return {"total": total, "steps": sum(steps_per_canvas), "decoder_step": step, "lm_head": head,
            "self_conditioning": self_cond}


def unit_flops(cfg: ModelConfig, soft_top_k: int | None, context: int = 0) -> dict[str, float]:
    """Matmul FLOPs of `diffusion_flops` in one unit of each kind of work the features count (their `counters`,
    engine/features/base.py): a position's LM head or soft-embedding row (2 V H), a soft embedding over k entries
    instead of V (`soft_top_k`: 2 (V - k) H), a canvas position's share of a decoder pass after `context` cached
    tokens with its self-conditioning MLP, and an id through the encoder."""
    t, c = cfg.text, cfg.canvas_length
    return {"vocab_row": 2 * t.hidden_size * t.vocab_size,
            "sparse_soft_row": 2 * t.hidden_size * max(t.vocab_size - (soft_top_k or t.vocab_size), 0),
            "canvas_body_row": body_flops(t, c, context, causal=False) / c + 6 * t.hidden_size * t.intermediate_size,
            "encoded_id": body_flops(t, 1, context, causal=True)}


def saved_flops(cfg: ModelConfig, stats: dict[str, Any], soft_top_k: int | None, context: int = 0) -> float:
    """Matmul FLOPs of `diffusion_flops` that a request's opt-in savings spared, from its stats (engine/request.py):
    each feature counter's units of work left out, less those it added (`Counter.saves` False), priced by
    `unit_flops`."""
    total = 0
    for unit, flops in unit_flops(cfg, soft_top_k, context).items():
        total += flops * sum(stats.get(k.name, 0) * (1 if k.saves else -1) for k in COUNTERS if k.unit == unit)
    return total


def autoregressive_flops(cfg: ModelConfig, prompt_len: int, tokens: int) -> dict[str, float]:
    """One prompt: prefill, then one LM head per token and an encoder pass for every token but the last."""
    t = cfg.text
    head = 2 * t.hidden_size * t.vocab_size
    total = body_flops(t, prompt_len, 0, causal=True) + tokens * head
    total += sum(body_flops(t, 1, prompt_len + j, causal=True) for j in range(tokens - 1))
    return {"total": total, "steps": tokens, "decoder_step": head + body_flops(t, 1, prompt_len, causal=True)}


def speculative_flops(cfg: ModelConfig, prompt_len: int, cycles: list[tuple[int, int, bool]]) -> dict[str, float]:
    """One prompt: prefill and the LM head of its last position (the first token), then per step (`cycles`,
    engine/speculative.py) an encoder pass with the LM head over the ids it encoded after the cached slots, and
    where it drafted, a decoder pass over a canvas with the LM head on every position."""
    t, c = cfg.text, cfg.canvas_length
    row = 2 * t.hidden_size * t.vocab_size
    total = body_flops(t, prompt_len, 0, causal=True) + row
    for cached, n, drafted in cycles:
        total += body_flops(t, n, cached, causal=True) + n * row
        total += (body_flops(t, c, cached, causal=False) + c * row) * drafted
    return {"total": total, "steps": sum(1 + drafted for _, _, drafted in cycles),
            "decoder_step": body_flops(t, c, prompt_len, causal=False) + c * row}


def add_bounds(run: dict[str, Any], cfg: ModelConfig, machine: dict[str, Any]) -> dict[str, Any]:
    """Lower bound per step = the FLOPs the run did (its own steps per canvas, every row) / its steps / peak.
    A bfloat16 run is held to the better of the bfloat16 and float32 peaks (bf16 weights may run fp32 GEMMs)."""
    if run.get("error") or not run.get("total_steps"):
        return run
    if run["engine"] == "autoregressive":
        rows = [autoregressive_flops(cfg, run["prompt_len"], n) for n in run["row_tokens"]]
    elif run["engine"] == "speculative":
        rows = [speculative_flops(cfg, run["prompt_len"], v) for v in run["cycles"]]
    else:
        rows = [diffusion_flops(cfg, run["prompt_len"], spc) for spc in run["steps_per_canvas"]]
    peaks = machine["matmul"]
    peak = max(peaks[run["dtype"]]["gflops"], peaks["float32"]["gflops"]) * 1e9
    total = sum(f["total"] for f in rows)
    bound = total / run["total_steps"] / peak
    return {**run, "flops": total, "decoder_step_flops": rows[0]["decoder_step"] * run["batch"],
            "peak_gflops_used": peak / 1e9, "flop_bound_seconds_per_step": bound,
            "bound_ratio": run["seconds_per_step"] / bound}


# ---- the machine ------------------------------------------------------------------------------------------------
def matmul_peak(dtype: torch.dtype, device: str = "cpu", max_size: int = 2048, budget: float = 1.5) -> dict:
    """GFLOP/s of square matmuls: sizes double from 256 until one takes `budget`/4 s or reaches `max_size`;
    the peak is the best run (the machine may be shared), the median is over runs at the largest size."""
    n, best = 256, 0.0
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        rates, spent = [], 0.0
        while spent < budget and len(rates) < 20 or len(rates) < 2:
            sync(device)
            t0 = time.perf_counter()
            a @ b
            sync(device)
            dt = time.perf_counter() - t0
            spent += dt
            rates.append(2 * n**3 / dt / 1e9)
        best = max(best, *rates)
        if n * 2 > max_size or spent / len(rates) > budget / 4:
            return {"gflops": best, "gflops_median": statistics.median(rates), "size": n}
        n *= 2


def measure_machine(device: str, max_size: int | None, dtypes: list[str]) -> dict[str, Any]:
    """The matmul peak per dtype plus what the numbers depend on: CPU, vector ISA, threads, versions, load."""
    size = max_size or (8192 if device.startswith("cuda") else 2048)
    peaks = {}
    for name in sorted(set(dtypes) | {"float32"}):
        log(f"matmul peak {name} ...")
        peaks[name] = matmul_peak(parse_dtype(name), device, size)
        log(f"  {peaks[name]['gflops']:.1f} GFLOP/s (best), {peaks[name]['gflops_median']:.1f} median "
            f"at {peaks[name]['size']}")
    info = {"device": device, "cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": native_bf16(torch.device(device).type), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "matmul": peaks, "load_average_start": load_average()}
    with contextlib.suppress(ImportError):
        import transformers

        info["transformers"] = transformers.__version__
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def load_average() -> list[float] | None:
    """1, 5, 15-minute load averages: above the core count, other processes share the machine."""
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
