"""Load benchmark for `dgemma serve`: fixed concurrency levels on loopback, bounded in time and count.

Starts the server as a subprocess on 127.0.0.1 (or measures a running one with --url), then for each level C runs
C closed-loop clients that send streaming completions back to back until --duration seconds or --max-requests
have passed. Measured client-side: requests/s, output tokens/s (from the usage chunk), time to first token (the
first content chunk), inter-chunk latency, end-to-end latency (median and p99), and failures, which must be zero.
One streamed content chunk is one committed canvas (up to canvas_length tokens), not one token.

    python benchmarks/load.py --model DIR [--concurrency 1,4,16] [--duration 15] [--max-tokens 64]
    python benchmarks/load.py --tiny                      # a tiny random checkpoint (needs transformers)
    python benchmarks/load.py --url http://127.0.0.1:8000 [--api-key KEY]

Last stdout line: JSON {"levels": [...], "failures": N, ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello there, how are you today?", "Write one sentence about the sea.", "What is block diffusion?",
           "List three colours.", "Once upon a time", "The capital of France is"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", help="checkpoint directory to serve (default: the bundled demo model)")
    where.add_argument("--tiny", action="store_true", help="serve a tiny random checkpoint built in a temp dir")
    where.add_argument("--url", help="measure a server that is already running")
    p.add_argument("--api-key", default=None, help="bearer key for --url")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels (default 1,4,16)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds per level (default 15)")
    p.add_argument("--max-requests", type=int, default=200, help="requests per level at most (default 200)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take (default 120)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the started server")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels) < 1 or args.duration <= 0 or args.max_requests < 1:
        p.error("levels, --duration and --max-requests must be positive")

    with tempfile.TemporaryDirectory() as tmp:
        server = None
        url, key = args.url, args.api_key
        if url is None:
            model = args.model or (_tiny(Path(tmp)) if args.tiny else None)
            server, url = _start(model, args.device, args.threads, max(levels))
        try:
            report = asyncio.run(_run_levels(url.rstrip("/"), key, levels, args))
        finally:
            if server is not None:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=60)
    report.update(url=url if args.url else "started on 127.0.0.1", max_tokens=args.max_tokens,
                  duration_per_level=args.duration, chunk="one committed canvas")
    for lv in report["levels"]:
        print(f"c={lv['concurrency']:>3}  {lv['requests']:>4} req  {lv['requests_per_s']:7.2f} req/s  "
              f"{lv['output_tokens_per_s']:8.1f} tok/s  ttft p50 {lv['ttft_s']['p50']:.3f} p99 "
              f"{lv['ttft_s']['p99']:.3f}  e2e p50 {lv['e2e_s']['p50']:.3f} p99 {lv['e2e_s']['p99']:.3f}  "
              f"failures {lv['failures']}")
    print(json.dumps(report))
    return 0 if report["failures"] == 0 else 1


async def _run_levels(url: str, key: str | None, levels: list[int], args) -> dict:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await _one(client, model, 0, args.max_tokens)  # warm-up, not counted
        out = [await _level(client, model, c, args) for c in levels]
    return {"levels": out, "failures": sum(lv["failures"] for lv in out), "model": model}


async def _level(client: httpx.AsyncClient, model: str, concurrency: int, args) -> dict:
    results: list[dict] = []
    deadline = time.perf_counter() + args.duration
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while time.perf_counter() < deadline and issued < args.max_requests:
            issued += 1
            results.append(await _one(client, model, issued, args.max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    gaps = [g for r in ok for g in r["gaps"]]
    return {
        "concurrency": concurrency, "requests": len(results), "failures": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5], "seconds": round(wall, 3),
        "requests_per_s": len(ok) / wall, "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_s": _summary([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_s": _summary(gaps), "e2e_s": _summary([r["e2e"] for r in ok]),
    }


async def _one(client: httpx.AsyncClient, model: str, i: int, max_tokens: int) -> dict:
    """One streamed completion: times of the content chunks, tokens from the usage chunk, ok or why not."""
    body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "seed": i,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, tokens, done, error = [], 0, False, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _failed(f"HTTP {r.status_code}: {r.text[:120]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"].get("message", "error chunk")
                elif chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif any(c.get("text") for c in chunk["choices"]):
                    times.append(time.perf_counter())
    except httpx.HTTPError as e:
        return _failed(f"{type(e).__name__}: {e}")
    if error or not done:
        return _failed(error or "stream ended without [DONE]")
    end = time.perf_counter()
    return {"ok": True, "tokens": tokens, "e2e": end - t0, "ttft": times[0] - t0 if times else None,
            "gaps": [b - a for a, b in zip(times, times[1:])], "error": None}


def _failed(error: str) -> dict:
    return {"ok": False, "error": error, "tokens": 0, "e2e": 0.0, "ttft": None, "gaps": []}


def _summary(values: list[float]) -> dict:
    xs = sorted(values)
    return {"p50": _percentile(xs, 50), "p99": _percentile(xs, 99), "mean": sum(xs) / len(xs) if xs else 0.0,
            "n": len(xs)}


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _start(model: str | None, device: str, threads: int | None, concurrency: int,
           extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`dgemma serve` on a free loopback port, ready to serve; the caller stops it with SIGTERM. `extra`: more
    `dgemma serve` flags (later ones win)."""
    cmd = [sys.executable, "-m", "dgemma.server.command", "--port", "0", "--device", device, "--no-access-log",
           "--max-concurrency", str(concurrency), "--max-queue", str(concurrency), *extra]
    cmd += ["--model", model] if model else []
    cmd += ["--threads", str(threads)] if threads else []
    env = os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    found: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            if m := re.search(r"serving .* on (http://\S+)", line):
                found.append(m.group(1))
            if "error" in line.lower():
                sys.stderr.write(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if found:
            try:
                if httpx.get(found[0] + "/health", timeout=2).status_code == 200:
                    return proc, found[0]
            except httpx.TransportError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the server did not become ready (exit code {proc.poll()})")


def _tiny(directory: Path) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from server_fixtures import build_served_checkpoint

    return str(build_served_checkpoint(directory / "tiny", max_new_tokens=64))


if __name__ == "__main__":
    sys.exit(main())
