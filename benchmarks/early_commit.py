"""Time to the first committed token through the server's stream, with early commit against the defaults: starts
`dgemma serve` on a checkpoint (default: the bundled demo model), streams the same chats (same seeds) under each
variant, round-robin per chat (each variant first in turn) so a shared machine's load falls on all alike, and
reports per variant the median time from sending the request to the first content chunk, to the role chunk (sent
once the request's first step ran: prefill and the server's own overhead) and from that chunk to the first
content, the whole answer's time, tokens/s, and how many answers equal the defaults' text (the option changes
outputs; the harness, benchmarks/quality/evaluate.py, gives its accuracy). With --harness-prompts the chats are a
harness checkpoint's held-out task prompts (benchmarks/quality/tasks.py), and each variant's exact-match accuracy is
reported too. --modes adds the other decoding modes (autoregressive, speculative) as variants, each served by a
server of its own.

    python benchmarks/early_commit.py [--model DIR] [--chats 8] [--max-tokens 64] [--early-commit 1,2,3] \
        [--variant 'NAME={"early_commit": 1, "early_commit_cache": true}'] [--harness-prompts] [--modes speculative]

Last stdout line: JSON {variants: {name: {ttft_seconds_median, start_seconds_median, ttft_after_start_median,
seconds_median, tokens_per_second, same_text_as_defaults, ttft_ratio, ttft_after_start_ratio,
ttft_ratio_paired_median[, accuracy]}}, settings, machine}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent / "quality"))
import tasks  # noqa: E402
from dgemma.api import DEMO_MODEL  # noqa: E402
from dgemma.bench.flops import cpu_name, load_average  # noqa: E402
from dgemma.options import MODES  # noqa: E402

# Before a request to another server: the one that just answered keeps the cores busy for a moment (measured:
# autoregressive TTFT 59 ms right after a diffusion server's answer, 20 ms alone or after this pause)
SPIN_SECONDS = 0.3
QUESTIONS = ["The capital of France is", "Write a short poem about the sea.", "List three prime numbers.",
             "What is two plus two?", "Describe a cat in one sentence.", "Say hello in French.",
             "Name a color of the sky.", "Count from one to five."]


def harness_examples(model: str, n: int) -> list[tasks.Example]:
    """n held-out prompts of the checkpoint's own harness, task by task in turn."""
    name, n_train, learned = tasks.read_harness(Path(model))
    per_task = -(-n // len(learned))
    return tasks.evaluation_set(per_task, learned, n_train, tasks.HARNESSES[name], learned)[:n]


def serve(model: str, threads: int | None, mode: str = MODES[0]) -> tuple[subprocess.Popen, str]:
    """`dgemma serve --mode MODE` on a free loopback port; returns the process and its base URL once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "dgemma", "serve", "--model", model, "--port", str(port), "--no-access-log",
           "--log-level", "warning", "--mode", mode] + (["--threads", str(threads)] if threads else [])
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc, url = subprocess.Popen(cmd, env=env), f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit("the server did not become ready")


def stream_chat(client: httpx.Client, question: str, seed: int, max_tokens: int, sampling: dict) -> dict:
    """One streamed chat: seconds to the first content chunk and to the end, and the text."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}, "dgemma_sampling": sampling}
    t0, ttft, started, text, tokens = time.perf_counter(), None, None, "", 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            started = started if started is not None else time.perf_counter() - t0  # the role chunk: in the batch
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if content := choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text += content
    return {"ttft": ttft, "started": started, "seconds": time.perf_counter() - t0, "text": text, "tokens": tokens}


def summarise(rows: list[dict], base: list[dict]) -> dict:
    seconds = sum(r["seconds"] for r in rows)
    return {"ttft_seconds_median": statistics.median(r["ttft"] for r in rows if r["ttft"] is not None),
            "start_seconds_median": statistics.median(r["started"] for r in rows),
            "ttft_after_start_median": statistics.median(r["ttft"] - r["started"] for r in rows if r["ttft"]),
            "seconds_median": statistics.median(r["seconds"] for r in rows),
            "tokens_per_second": sum(r["tokens"] for r in rows) / seconds,
            "same_text_as_defaults": sum(r["text"] == b["text"] for r, b in zip(rows, base)) / len(rows)}


def _variant(text: str) -> tuple[str, dict]:
    name, _, fields = text.partition("=")
    return name, json.loads(fields)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--early-commit", default="1,2,3", help="values of early_commit to compare with the defaults")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="another variant: its dgemma_sampling fields (repeatable)")
    p.add_argument("--threads", type=int, help="the server's torch threads")
    p.add_argument("--harness-prompts", action="store_true",
                   help="chat with the held-out prompts of the checkpoint's quality harness and score the answers")
    p.add_argument("--modes", default="", help=f"also these decoding modes ({', '.join(MODES[1:])}), as variants "
                   "of their names, each from a server of its own")
    args = p.parse_args()
    examples = harness_examples(args.model, args.chats) if args.harness_prompts else None
    questions = [e.prompt for e in examples] if examples else QUESTIONS
    modes = [m for m in args.modes.split(",") if m]
    if bad := set(modes) - set(MODES[1:]):
        raise SystemExit(f"--modes: {', '.join(sorted(bad))} is not one of {', '.join(MODES[1:])}")
    variants = {"defaults": {}} | {f"early_commit_{n}": {"early_commit": int(n)} for n in args.early_commit.split(",")
                                   if n} | dict(_variant(v) for v in args.variant)
    served = {MODES[0]: variants} | {mode: {mode: {}} for mode in modes}  # mode -> its variants
    servers = {}
    try:
        for mode in served:
            servers[mode] = serve(args.model, args.threads, mode)
        clients = {mode: httpx.Client(base_url=url, timeout=600) for mode, (_, url) in servers.items()}
        plan = [(name, clients[mode], sampling) for mode, vs in served.items() for name, sampling in vs.items()]
        for _, client, sampling in plan:  # warm-up
            stream_chat(client, questions[0], 0, args.max_tokens, sampling)
        rows: dict[str, list] = {name: [] for name, _, _ in plan}
        last = None
        for i in range(args.chats):
            for name, client, sampling in plan[i % len(plan):] + plan[:i % len(plan)]:  # each goes first in turn
                if last not in (None, client):
                    time.sleep(SPIN_SECONDS)
                last = client
                rows[name].append(stream_chat(client, questions[i % len(questions)], i, args.max_tokens, sampling))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    out = {name: summarise(r, rows["defaults"]) for name, r in rows.items()}
    for name, r in rows.items() if examples else ():
        out[name]["accuracy"] = sum(tasks.is_correct(e, a["text"]) for e, a in zip(examples, r)) / len(r)
    for name, r in rows.items():  # chat by chat (same prompt and seed), less exposed to the machine's load
        out[name]["ttft_ratio_paired_median"] = statistics.median(
            a["ttft"] / b["ttft"] for a, b in zip(r, rows["defaults"]) if a["ttft"] and b["ttft"])
    for v in out.values():
        v["ttft_ratio"] = v["ttft_seconds_median"] / out["defaults"]["ttft_seconds_median"]
        v["ttft_after_start_ratio"] = v["ttft_after_start_median"] / out["defaults"]["ttft_after_start_median"]
        print(f"{v['ttft_ratio']:.3f} x ttft  " + json.dumps(v), file=sys.stderr)
    print(json.dumps({"variants": out, "settings": vars(args),
                      "machine": {"cpu": cpu_name(), "load_average": load_average()}}))


if __name__ == "__main__":
    main()
