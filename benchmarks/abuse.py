"""Abuse and soak benchmark for `dgemma serve`, on loopback, bounded in time: does one client stall the others?

Scenarios (each starts its own server subprocess, the tiny random checkpoint by default):
  huge       8 clients send 4 MB prompts in a loop; a well-behaved stream's gap between chunks (drafts on, so a
             chunk per denoising step) against its unloaded gap, and /health latency (target: gap < 2x, health
             within 100 ms)
  slowloris  200 connections trickle a request header, a byte a second; all must be dropped after
             --header-timeout, and well-behaved requests' p95 latency stays within 1.5x of unloaded
  soak       normal, streaming, disconnecting, oversized and malformed clients for --soak-seconds: no 5xx, RSS
             growth under 5%, every slot free at the end, /metrics finish counts equal to the clients' tallies
  cost       what one request's preparation costs (server started with --max-tokens 64, so prepared requests
             end in a 400 after their preparation): the 8,000-hole template (target: refused in < 50 ms, RSS
             growth < 20 MB), a 40k-word edit by fraction and by 2,000 spans (target: < 0.5 s), and /health
             while 4 clients repeat those and deep-JSON bodies (target: p95 < 100 ms)
  fuzz       --fuzz-seconds of random hostile bodies on every route, 2 clients: the count of 5xx (target: 0)

    python benchmarks/abuse.py [--scenarios huge,slowloris,soak,cost,fuzz] [--phase-seconds 20] [--soak-seconds 600]
    python benchmarks/abuse.py --model DIR ...

Last stdout line: JSON with one object per scenario and "ok" (all targets met).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import _percentile, _start, _tiny  # noqa: E402  (the load benchmark's server helpers)

C = "/v1/completions"
HEADER_TIMEOUT = 5.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint to serve (default: a tiny random checkpoint built in a temp dir)")
    p.add_argument("--scenarios", default="huge,slowloris,soak,cost,fuzz")
    p.add_argument("--phase-seconds", type=float, default=40.0, help="seconds measured quiet, and again loaded (default 40)")
    p.add_argument("--rounds", type=int, default=4, help="quiet / flooded phase pairs of huge (default 4)")
    p.add_argument("--slowloris-seconds", type=float, default=60.0, help="slowloris duration (default 60)")
    p.add_argument("--soak-seconds", type=float, default=600.0, help="soak duration (default 600)")
    p.add_argument("--fuzz-seconds", type=float, default=600.0, help="fuzz duration (default 600)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (default 1)")
    args = p.parse_args(argv)
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _tiny(Path(tmp))
        for name in args.scenarios.split(","):
            server, url = _start(model, "cpu", args.threads, 8, ["--header-timeout", str(HEADER_TIMEOUT),
                                                                 "--max-queue", "64", *EXTRA.get(name, [])])
            try:
                report[name] = SCENARIOS[name](url, args, server.pid)
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=60)
            print(name, json.dumps(report[name]), file=sys.stderr)
    report["ok"] = all(r["ok"] for r in report.values())
    print(json.dumps(report))
    return 0 if report["ok"] else 1


# ---- well-behaved probes ----------------------------------------------------------------------------------------
def _stream_gaps(url: str, stop: threading.Event) -> list[float]:
    """Back-to-back streamed completions with drafts; the gaps between consecutive chunks of each."""
    gaps = []
    while not stop.is_set():
        body = {"prompt": "Hello there", "max_tokens": 32, "stream": True, "dgemma_drafts": True, "seed": 1}
        with httpx.stream("POST", url + C, json=body, timeout=60) as r:
            last = None
            for line in r.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: ") and last is not None:
                    gaps.append(now - last)
                last = now if line.startswith("data: ") else last
    return gaps


def _health_latency(url: str, stop: threading.Event) -> list[float]:
    out = []
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get(url + "/health")
            out.append(time.perf_counter() - t0)
            time.sleep(0.05)
    return out


def _request_latency(url: str, stop: threading.Event) -> list[float]:
    out = []
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.post(url + C, json={"prompt": "Hi", "max_tokens": 8, "seed": 2})
            out.append(time.perf_counter() - t0)
    return out


def _measure(seconds: float, probes: dict, load: list | None = None) -> dict[str, list]:
    """Run `probes` (name -> fn(url-less closure)) and `load` threads for `seconds`; the probes' results."""
    stop = threading.Event()
    results: dict[str, list] = {}
    threads = [threading.Thread(target=lambda n=n, f=f: results.__setitem__(n, f(stop))) for n, f in probes.items()]
    threads += [threading.Thread(target=f, args=(stop,)) for f in load or []]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(120)
    return results


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50": round(_percentile(xs, 50), 4), "p95": round(_percentile(xs, 95), 4),
            "max": round(xs[-1], 4) if xs else 0.0, "n": len(xs)}


# ---- scenarios ----------------------------------------------------------------------------------------------------
def huge(url: str, args, pid: int) -> dict:
    """Quiet and flooded phases alternate (--rounds pairs), so that other load on the machine hits both alike."""
    probes = {"gaps": lambda s: _stream_gaps(url, s), "health": lambda s: _health_latency(url, s)}
    quiet: dict[str, list] = {"gaps": [], "health": []}
    loaded: dict[str, list] = {"gaps": [], "health": []}
    statuses: Counter = Counter()
    seconds = args.phase_seconds / args.rounds
    with multiprocessing.get_context("spawn").Pool(8) as pool:  # own processes: the probes keep this one's GIL
        for _ in range(args.rounds):
            for name, values in _measure(seconds, probes).items():
                quiet[name] += values
            flood = pool.map_async(_flood, [(url, time.monotonic() + seconds)] * 8)
            for name, values in _measure(seconds, probes).items():
                loaded[name] += values
            statuses += sum((Counter(c) for c in flood.get(120)), Counter())
    # p95, not the median: a stalled loop delivers the chunks it held back in a burst of near-zero gaps
    gap_ratio = _percentile(sorted(loaded["gaps"]), 95) / max(_percentile(sorted(quiet["gaps"]), 95), 1e-9)
    health_max = max(loaded["health"])
    return {"unloaded": {k: _stats(v) for k, v in quiet.items()}, "loaded": {k: _stats(v) for k, v in loaded.items()},
            "huge_prompt_statuses": dict(statuses), "gap_ratio_p95": round(gap_ratio, 3),
            "ok": gap_ratio < 2 and health_max < 0.1 and set(statuses) == {400}}


def _flood(job: tuple[str, float]) -> dict[int, int]:
    url, until = job
    body = json.dumps({"prompt": "a" * 4_000_000}).encode()
    statuses: Counter = Counter()
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < until:
            r = client.post(url + C, content=body, headers={"content-type": "application/json"})
            statuses[r.status_code] += 1
    return dict(statuses)


def slowloris(url: str, args, pid: int) -> dict:
    quiet = _measure(args.phase_seconds, {"latency": lambda s: _request_latency(url, s)})
    port = int(url.rsplit(":", 1)[1])
    dropped: list[float] = []

    def trickle(stop: threading.Event) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            t0 = time.monotonic()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
            sock.settimeout(1.0)
            while not stop.is_set():
                try:
                    sock.sendall(b"X")
                    sock.recv(4096)  # the server's 408, or b"" when it closed: either way, dropped
                    dropped.append(time.monotonic() - t0)
                    return
                except TimeoutError:
                    continue
                except OSError:
                    dropped.append(time.monotonic() - t0)
                    return

    loaded = _measure(args.slowloris_seconds, {"latency": lambda s: _request_latency(url, s)}, [trickle] * 200)
    ratio = _percentile(sorted(loaded["latency"]), 95) / max(_percentile(sorted(quiet["latency"]), 95), 1e-9)
    return {"unloaded": _stats(quiet["latency"]), "loaded": _stats(loaded["latency"]), "p95_ratio": round(ratio, 3),
            "connections": 200, "dropped": len(dropped), "dropped_after_s": _stats(dropped),
            "ok": len(dropped) == 200 and max(dropped) < HEADER_TIMEOUT + 3 and ratio < 1.5}


def soak(url: str, args, pid: int) -> dict:
    tally: Counter = Counter()
    _request_latency_once(url)
    rss0 = _rss(pid)
    before = _finished(httpx.get(url + "/metrics").text)
    kinds = [_normal, _streaming, _disconnecting, _oversized, _malformed]
    loaders = [lambda s, k=k: _loop(k, url, s, tally) for k in kinds for _ in range(2)]
    _measure(args.soak_seconds, {}, loaders)
    time.sleep(1)
    metrics = httpx.get(url + "/metrics").text
    finished = {r: n - before[r] for r, n in _finished(metrics).items()}
    running = _metric(metrics, "dgemma_requests_running") + _metric(metrics, "dgemma_requests_waiting")
    growth = _rss(pid) / rss0 - 1
    served = tally["normal 200"] + tally["streaming 200"]
    fivexx = sum(n for k, n in tally.items() if k.split()[-1].startswith("5"))
    return {"tally": dict(tally), "finished_metrics": finished, "rss_growth": round(growth, 4),
            "slots_in_use_at_end": running, "ok": fivexx == 0 and growth < 0.05 and running == 0
            and finished["stop"] + finished["length"] == served and finished["abort"] == tally["disconnecting"]}


def _loop(kind, url: str, stop: threading.Event, tally: Counter) -> None:
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            tally[kind(client, url)] += 1


def _normal(client: httpx.Client, url: str) -> str:
    return f"normal {client.post(url + C, json={'prompt': 'Hello', 'max_tokens': 16}).status_code}"


def _streaming(client: httpx.Client, url: str) -> str:
    with client.stream("POST", url + C, json={"prompt": "Hi", "max_tokens": 24, "stream": True}) as r:
        done = any(line == "data: [DONE]" for line in r.iter_lines())
    return f"streaming {r.status_code}" if done else "streaming broken"


def _disconnecting(client: httpx.Client, url: str) -> str:
    with client.stream("POST", url + C, json={"prompt": "Hi", "max_tokens": 100_000, "stream": True}) as r:
        next(r.iter_lines())
    return "disconnecting"


def _oversized(client: httpx.Client, url: str) -> str:
    return f"oversized {client.post(url + C, json={'prompt': 'x' * (5 << 20)}).status_code}"


def _malformed(client: httpx.Client, url: str) -> str:
    r = client.post(url + C, content=b'{"prompt": ', headers={"content-type": "application/json"})
    return f"malformed {r.status_code}"


def _request_latency_once(url: str) -> None:
    httpx.post(url + C, json={"prompt": "warm up", "max_tokens": 8}, timeout=60)


def _rss(pid: int, field: str = "VmRSS:") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return float(line.split()[1]) * 1024
    return 0.0


def _finished(metrics: str) -> dict[str, float]:
    return {r: _metric(metrics, f'dgemma_requests_finished_total{{reason="{r}"}}') for r in
            ("stop", "length", "abort", "error")}


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


# ---- what one request's preparation costs, and a fuzz -------------------------------------------------------------
TEMPLATE = {"prompt": "x", "dgemma_template": "[[hole:4096]]" * 8000}  # 104 KB; 32.8M positions if it were built
WORDS = " ".join(["alpha", "beta", "gamma", "delta", "édition", "über", "42", "fox."][i % 8] for i in range(40_000))
EDITS = {"fraction": {"prompt": "x", "dgemma_edit": WORDS, "dgemma_renoise": 0.3},
         "spans": {"prompt": "x", "dgemma_edit": WORDS, "dgemma_renoise": [[i * 100, i * 100 + 20] for i in range(2000)]}}
DEEP = '{"prompt": ' + "[" * 70_000 + "]" * 70_000 + "}"


def cost(url: str, args, pid: int) -> dict:
    with httpx.Client(timeout=120) as client:
        client.post(url + C, json={"prompt": "warm up", "max_tokens": 8})
        template = _timed_peak(pid, lambda: client.post(url + C, json=TEMPLATE))
        edits = {k: _timed(lambda b=b: client.post(url + C, json=b)) for k, b in EDITS.items()}
    loaded = _measure(args.phase_seconds, {"health": lambda s: _health_latency(url, s)}, [
        lambda s, b=b: _repeat(url, b, s) for b in (TEMPLATE, EDITS["fraction"], EDITS["spans"], DEEP)])
    health = _stats(loaded["health"])
    ok = template["seconds"] < 0.05 and template["rss_growth_mb"] < 20 and template["status"] == 400 and \
        all(e["seconds"] < 0.5 for e in edits.values()) and health["p95"] < 0.1
    return {"template_8000_holes": template, "edit_40k_words": edits, "health_under_abuse": health, "ok": ok}


def _timed(send) -> dict:
    """Median of 3 sends: seconds and the status."""
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        status = send().status_code
        runs.append((time.perf_counter() - t0, status))
    seconds, status = sorted(runs)[1]
    return {"seconds": round(seconds, 4), "status": status}


def _timed_peak(pid: int, send) -> dict:
    """`_timed`, and the server's peak RSS growth over it (the kernel's high-water mark, reset first)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    rss0 = _rss(pid)
    out = _timed(send)
    return out | {"rss_growth_mb": round((_rss(pid, "VmHWM:") - rss0) / 2**20, 2)}


def _repeat(url: str, body, stop: threading.Event) -> None:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            client.post(url + C, content=data, headers={"content-type": "application/json"})


def fuzz(url: str, args, pid: int) -> dict:
    tally: Counter = Counter()
    _measure(args.fuzz_seconds, {}, [lambda s, i=i: _fuzz_client(url, s, tally, i) for i in range(2)])
    fivexx = sum(n for status, n in tally.items() if status >= 500)
    return {"statuses": {str(k): v for k, v in sorted(tally.items())}, "requests": sum(tally.values()),
            "5xx": fivexx, "ok": fivexx == 0}


HOSTILE = [None, True, -1, 2**70, 1e308, "", "a" * 5000, "9" * 6000, "[[hole:" + "9" * 5000 + "]]", "<start_of_turn>",
           [], {}, [[]], [{"x": None}], json.loads("[" * 60 + "]" * 60), {"type": "function", "function": "f"}]
FIELDS = ["prompt", "messages", "max_tokens", "n", "stop", "temperature", "top_p", "seed", "stream", "logprobs",
          "tools", "tool_choice", "response_format", "suffix", "dgemma_template", "dgemma_edit", "dgemma_renoise",
          "dgemma_sampling", "dgemma_timeout", "cache_salt", "stream_options", "logit_bias", "model"]
ROUTES = [("POST", C, {"prompt": "hi", "max_tokens": 2}),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
          ("GET", "/v1/models", None), ("GET", "/v1/models/x%2F..", None), ("GET", "/metrics", None),
          ("GET", "/health", None), ("GET", "/openapi.json", None), ("GET", "/playground/../../etc/passwd", None)]


def _fuzz_client(url: str, stop: threading.Event, tally: Counter, seed: int) -> None:
    import random

    rng = random.Random(seed)
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            method, path, base = rng.choice(ROUTES)
            body = None if base is None else base | {rng.choice(FIELDS): rng.choice(HOSTILE)
                                                     for _ in range(rng.randint(1, 3))}
            r = client.request(method, url + path, content=None if body is None else json.dumps(body),
                               headers={"content-type": "application/json"})
            tally[r.status_code] += 1


SCENARIOS = {"huge": huge, "slowloris": slowloris, "soak": soak, "cost": cost, "fuzz": fuzz}
EXTRA = {"cost": ["--max-tokens", "64"]}

if __name__ == "__main__":
    sys.exit(main())
