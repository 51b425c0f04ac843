"""The anchor of issue 42: llama.cpp decoding Gemma 4 26B-A4B-shaped GGUF files token by token (`llama-bench`)
against dgemma's autoregressive and speculative modes on real-width files of the same layer count, at the same
thread counts, each beside its memory bound, in one run.

Every round runs, for each thread count T, everything below once (interleaved: a shared machine's load drifts
over all of them alike); medians over the rounds:
- the read bandwidth with T threads (`decode_bound.read_bandwidth`: a float32 sum over 1 GiB);
- llama.cpp, each `--gguf NAME=FILE`: `llama-bench -m FILE -t T -p 0 -n N -r R -o json`, its mean tokens/s;
- dgemma, each `--dgemma NAME=DIR[@QUANTIZE]` (one model in memory per entry, bfloat16 compute):
  "token loop": `decode_bound.token_seconds` (head, argmax, one encoder pass a token after a `--prompt-len` prefill:
  what llama-bench's generation test times); "autoregressive" and "speculative": `model.generate` in that mode, as
  `dgemma bench` runs it (a `--prompt-len` random prompt, `--max-new-tokens` tokens, EOS ignored), tokens/s after
  the first token (the first commit ends the prefill) and end to end. With random weights the decoder's drafts are
  never accepted, so speculative decoding runs as autoregressive decoding plus a failed draft now and then (its
  back-off): its tokens/s is a floor, not what a trained model gets.
- the memory bound: bytes one token reads / the round's bandwidth. GGUF: every tensor's bytes, expert stacks at
  top-k / experts (the tied embedding read once, as the head); dgemma: `decode_bound.token_bytes`. Each engine's
  "x bound" is the median over the rounds of its seconds a token / the bound's.

    python benchmarks/anchor.py --llama-bin BIN --gguf Q4_0=F [--gguf ...] --dgemma int4=DIR [--dgemma ...]
        [--threads 1,2] [--rounds 3] [--tokens 32] [--repeats 2] [--max-new-tokens 32]
        [--modes autoregressive,speculative]

A table goes to stdout, then one JSON line; progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import dgemma  # noqa: E402
from decode_bound import prompt, read_bandwidth, token_bytes, token_seconds  # noqa: E402
from dgemma.bench.job import Job, log  # noqa: E402
from dgemma.bench.trials import generate_trial  # noqa: E402

MODES = ("autoregressive", "speculative")


def gguf_token_bytes(path: str) -> int:
    """Bytes one decoded token reads from a GGUF file: every tensor, the expert stacks at top-k / experts."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    top_k, experts = (int(reader.fields[f"{arch}.{k}"].parts[-1][0]) for k in ("expert_used_count", "expert_count"))
    return sum(int(t.n_bytes) * top_k // experts if "_exps" in t.name else int(t.n_bytes) for t in reader.tensors)


def llama_bench(binary: Path, path: str, threads: int, tokens: int, repeats: int) -> dict:
    """One `llama-bench` generation test: its mean tokens/s over `repeats` runs (after its own warm-up)."""
    cmd = [str(binary), "-m", path, "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", str(repeats),
           "-o", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    row = json.loads(out)[0]
    return {"tokens_per_second": row["avg_ts"], "build": row.get("build_commit"), "type": row.get("model_type"),
            "cpu": row.get("cpu_info")}


class Dgemma:
    """One dgemma file in memory: its token loop and its generate trials per mode."""

    def __init__(self, directory: str, quantize: str | None, args: argparse.Namespace):
        self.model = dgemma.load(directory, dtype="bfloat16", quantize=quantize)
        self.bytes = token_bytes(self.model.module)
        job = dict(dtype="bfloat16", batch=1, model=directory, device="cpu", prompt_len=args.prompt_len,
                   max_new_tokens=args.max_new_tokens, steps=None, repeats=1, warmup=0, seed=0, sampling="fast",
                   ignore_eos=True, quantize=quantize)
        self.trials = {mode: generate_trial(Job(mode, **job), self.model)[0] for mode in args.modes}
        self.ids = prompt(args.prompt_len)  # the token loop's context

    def warm(self) -> None:
        token_seconds(self.model.module, 1, self.ids)
        for trial in self.trials.values():
            trial(True)

    def measure(self, tokens: int) -> dict[str, dict]:
        """Seconds a token: the token loop, then each mode after its first token and end to end."""
        out = {"token loop": {"seconds_per_token": token_seconds(self.model.module, tokens, self.ids)}}
        for mode, trial in self.trials.items():
            s = trial(False)
            n = s["tokens"][0]
            after = (s["seconds"] - s["ttft_seconds"]) / (n - 1) if s["ttft_seconds"] is not None and n > 1 else None
            out[mode] = {"seconds_per_token": after, "end_to_end_seconds_per_token": s["seconds"] / n,
                         "passes": s["passes"][0]}
        return out


def run(args: argparse.Namespace) -> dict:
    ggufs = dict(kv.split("=", 1) for kv in args.gguf)
    sizes = {name: gguf_token_bytes(path) for name, path in ggufs.items()}
    engines = {}
    for kv in args.dgemma:
        name, spec = kv.split("=", 1)
        directory, _, quantize = spec.partition("@")
        log(f"loading dgemma {name} ({directory}{' @' + quantize if quantize else ''})")
        engines[name] = Dgemma(directory, quantize or None, args)
    buf = torch.ones(1 << 28)  # 1 GiB
    rows: dict[tuple, list[dict]] = {}  # (engine, weights, mode, threads) -> one dict per round
    bandwidths: dict[int, list[float]] = {t: [] for t in args.threads}
    for t in args.threads:
        torch.set_num_threads(t)
        for e in engines.values():
            e.warm()
    for r in range(args.rounds):
        for t in args.threads:
            torch.set_num_threads(t)
            bw = read_bandwidth(buf)
            bandwidths[t].append(bw)
            for name, path in ggufs.items():
                res = llama_bench(args.llama_bin / "llama-bench", path, t, args.tokens, args.repeats)
                res["seconds_per_token"] = 1 / res["tokens_per_second"]
                rows.setdefault(("llama.cpp", name, "llama-bench", t), []).append({**res, "bound": sizes[name] / bw})
            for name, e in engines.items():
                for mode, res in e.measure(args.tokens).items():
                    rows.setdefault(("dgemma", name, mode, t), []).append({**res, "bound": e.bytes / bw})
            log(f"round {r + 1}, {t} thread(s), {bw / 1e9:.1f} GB/s: " + ", ".join(
                f"{k[1]} {k[2]} {1 / v[-1]['seconds_per_token']:.2f}" for k, v in rows.items()
                if k[3] == t and v[-1]["seconds_per_token"]))
    return summarise(rows, bandwidths, sizes, engines, args)


def summarise(rows, bandwidths, sizes, engines, args) -> dict:
    results = []
    for (engine, weights, mode, t), per_round in rows.items():
        spt = [x["seconds_per_token"] for x in per_round if x["seconds_per_token"]]
        bytes_ = sizes[weights] if engine == "llama.cpp" else engines[weights].bytes
        out = {"engine": engine, "weights": weights, "mode": mode, "threads": t,
               "tokens_per_second": round(1 / statistics.median(spt), 2) if spt else None,
               "bytes_per_token": bytes_,
               "bound_tokens_per_second": round(statistics.median(bandwidths[t]) / bytes_, 2),
               "x_bound": round(statistics.median(x["seconds_per_token"] / x["bound"] for x in per_round
                                                  if x["seconds_per_token"]), 2) if spt else None,
               "tokens_per_second_rounds": [round(1 / s, 2) for s in spt]}
        if "end_to_end_seconds_per_token" in per_round[0]:
            out["end_to_end_tokens_per_second"] = round(
                1 / statistics.median(x["end_to_end_seconds_per_token"] for x in per_round), 2)
            out["passes"] = per_round[0]["passes"]
        if engine == "llama.cpp":
            out.update(build=per_round[0]["build"], gguf_type=per_round[0]["type"])
        results.append(out)
    return {"threads": args.threads, "rounds": args.rounds, "tokens": args.tokens, "repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens, "prompt_len": args.prompt_len,
            "read_bandwidth_gb_s": {t: [round(b / 1e9, 2) for b in bw] for t, bw in bandwidths.items()},
            **machine(), "load_average_end": os.getloadavg(), "results": results}


def machine() -> dict:
    """The CPU's name and the flags that matter here (Linux), torch's CPU capability."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info.splitlines()) if v}
    flags = set(field.get("flags", "").split())
    return {"cpu": field.get("model name", platform.machine()), "cores": os.cpu_count(),
            "avx512_bf16": "avx512_bf16" in flags, "avx512_vnni": "avx512_vnni" in flags,
            "torch_cpu": torch.backends.cpu.get_cpu_capability()}


def table(result: dict) -> str:
    head = (f"{'engine':9} {'weights':9} {'mode':14} {'thr':>3} {'tok/s':>7} {'e2e':>6} {'bound':>7} {'x bound':>7} "
            f"{'MB/token':>8}")
    lines = [head, "-" * len(head)]
    for r in sorted(result["results"], key=lambda r: (r["threads"], r["engine"] != "llama.cpp", r["weights"])):
        tps = f"{r['tokens_per_second']:.2f}" if r["tokens_per_second"] else "-"
        e2e = f"{r['end_to_end_tokens_per_second']:.2f}" if r.get("end_to_end_tokens_per_second") else ""
        xb = f"{r['x_bound']:.2f}" if r["x_bound"] else "-"
        lines.append(f"{r['engine']:9} {r['weights']:9} {r['mode']:14} {r['threads']:>3} {tps:>7} {e2e:>6} "
                     f"{r['bound_tokens_per_second']:>7.2f} {xb:>7} {r['bytes_per_token'] / 1e6:>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-bench")
    p.add_argument("--gguf", action="append", default=[], help="NAME=FILE, repeatable")
    p.add_argument("--dgemma", action="append", default=[], help="NAME=DIR[@QUANTIZE] (as dgemma.load's), repeatable")
    p.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="tokens a llama-bench run and a token loop decode")
    p.add_argument("--repeats", type=int, default=2, help="llama-bench runs per round (-r)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens each generate trial decodes")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=list(MODES),
                   help="dgemma generate modes besides the token loop (default autoregressive,speculative)")
    args = p.parse_args(argv)
    t0, load = time.perf_counter(), os.getloadavg()
    result = run(args)
    result["load_average_start"] = load
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(table(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
