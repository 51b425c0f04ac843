"""How long a checkpoint takes to load on the CPU, with and without the kernel-layout cache
(dgemma/weights/kernel_cache.py), against the time it takes to read the files.

Each load runs in its own process (so peak RSS is that load's), variants interleaved round by round:
- `repack`: the cache off (`DGEMMA_KERNEL_CACHE=off`): read, repack to torch's int4 layout;
- `first`: the cache file removed first: the same, then the cache written;
- `cached`: the cache present: the int4 weights memory-mapped.
Per load: `load_s` (`dgemma.api.checkpoint.open_checkpoint`), `touch_s` (then reading one byte of every page of
every tensor of the model: what faulting a mapped cache in costs, ~0 for weights already in memory), `token_s` (then
one autoregressive token after a 16-token prefill), peak RSS and RssAnon / RssFile after touching. `read_s`: plain
reads of the checkpoint's safetensors files into one reused buffer (the floor the cache aims at), and of the cache
file. `--cold` evicts the checkpoint's and the cache's pages from the page cache before each process
(`posix_fadvise(DONTNEED)` per file: no root needed, other files untouched).

    python benchmarks/load_seconds.py --model DIR [--rounds 3] [--variants repack,first,cached] [--cold]

Last stdout line: JSON {model, cold, threads, read_s, cache_read_s, variants: {name: {medians..., runs: [...]}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

ENV = "DGEMMA_KERNEL_CACHE"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="repack,first,cached")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cold", action="store_true", help="evict the files' pages before each load")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.model), args.threads)))
        return 0
    model = Path(args.model)
    variants = args.variants.split(",")
    runs = {v: [] for v in variants}
    reads, cache_reads = [], []
    for r in range(args.rounds):
        for v in variants:
            if v == "first":
                for f in cache_files(model):
                    f.unlink()
            if args.cold:
                evict(model)
            runs[v].append(spawn(model, v, args.threads))
            print(f"round {r} {v}: {runs[v][-1]}", file=sys.stderr)
        if args.cold:
            evict(model)
        reads.append(read_seconds(sorted(model.glob("*.safetensors"))))
        if cache_files(model):
            cache_reads.append(read_seconds(cache_files(model)))
    keys = ("load_s", "touch_s", "token_s", "peak_rss_gb", "rss_anon_gb", "rss_file_gb")
    report = {"model": str(model), "cold": args.cold, "threads": args.threads,
              "checkpoint_gb": sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e9,
              "read_s": statistics.median(reads), "cache_read_s": statistics.median(cache_reads) if cache_reads
              else None, "variants": {v: {**{k: statistics.median(x[k] for x in rs) for k in keys}, "runs": rs}
                                      for v, rs in runs.items()}}
    print(json.dumps(report))
    return 0


def cache_files(model: Path) -> list[Path]:
    return sorted((model / ".dgemma-cache").glob("*.safetensors"))


def evict(model: Path) -> None:
    for f in [*model.glob("*.safetensors"), *cache_files(model)]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_seconds(files: list[Path]) -> float:
    import numpy as np

    buf = np.empty(64 << 20, dtype=np.uint8)
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


def spawn(model: Path, variant: str, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop(ENV, None)
    if variant == "repack":
        env[ENV] = "off"
    out = subprocess.run([sys.executable, __file__, "--model", str(model), "--threads", str(threads), "--child",
                          variant], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def child(model: Path, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import dgemma.model  # noqa: F401  (imports out of the timed load)
    from dgemma.api.checkpoint import open_checkpoint

    t0 = time.perf_counter()
    module = open_checkpoint(model, "auto", "cpu", False, None)[0]
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.numel():
            total += int(t.detach().reshape(-1).view(torch.uint8)[::4096].sum())  # one byte a page
    touch = time.perf_counter() - t0
    with torch.inference_mode():
        cache = module.new_cache(1, 18)
        hidden = module.prefill(torch.arange(2, 18)[None], cache)
        t0 = time.perf_counter()
        module.encode(module.head(hidden).argmax(-1)[:, None], cache)
        token = time.perf_counter() - t0
    rss = {line.split(":")[0]: int(line.split()[1]) * 1024 / 1e9 for line in open("/proc/self/status")
           if line.startswith(("RssAnon", "RssFile"))}
    return {"load_s": round(load, 2), "touch_s": round(touch, 2), "token_s": round(token, 3),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2),
            "rss_anon_gb": round(rss["RssAnon"], 2), "rss_file_gb": round(rss["RssFile"], 2)}


if __name__ == "__main__":
    sys.exit(main())
