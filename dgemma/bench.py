"""Benchmark dgemma diffusion against the transformers reference and autoregressive decoding, in one run.

Same checkpoint, prompts and settings for every engine; plus the machine's matmul peak and a FLOP lower bound per
denoising step.

Fair work: every canvas runs exactly `--steps` denoising steps in both diffusion engines (confidence_threshold
1e-30, so the stable-and-confident early exit never fires) and EOS is ignored unless `--respect-eos`, so every
engine produces `--max-new-tokens` tokens. Each (engine, dtype, batch) runs in its own subprocess, so its peak
RSS is its own. A human table goes to stdout, then one JSON line; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dgemma.config import ModelConfig, TextConfig
from dgemma.errors import DgemmaError

ENGINES = ("dgemma", "reference", "autoregressive")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FIXED_STEPS_THRESHOLD = 1e-30  # mean token entropy never gets this low: no canvas stops before --steps
SCHEMA = "dgemma.bench/1"
TARGETS = {"dgemma_float32_vs_reference_float32": 5.0, "dgemma_bfloat16_vs_reference_float32": 10.0,
           "bound_ratio": 1.5, "extra_memory_bytes": 1.5e9, "batch4_vs_batch1": 2.5}


@dataclass
class Job:
    """One measured configuration; crosses the process boundary as JSON."""

    engine: str
    dtype: str
    batch: int
    model: str
    device: str
    prompt_len: int
    max_new_tokens: int
    steps: int
    repeats: int
    warmup: int
    seed: int
    sampling: str
    ignore_eos: bool
    threads: int | None = None

    @property
    def label(self) -> str:
        return f"{self.engine} {self.dtype} batch {self.batch}"


# ---- arguments --------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--device", default="cpu", help="torch device for every engine, e.g. cpu or cuda")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens (random ids, seeded)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate per prompt")
    p.add_argument("--ar-max-new-tokens", type=int, default=None,
                   help="tokens for the autoregressive engine (default: --max-new-tokens)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per canvas, exactly, in every engine")
    p.add_argument("--batch", default="1,4", help="dgemma batch sizes (concurrent prompts), comma-separated")
    p.add_argument("--dtype", default="float32,bfloat16", help="dgemma and autoregressive dtypes")
    p.add_argument("--reference-dtype", default="float32", help="reference dtypes (its default is float32)")
    p.add_argument("--reference-batch", default="1", help="reference batch sizes")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {','.join(ENGINES)}")
    p.add_argument("--sampling", choices=["fast", "reference"], default="fast", help="dgemma sampling path")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (medians reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs (1 step per canvas) first")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts and sampling")
    p.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: ignore it, fixed work)")
    p.add_argument("--in-process", action="store_true",
                   help="run every configuration in this process (faster; peak memory is then shared)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration before it is killed")
    p.add_argument("--matmul-size", type=int, default=None,
                   help="largest square matmul for the peak (default 2048 on CPU, 8192 on GPU)")


def _csv(text: str, kind: type = str) -> list:
    try:
        return [kind(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise DgemmaError(f"expected a comma-separated list of {kind.__name__}, got {text!r}") from None


# ---- entry point ------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from dgemma.weights.hf import read_config, resolve_checkpoint

    directory = _model_dir(args.model, resolve_checkpoint)
    cfg = read_config(directory)
    jobs = plan(args, str(directory))
    if args.threads:
        torch.set_num_threads(args.threads)
    _log(f"dgemma bench: {len(jobs)} configurations on {directory} ({args.device}, "
         f"{torch.get_num_threads()} threads); every canvas runs exactly {args.steps} steps")
    machine = measure_machine(args.device, args.matmul_size, _csv(args.dtype) + _csv(args.reference_dtype))
    runs = []
    for i, job in enumerate(jobs, 1):
        _log(f"[{i}/{len(jobs)}] {job.label}")
        out = run_job(job) if args.in_process else run_isolated(job, args.timeout)
        runs.append(add_bounds(out, job, cfg, machine))
    machine["load_average_end"] = _load_average()
    report = build_report(args, directory, cfg, machine, runs)
    print(format_table(report))
    print(json.dumps(report))
    return 0


def _model_dir(model: str | None, resolve: Callable[[str | Path], Path]) -> Path:
    if model is None:
        from dgemma.api import DEMO_MODEL

        if not (DEMO_MODEL / "config.json").is_file():
            raise DgemmaError("the bundled demo model is missing from this install; pass --model PATH")
        model = DEMO_MODEL
    return resolve(model)


def plan(args: argparse.Namespace, model: str) -> list[Job]:
    engines = _csv(args.engines)
    if bad := set(engines) - set(ENGINES):
        raise DgemmaError(f"unknown engine(s) {sorted(bad)}; choose from {', '.join(ENGINES)}")
    dtypes, ref_dtypes = _csv(args.dtype), _csv(args.reference_dtype)
    if bad := set(dtypes + ref_dtypes) - set(DTYPES):
        raise DgemmaError(f"unknown dtype(s) {sorted(bad)}; choose from {', '.join(DTYPES)}")
    batches, ref_batches = _csv(args.batch, int), _csv(args.reference_batch, int)
    for name in ("prompt_len", "max_new_tokens", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise DgemmaError(f"--{name.replace('_', '-')} must be at least 1")
    if min(batches + ref_batches, default=1) < 1:
        raise DgemmaError("batch sizes must be at least 1")
    common = dict(model=model, device=args.device, prompt_len=args.prompt_len, steps=args.steps,
                  repeats=args.repeats, warmup=args.warmup, seed=args.seed, sampling=args.sampling,
                  ignore_eos=not args.respect_eos, threads=args.threads)
    new, ar_new = args.max_new_tokens, args.ar_max_new_tokens or args.max_new_tokens
    jobs = []
    if "dgemma" in engines:
        jobs += [Job("dgemma", d, b, max_new_tokens=new, **common) for d in dtypes for b in batches]
    if "autoregressive" in engines:
        jobs += [Job("autoregressive", d, 1, max_new_tokens=ar_new, **common) for d in dtypes]
    if "reference" in engines:
        jobs += [Job("reference", d, b, max_new_tokens=new, **common) for d in ref_dtypes for b in ref_batches]
    return jobs


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- one configuration ------------------------------------------------------------------------------------------
def run_isolated(job: Job, timeout: float) -> dict[str, Any]:
    """Run `job` in a fresh interpreter (`python -m dgemma.bench --worker JSON`); its last stdout line is JSON."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "dgemma.bench", "--worker", json.dumps(asdict(job))]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**asdict(job), "error": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {**asdict(job), "error": f"worker exited with status {proc.returncode} and no result"}


def run_job(job: Job) -> dict[str, Any]:
    """Load, warm up, then time `job.repeats` runs; medians plus memory. Errors become an "error" field."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # libraries' prints must not break the JSON line
            return _measure(job)
    except Exception as e:  # noqa: BLE001 - one failing engine must not lose the other results
        _log(f"  {job.label}: failed: {type(e).__name__}: {e}")
        return {**asdict(job), "error": f"{type(e).__name__}: {e}"}
    finally:
        gc.collect()
        if job.device.startswith("cuda"):
            torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _measure(job: Job) -> dict[str, Any]:
    if job.threads:
        torch.set_num_threads(job.threads)
    cfg = _job_config(job)
    base_rss = _rss("VmRSS")
    t0 = time.perf_counter()
    runner, weights = RUNNERS[job.engine](job)
    load_seconds, loaded_rss = time.perf_counter() - t0, _rss("VmRSS")
    _log(f"  loaded in {load_seconds:.1f} s")
    for _ in range(job.warmup):
        runner(True)
    exact_peak = _reset_peak(job.device)
    samples = []
    for i in range(job.repeats):
        s = runner(False)
        samples.append(s)
        _log(f"  run {i + 1}/{job.repeats}: {s['seconds']:.2f} s, {s['tokens']} tokens, {s['steps']} steps")
    peak = _rss("VmHWM")
    memory = {"base_rss_bytes": base_rss, "loaded_rss_bytes": loaded_rss, "peak_rss_bytes": peak,
              "peak_is_generation_only": exact_peak, "weights_bytes": weights,
              "extra_memory_bytes": peak - weights if peak else None,
              "bcv_float32_bytes": job.batch * cfg.canvas_length * cfg.text.vocab_size * 4}
    if job.device.startswith("cuda"):
        memory["device_peak_bytes"] = torch.cuda.max_memory_allocated()
    return {**asdict(job), **_summarise(samples), **memory, "load_seconds": load_seconds,
            "threads": torch.get_num_threads()}


def _summarise(samples: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = statistics.median(s["seconds"] for s in samples)
    first = samples[0]
    ttfts = [s["ttft_seconds"] for s in samples if s["ttft_seconds"] is not None]
    return {
        "seconds": seconds, "seconds_all": [s["seconds"] for s in samples],
        "tokens": first["tokens"], "total_steps": first["steps"], "passes": first["passes"],
        "tokens_per_second": first["tokens"] / seconds if seconds > 0 else 0.0,
        "seconds_per_step": seconds / first["steps"] if first["steps"] else None,
        "steps_per_canvas": first["steps_per_canvas"],
        "tokens_per_forward": first["tokens"] / first["passes"] if first["passes"] else None,
        "ttft_seconds": statistics.median(ttfts) if ttfts else None,
    }


def make_prompts(batch: int, length: int, vocab: int, seed: int, banned: list[int]) -> list[list[int]]:
    """Random prompt ids in [3, vocab) without special or image ids; row i is the same for every batch size."""
    rows = []
    for i in range(batch):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        ids = torch.randint(3, vocab, (length,), generator=g)
        ids[torch.isin(ids, torch.tensor(banned))] = 3
        rows.append(ids.tolist())
    return rows


def _job_config(job: Job) -> ModelConfig:
    from dgemma.weights.hf import read_config

    return read_config(Path(job.model))


def _prompts_for(job: Job, cfg: ModelConfig) -> list[list[int]]:
    banned = [0, 1, 2, cfg.image_token_id, *cfg.text.eos_token_id]
    return make_prompts(job.batch, job.prompt_len, cfg.text.vocab_size, job.seed, banned)


# ---- engines: each returns (run(warmup) -> sample, weights bytes) ------------------------------------------------
def _dgemma_runner(job: Job):
    import dgemma

    model = dgemma.load(job.model, dtype=job.dtype, device=job.device)
    prompts = _prompts_for(job, model.model.cfg)
    ar = job.engine == "autoregressive"
    options: dict[str, Any] = {"seed": job.seed, "eos_token_ids": () if job.ignore_eos else None}
    if ar:
        options["mode"] = "autoregressive"
    else:
        options.update(sampling=job.sampling, confidence_threshold=FIXED_STEPS_THRESHOLD)

    def once(warmup: bool) -> dict[str, Any]:
        opts = dict(options, max_new_tokens=min(job.max_new_tokens, 4) if warmup and ar else job.max_new_tokens)
        if not ar:
            opts["max_denoising_steps"] = 1 if warmup else job.steps
        t0 = time.perf_counter()
        results = model.generate([list(p) for p in prompts], **opts)
        _sync(job.device)
        seconds = time.perf_counter() - t0
        passes = [r.stats["decoder_passes"] for r in results]
        ttfts = [r.stats.get("ttft_seconds") for r in results]
        return {"seconds": seconds, "tokens": sum(len(r.token_ids) for r in results),
                "passes": sum(passes), "steps": max(passes),
                "steps_per_canvas": list(results[0].stats.get("steps_per_canvas", [])),
                "ttft_seconds": max(ttfts) if None not in ttfts else None}

    return once, _tensor_bytes(model.model)


class _CanvasClock:
    """Reference streamer and decoder hook: times each committed canvas and counts decoder passes."""

    def __init__(self):
        self.times: list[float] = []
        self.marks: list[int] = []
        self.passes = 0

    def step(self, *_) -> None:
        self.passes += 1

    def put(self, value) -> None:  # first call: the prompt; then one call per committed canvas
        self.times.append(time.perf_counter())
        self.marks.append(self.passes)

    def end(self) -> None:
        pass


def _reference_runner(job: Job):
    import transformers
    from transformers import DiffusionGemmaForBlockDiffusion

    transformers.utils.logging.set_verbosity_error()
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(job.model, dtype=DTYPES[job.dtype]).to(job.device).eval()
    cfg = _job_config(job)
    ids = torch.tensor(_prompts_for(job, cfg), device=job.device)
    eos = set(ref.generation_config.eos_token_id or [])
    clock = _CanvasClock()
    getattr(ref.model, "decoder", ref.model).register_forward_pre_hook(clock.step)
    extra = {"eos_token_id": None} if job.ignore_eos else {}

    def once(warmup: bool) -> dict[str, Any]:
        clock.__init__()
        torch.manual_seed(job.seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = ref.generate(ids, max_new_tokens=job.max_new_tokens, max_denoising_steps=1 if warmup else job.steps,
                               confidence_threshold=FIXED_STEPS_THRESHOLD, pad_token_id=0, streamer=clock, **extra)
        _sync(job.device)
        seconds = time.perf_counter() - t0
        # Honest count: whole canvases come back; keep what was asked for, up to the first EOS.
        rows = out.sequences[:, ids.shape[1]:ids.shape[1] + job.max_new_tokens].tolist()
        tokens = sum(next((i for i, t in enumerate(r) if t in eos and not job.ignore_eos), len(r)) for r in rows)
        passes = clock.passes * ids.shape[0]
        if not job.ignore_eos:  # rows that finished early stop counting, as in the reference's own metric
            nonpad = (out.sequences[:, ids.shape[1]:] != 0).sum(-1).float().cpu()
            passes = int(torch.round(nonpad / out.tokens_per_forward.float().cpu()).nan_to_num(0).sum())
        return {"seconds": seconds, "tokens": tokens, "passes": passes, "steps": clock.passes,
                "steps_per_canvas": [b - a for a, b in zip(clock.marks, clock.marks[1:])],
                "ttft_seconds": clock.times[1] - t0 if len(clock.times) > 1 else None}

    return once, _tensor_bytes(ref)


RUNNERS = {"dgemma": _dgemma_runner, "autoregressive": _dgemma_runner, "reference": _reference_runner}


def _tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters and buffers, each storage counted once (tied weights)."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# ---- memory -----------------------------------------------------------------------------------------------------
def _rss(field: str) -> int | None:
    """VmRSS / VmHWM of this process in bytes (Linux); ru_maxrss as the fallback for the peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    if field == "VmHWM":
        import resource

        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return None


def _reset_peak(device: str) -> bool:
    """Restart the peak counters at the current usage, so the peak covers generation only (not loading)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ---- machine ----------------------------------------------------------------------------------------------------
def matmul_peak(dtype: torch.dtype, device: str = "cpu", max_size: int = 2048, budget: float = 1.5) -> dict:
    """GFLOP/s of square matmuls: sizes double from 256 until one takes `budget`/4 s or reaches `max_size`;
    the peak is the best run (the machine may be shared), the median is over runs at the largest size."""
    n, best, rates = 256, 0.0, []
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        rates, spent = [], 0.0
        while spent < budget and len(rates) < 20 or len(rates) < 2:
            _sync(device)
            t0 = time.perf_counter()
            a @ b
            _sync(device)
            dt = time.perf_counter() - t0
            spent += dt
            rates.append(2 * n**3 / dt / 1e9)
        best = max(best, *rates)
        if n * 2 > max_size or spent / len(rates) > budget / 4:
            return {"gflops": best, "gflops_median": statistics.median(rates), "size": n}
        n *= 2


def measure_machine(device: str, max_size: int | None, dtypes: list[str]) -> dict[str, Any]:
    size = max_size or (8192 if device.startswith("cuda") else 2048)
    peaks = {}
    for name in sorted(set(dtypes) | {"float32"}):
        _log(f"matmul peak {name} ...")
        peaks[name] = matmul_peak(DTYPES[name], device, size)
        _log(f"  {peaks[name]['gflops']:.1f} GFLOP/s (best), {peaks[name]['gflops_median']:.1f} median "
             f"at {peaks[name]['size']}")
    info = {"device": device, "cpu": _cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "matmul": peaks,
            "load_average_start": _load_average()}
    with contextlib.suppress(ImportError):
        import transformers

        info["transformers"] = transformers.__version__
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _load_average() -> list[float] | None:
    """1, 5, 15-minute load averages: above the core count, other processes share the machine."""
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# ---- FLOP lower bound -------------------------------------------------------------------------------------------
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


def diffusion_flops(cfg: ModelConfig, prompt_len: int, max_new: int, steps: int) -> dict[str, float]:
    """Per prompt: prefill, then per canvas `steps` decoder passes (LM head each; self-conditioning soft embedding
    C x V x H and its MLP from the second step on), and an encoder commit of every canvas but the last."""
    t, c = cfg.text, cfg.canvas_length
    head = 2 * c * t.hidden_size * t.vocab_size
    self_cond = 2 * c * t.vocab_size * t.hidden_size + 6 * c * t.hidden_size * t.intermediate_size
    canvases = math.ceil(max_new / c)
    total = body_flops(t, prompt_len, 0, causal=True)
    for k in range(canvases):
        context = prompt_len + k * c
        total += steps * (body_flops(t, c, context, causal=False) + head) + (steps - 1) * self_cond
        if k < canvases - 1:
            total += body_flops(t, c, context, causal=True)
    step = body_flops(t, c, prompt_len, causal=False) + head + self_cond
    return {"total": total, "steps": canvases * steps, "decoder_step": step, "lm_head": head,
            "self_conditioning": self_cond}


def autoregressive_flops(cfg: ModelConfig, prompt_len: int, max_new: int) -> dict[str, float]:
    """Per prompt: prefill, then one LM head per token and an encoder pass for every token but the last."""
    t = cfg.text
    head = 2 * t.hidden_size * t.vocab_size
    total = body_flops(t, prompt_len, 0, causal=True) + max_new * head
    total += sum(body_flops(t, 1, prompt_len + j, causal=True) for j in range(max_new - 1))
    return {"total": total, "steps": max_new, "decoder_step": head + body_flops(t, 1, prompt_len, causal=True)}


def add_bounds(run: dict[str, Any], job: Job, cfg: ModelConfig, machine: dict[str, Any]) -> dict[str, Any]:
    """Lower bound per step = the run's matmul FLOPs / steps / peak. A bfloat16 run is held to the better of the
    bfloat16 and float32 peaks (an engine may compute bfloat16 weights in float32)."""
    if job.engine == "autoregressive":
        flops = autoregressive_flops(cfg, job.prompt_len, job.max_new_tokens)
    else:
        flops = diffusion_flops(cfg, job.prompt_len, job.max_new_tokens, job.steps)
    peaks = machine["matmul"]
    peak = max(peaks[job.dtype]["gflops"], peaks["float32"]["gflops"]) * 1e9
    bound = flops["total"] * job.batch / flops["steps"] / peak
    run = {**run, "flops_per_prompt": flops["total"], "decoder_step_flops": flops["decoder_step"] * job.batch,
           "peak_gflops_used": peak / 1e9, "flop_bound_seconds_per_step": bound}
    if run.get("seconds_per_step"):
        run["bound_ratio"] = run["seconds_per_step"] / bound
    return run


# ---- report -----------------------------------------------------------------------------------------------------
def build_report(args, directory: Path, cfg: ModelConfig, machine: dict, runs: list[dict]) -> dict[str, Any]:
    t = cfg.text
    model = {"path": str(directory), "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
             "layers": t.num_hidden_layers, "experts": t.num_experts, "top_k_experts": t.top_k_experts,
             "canvas_length": cfg.canvas_length,
             "checkpoint_bytes": sum(f.stat().st_size for f in directory.glob("*.safetensors"))}
    settings = {"prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
                "ar_max_new_tokens": args.ar_max_new_tokens or args.max_new_tokens, "steps": args.steps,
                "fixed_steps": f"confidence_threshold={FIXED_STEPS_THRESHOLD}: every canvas runs exactly "
                               f"{args.steps} steps in both diffusion engines",
                "ignore_eos": not args.respect_eos, "sampling": args.sampling, "repeats": args.repeats,
                "warmup": args.warmup, "seed": args.seed, "in_process": args.in_process, "device": args.device,
                "statistic": "median over repeats"}
    ratios = compute_ratios(runs)
    return {"schema": SCHEMA, "model": model, "settings": settings, "machine": machine, "runs": runs,
            "ratios": ratios, "targets": check_targets(runs, ratios)}


def _find(runs: list[dict], engine: str, dtype: str, batch: int = 1) -> dict | None:
    return next((r for r in runs if (r["engine"], r["dtype"], r["batch"]) == (engine, dtype, batch)), None)


def compute_ratios(runs: list[dict]) -> dict[str, float]:
    """tokens/s ratios at batch 1 between dgemma and the other engines, and aggregate tokens/s at batch B over
    batch 1 for dgemma."""
    ok = [r for r in runs if r.get("tokens_per_second")]
    out = {}
    for a in (r for r in ok if r["engine"] == "dgemma"):
        if a["batch"] == 1:
            for b in (r for r in ok if r["engine"] != "dgemma" and r["batch"] == 1):
                out[f"dgemma_{a['dtype']}_vs_{b['engine']}_{b['dtype']}"] = _speedup(a, b)
        elif (one := _find(ok, "dgemma", a["dtype"])) is not None:
            out[f"batch{a['batch']}_vs_batch1_dgemma_{a['dtype']}"] = _speedup(a, one)
    return out


def _speedup(a: dict, b: dict) -> float:
    return a["tokens_per_second"] / b["tokens_per_second"]


def check_targets(runs: list[dict], ratios: dict[str, float]) -> dict[str, dict]:
    """Issue 6's targets, reported (never asserted): value, target, met."""
    out = {}
    for key in ("dgemma_float32_vs_reference_float32", "dgemma_bfloat16_vs_reference_float32"):
        if key in ratios:
            out[key] = _target(ratios[key], TARGETS[key], higher=True)
    for r in runs:
        if r["engine"] != "dgemma" or r.get("error"):
            continue
        name = f"dgemma_{r['dtype']}_batch{r['batch']}"
        if r.get("bound_ratio"):
            out[f"{name}_bound_ratio"] = _target(r["bound_ratio"], TARGETS["bound_ratio"], higher=False)
        if r["batch"] == 1 and r.get("extra_memory_bytes") is not None:
            out[f"{name}_extra_memory_bytes"] = _target(r["extra_memory_bytes"], TARGETS["extra_memory_bytes"],
                                                        higher=False)
    for key, value in ratios.items():
        if key.startswith("batch4_vs_batch1"):
            out[key] = _target(value, TARGETS["batch4_vs_batch1"], higher=True)
    return out


def _target(value: float, target: float, higher: bool) -> dict:
    return {"value": value, "target": target, "met": value >= target if higher else value <= target}


def format_table(report: dict[str, Any]) -> str:
    s, m = report["settings"], report["model"]
    lines = [f"model {m['path']}: vocab {m['vocab_size']}, hidden {m['hidden_size']}, {m['layers']} layers, "
             f"canvas {m['canvas_length']}; prompt {s['prompt_len']}, {s['max_new_tokens']} new tokens, "
             f"{s['steps']} steps per canvas (fixed), EOS {'ignored' if s['ignore_eos'] else 'respected'}, "
             f"median of {s['repeats']}",
             "matmul peak: " + ", ".join(f"{k} {v['gflops']:.1f} GFLOP/s" for k, v in
                                         report["machine"]["matmul"].items())
             + f" ({report['machine']['threads']} threads; load average {report['machine']['load_average_start']} "
             f"at start, {report['machine'].get('load_average_end')} at end, {report['machine']['cores']} cores)", ""]
    head = ("engine", "dtype", "batch", "tok/s", "s/step", "steps/canvas", "tok/fwd", "TTFT s", "peak MB",
            "weights MB", "bound s/step", "x bound")  # peak MB: process RSS (on CUDA: device memory)
    rows = [head] + [_row(r) for r in report["runs"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines += ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines += [f"  {r['engine']} {r['dtype']} batch {r['batch']}: {r['error']}"
              for r in report["runs"] if r.get("error")]
    lines += ["", "ratios (tokens/s):"] + [f"  {k}: {v:.2f}x" for k, v in report["ratios"].items()]
    return "\n".join(lines)


def _row(r: dict[str, Any]) -> tuple[str, ...]:
    if r.get("error"):
        return (r["engine"], r["dtype"], str(r["batch"]), "error", *["-"] * 8)
    spc = r["steps_per_canvas"]
    return (r["engine"], r["dtype"], str(r["batch"]), f"{r['tokens_per_second']:.2f}", _num(r["seconds_per_step"]),
            (f"{statistics.mean(spc):g}" if spc else "-"), _num(r["tokens_per_forward"], 1),
            _num(r["ttft_seconds"], 2), _mb(r.get("device_peak_bytes", r["peak_rss_bytes"])), _mb(r["weights_bytes"]),
            _num(r["flop_bound_seconds_per_step"]), _num(r.get("bound_ratio"), 2))


def _num(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if x >= 0.01 or digits < 3 else f"{x:.2e}"


def _mb(x: int | None) -> str:
    return "-" if x is None else f"{x / 1e6:.0f}"


# ---- worker -----------------------------------------------------------------------------------------------------
def _worker_main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m dgemma.bench --worker JOB_JSON (internal; use `dgemma bench`)", file=sys.stderr)
        return 2
    print(json.dumps(run_job(Job(**json.loads(argv[1])))))
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
