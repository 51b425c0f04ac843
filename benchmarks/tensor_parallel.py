"""Per-rank weight memory of DiffusionGemma 26B-A4B (the released shape, bf16) under tensor / expert parallelism:
the real model is built on the meta device and cut by `dgemma.parallel.shard` exactly as a rank cuts it, for each
size; nothing is allocated. Sharded: attention, dense and self-conditioning MLPs, experts, the tied embedding / LM
head (over the vocabulary); replicated: norms, routers, scalars. Timings live in benchmarks/gpu.py
(`--tensor-parallel N` under torchrun).

    python benchmarks/tensor_parallel.py [--sizes 1,2,4,8] [--layers 30] [--dtype bfloat16]

Last stdout line: JSON {shape, dtype, ranks: [{size, sharded_bytes, replicated_bytes, embedding_bytes, total_bytes,
fraction, sharded_fraction}]} (embedding_bytes: the embedding's part of sharded_bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dgemma.dtypes import NAMES, parse_dtype  # noqa: E402
from dgemma.model import DiffusionGemma  # noqa: E402
from dgemma.parallel import Group, shard, weight_bytes  # noqa: E402
from real_shape import real_config  # noqa: E402


def per_rank(layers: int, size: int, dtype: torch.dtype) -> dict:
    """Rank 0's weight bytes of a `size`-way run (every rank holds as much)."""
    with torch.device("meta"):
        model = DiffusionGemma(real_config(layers)).to(dtype)
    whole = weight_bytes(model)
    if size > 1:
        shard(model, Group(0, size))
    mine = weight_bytes(model)
    total = mine["sharded"] + mine["replicated"]
    return {"size": size, "sharded_bytes": mine["sharded"], "replicated_bytes": mine["replicated"],
            "embedding_bytes": mine["embedding"], "total_bytes": total,
            "fraction": total / (whole["sharded"] + whole["replicated"]),
            "sharded_fraction": mine["sharded"] / whole["sharded"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--dtype", default="bfloat16", choices=NAMES)
    args = p.parse_args(argv)
    ranks = [per_rank(args.layers, n, parse_dtype(args.dtype)) for n in args.sizes]
    for r in ranks:
        print(f"tp {r['size']}: {r['total_bytes'] / 2**30:6.2f} GiB a rank ({r['sharded_bytes'] / 2**30:.2f} sharded, "
              f"of which {r['embedding_bytes'] / 2**30:.2f} embedding, + {r['replicated_bytes'] / 2**30:.3f} "
              f"replicated), {r['fraction']:.3f} of one process", file=sys.stderr)
    print(json.dumps({"shape": f"26B-A4B, {args.layers} layers", "dtype": args.dtype, "ranks": ranks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
