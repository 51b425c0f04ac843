"""`dgemma quantize --model IN --to int4|int8 --out DIR`: write a quantized checkpoint in the compressed-tensors
layout (see dgemma/weights/compressed.py), loadable by dgemma with no flag and by vLLM."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dgemma.options import add_threads_option, apply_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="source checkpoint: a directory, a Hugging Face repo id, or demo "
                   "(the bundled demo model, the default)")
    p.add_argument("--to", required=True, metavar="SCHEME",
                   help="int4, int8 (group-wise symmetric, 32 columns per scale; int4:128 sets the group, "
                        "int4+emb8 / +embfp keep the embedding in int8 / float) or nvfp4 (embedding in float)")
    p.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    add_threads_option(p)


def run(args: argparse.Namespace) -> int:
    import torch

    from dgemma.api.checkpoint import locate
    from dgemma.errors import DgemmaError
    from dgemma.jsonfile import read_json
    from dgemma.quant import parse_quantize
    from dgemma.weights.compressed import save_compressed
    from dgemma.weights.hf import load_model

    apply_threads(args)
    spec = parse_quantize(args.to)
    if spec.int8_activations:
        raise DgemmaError(f"--to {args.to}: +a8 (int8 activations) is chosen when loading, not stored; use --to "
                          f"{spec.name.removesuffix('+a8') if spec.requantizes else 'int8'}")
    source, gguf = locate(args.model)
    if gguf:
        raise DgemmaError(f"--model {args.model}: dgemma quantize reads a checkpoint directory, not a GGUF file")
    saved = read_json(source / "config.json").get("dtype") or read_json(source / "config.json").get("torch_dtype")
    dtype = torch.bfloat16 if saved == "bfloat16" else torch.float32  # unquantized tensors keep the source's dtype
    model = load_model(source, dtype, "cpu", spec)
    out = save_compressed(model, source, Path(args.out))
    print(json.dumps({"out": str(out), "scheme": spec.name}))
    return 0
