"""Runners: time one Job (dgemma diffusion, autoregressive decoding, or the `transformers` reference) after a
warm-up, in a fresh interpreter so that its peak memory is its own. A trial is `once(warmup) -> sample`."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dgemma.bench.job import FIXED_STEPS_THRESHOLD, Job, log, sync
from dgemma.dtypes import parse_dtype

SETTINGS = ("max_denoising_steps", "confidence_threshold", "entropy_bound", "t_min", "t_max", "stability_threshold")


# ---- process isolation ------------------------------------------------------------------------------------------
def run_isolated(job: Job, timeout: float) -> dict[str, Any]:
    """Run `job` in a fresh interpreter (`python -m dgemma.bench --worker JSON`); its last stdout line is JSON."""
    root = str(Path(__file__).resolve().parents[2])
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


def worker_main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m dgemma.bench --worker JOB_JSON (internal; use `dgemma bench`)", file=sys.stderr)
        return 2
    print(json.dumps(run_job(Job(**json.loads(argv[1])))))
    return 0


def run_job(job: Job) -> dict[str, Any]:
    """Load, warm up, then time `job.repeats` runs; medians plus memory. Errors become an "error" field."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # libraries' prints must not break the JSON line
            return _measure(job)
    except Exception as e:  # noqa: BLE001 - one failing engine must not lose the other results
        log(f"  {job.label}: failed: {type(e).__name__}: {e}")
        return {**asdict(job), "error": f"{type(e).__name__}: {e}"}
    finally:
        gc.collect()
        if job.device.startswith("cuda"):
            torch.cuda.empty_cache()


def _measure(job: Job) -> dict[str, Any]:
    if job.threads:
        torch.set_num_threads(job.threads)
    base_rss = rss("VmRSS")
    t0 = time.perf_counter()
    trial, weights, settings = TRIALS[job.engine](job)
    load_seconds, loaded_rss = time.perf_counter() - t0, rss("VmRSS")
    log(f"  loaded in {load_seconds:.1f} s")
    for _ in range(job.warmup):
        trial(True)
    exact_peak = _reset_peak(job.device)
    samples = []
    for i in range(job.repeats):
        samples.append(s := trial(False))
        log(f"  run {i + 1}/{job.repeats}: {s['seconds']:.2f} s, {sum(s['tokens'])} tokens, {s['steps']} steps")
    peak = rss("VmHWM")
    memory = {"base_rss_bytes": base_rss, "loaded_rss_bytes": loaded_rss, "peak_rss_bytes": peak,
              "peak_is_generation_only": exact_peak, "weights_bytes": weights,
              "extra_memory_bytes": peak - weights if peak else None}
    if job.device.startswith("cuda"):
        memory["device_peak_bytes"] = torch.cuda.max_memory_allocated()
    return {**asdict(job), "settings": settings, "samples": samples, **memory, "load_seconds": load_seconds,
            "threads": torch.get_num_threads()}


def pool(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's results from several rounds -> one run: samples pooled, then summarised; the largest
    peak memory. The first error wins."""
    if failed := [o for o in outs if o.get("error")]:
        return failed[0]
    samples = [s for o in outs for s in o["samples"]]
    peak = max(o["peak_rss_bytes"] or 0 for o in outs) or None
    last = {k: v for k, v in outs[-1].items() if k != "samples"}
    return {**last, **summarise(samples), "rounds": len(outs), "peak_rss_bytes": peak,
            "extra_memory_bytes": peak - last["weights_bytes"] if peak else None}


def summarise(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Median seconds over the samples; token and step counts from the first (every repeat is seeded alike)."""
    seconds = statistics.median(s["seconds"] for s in samples)
    first = samples[0]
    tokens, passes = sum(first["tokens"]), sum(first["passes"])
    ttfts = [s["ttft_seconds"] for s in samples if s["ttft_seconds"] is not None]
    return {
        "seconds": seconds, "seconds_all": [s["seconds"] for s in samples],
        "tokens": tokens, "row_tokens": first["tokens"], "total_steps": first["steps"], "passes": passes,
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "seconds_per_step": seconds / first["steps"] if first["steps"] else None,
        "steps_per_canvas": first["steps_per_canvas"], "cycles": first.get("cycles"),
        "tokens_per_forward": tokens / passes if passes else None,
        "ttft_seconds": statistics.median(ttfts) if ttfts else None,
        **_pass_figures(first.get("engine"), seconds),
    }


def _pass_figures(engine: dict[str, Any] | None, seconds: float) -> dict[str, Any]:
    """Steps per row (decoder passes each row rode in, summed over rows: the rows of all passes), rows per
    decoder pass, rows already done carried in a pass, and the seconds spent on them (the run's time times
    their share of the rows); None for engines without pass counts."""
    if engine is None:
        return {"rows_per_pass": None, "done_rows": None, "done_row_seconds": None}
    share = engine["done_rows"] / engine["rows"] if engine["rows"] else 0.0
    return {"rows_per_pass": engine["rows_per_pass"], "done_rows": engine["done_rows"],
            "done_row_seconds": seconds * share}


# ---- prompts and settings ---------------------------------------------------------------------------------------
def make_prompts(batch: int, length: int, vocab: int, seed: int, banned: list[int]) -> list[list[int]]:
    """Random prompt ids in [3, vocab) without special or image ids; row i is the same for every batch size."""
    rows = []
    for i in range(batch):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        ids = torch.randint(3, vocab, (length,), generator=g)
        ids[torch.isin(ids, torch.tensor(banned))] = 3
        rows.append(ids.tolist())
    return rows


def _prompts_for(job: Job, cfg) -> list[list[int]]:
    banned = [0, 1, 2, cfg.image_token_id, *cfg.text.eos_token_id]
    return make_prompts(job.batch, job.prompt_len, cfg.text.vocab_size, job.seed, banned)


def describe_settings(job: Job, params) -> dict[str, Any]:
    """The generation settings a run used (`params`: the resolved SamplingParams) and where they came from."""
    out: dict[str, Any] = {"mode": "diffusion" if job.diffusion else job.engine,
                           "eos": "ignored" if job.ignore_eos else "respected"}
    if not job.diffusion:
        return {**out, "temperature": params.ar_temperature}
    source = "checkpoint defaults (adaptive)" if job.steps is None else f"--steps {job.steps} (fixed)"
    sampling = "transformers" if job.engine == "reference" else job.sampling
    return {**out, "steps": source, "sampling": sampling, **{k: getattr(params, k) for k in SETTINGS}}


def checkpoint_params(job: Job):
    """The checkpoint's generation defaults with this job's overrides: what `generate` will run with."""
    from dgemma.sampling import SamplingParams
    from dgemma.tokenizer import read_json

    gen = read_json(Path(job.model) / "generation_config.json")
    return SamplingParams.from_generation_config(gen).replace(**job.overrides())


# ---- engines: each returns (once(warmup) -> sample, weights bytes, settings) ------------------------------------
def _dgemma_trial(job: Job):
    import dgemma

    return generate_trial(job, dgemma.load(job.model, dtype=job.dtype, device=job.device, quantize=job.quantize))


def generate_trial(job: Job, model):
    """`model.generate` as `job` asks, on a model already loaded (benchmarks/anchor.py shares one between modes)."""
    prompts = _prompts_for(job, model.module.cfg)
    options = job.overrides() | job.decoding()
    warm = {"max_denoising_steps": 1} if job.diffusion else {"max_new_tokens": min(job.max_new_tokens, 4)}

    engines = _engines_of(model)

    def once(warmup: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        results = model.generate([list(p) for p in prompts], **(options | warm if warmup else options))
        sync(job.device)
        seconds = time.perf_counter() - t0
        passes = [r.stats["decoder_passes"] for r in results]
        ttfts = [r.stats.get("ttft_seconds") for r in results]
        stats = getattr(engines[-1], "stats", None)
        return {"seconds": seconds, "tokens": [len(r.token_ids) for r in results], "passes": passes,
                "steps": max(passes), "steps_per_canvas": [list(r.stats.get("steps_per_canvas", [])) for r in results],
                "cycles": [r.stats.get("cycles", []) for r in results],
                "ttft_seconds": max(ttfts) if None not in ttfts else None,
                "engine": stats.to_dict() if stats is not None else None}

    return once, tensor_bytes(model.module), describe_settings(job, model.defaults.replace(**job.overrides()))


def _engines_of(model) -> list:
    """The engines `model.generate` makes from now on (the last one's EngineStats: passes, rows, done rows)."""
    made, make = [], model.runner

    def runner(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    model.runner = runner
    return made


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


def _reference_trial(job: Job):
    import transformers
    from transformers import DiffusionGemmaForBlockDiffusion

    from dgemma.weights.hf import read_config

    transformers.utils.logging.set_verbosity_error()
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(job.model, dtype=parse_dtype(job.dtype))
    ref = ref.to(job.device).eval()
    ids = torch.tensor(_prompts_for(job, read_config(Path(job.model))), device=job.device)
    clock = _CanvasClock()
    getattr(ref.model, "decoder", ref.model).register_forward_pre_hook(clock.step)
    options = {"max_new_tokens": job.max_new_tokens, "pad_token_id": 0, "streamer": clock}
    if job.ignore_eos:
        options["eos_token_id"] = None
    if job.steps is not None:
        options.update(max_denoising_steps=job.steps, confidence_threshold=FIXED_STEPS_THRESHOLD)

    def once(warmup: bool) -> dict[str, Any]:
        clock.__init__()
        torch.manual_seed(job.seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = ref.generate(ids, **(options | {"max_denoising_steps": 1} if warmup else options))
        sync(job.device)
        return {"seconds": time.perf_counter() - t0, **_reference_counts(job, ref, ids, out, clock),
                "ttft_seconds": clock.times[1] - t0 if len(clock.times) > 1 else None}

    return once, tensor_bytes(ref), describe_settings(job, checkpoint_params(job))


def _reference_counts(job: Job, ref, ids: torch.Tensor, out, clock: _CanvasClock) -> dict[str, Any]:
    """Tokens and decoder passes per row. Whole canvases come back: keep what was asked for, up to the first EOS."""
    eos = set(ref.generation_config.eos_token_id or [])
    n = ids.shape[1]
    rows = out.sequences[:, n:n + job.max_new_tokens].tolist()
    tokens = [next((i for i, t in enumerate(r) if t in eos and not job.ignore_eos), len(r)) for r in rows]
    passes = [clock.passes] * len(rows)
    if not job.ignore_eos:  # rows that finished early stop counting, as in the reference's own metric
        nonpad = (out.sequences[:, n:] != 0).sum(-1).float().cpu()
        passes = torch.round(nonpad / out.tokens_per_forward.float().cpu()).nan_to_num(0).int().tolist()
    spc = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    return {"tokens": tokens, "passes": passes, "steps": clock.passes, "steps_per_canvas": [spc] * len(rows)}


TRIALS = {"dgemma": _dgemma_trial, "autoregressive": _dgemma_trial, "speculative": _dgemma_trial,
           "reference": _reference_trial}


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters and buffers, each storage counted once (tied weights)."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# ---- memory -----------------------------------------------------------------------------------------------------
def rss(field: str) -> int | None:
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
