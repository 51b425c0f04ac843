"""Quality of quantized weights: held-out losses of the bundled model (or --model) in float32 and each scheme.

Same windows, same noise (fixed generator) for every scheme; the training objective (dgemma/train/objective.py):
the diffusion loss at t ~ U(0, 1) and the encoder's autoregressive loss, in nats per token, and each scheme's
difference to float32. The held-out split is `data/corpus/valid.txt` of `scripts/build_corpus.py`.

    python benchmarks/quant_quality.py --valid data/corpus/valid.txt [--schemes none,int8,int4] [--windows N]

Last stdout line: JSON {scheme: {diffusion, autoregressive, d_diffusion, d_autoregressive}, ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import dgemma  # noqa: E402
from dgemma.train.data import collate, load_dataset  # noqa: E402
from dgemma.train.objective import ObjectiveConfig, compute_losses  # noqa: E402


@torch.no_grad()
def held_out(model, batches) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    diff = ar = 0.0
    n_canvas = n_ar = 0
    for b in batches:
        losses = compute_losses(model.module, b, ObjectiveConfig(), g)
        diff += losses.diffusion * losses.canvas_tokens
        ar += losses.autoregressive * losses.ar_tokens
        n_canvas += losses.canvas_tokens
        n_ar += losses.ar_tokens
    return {"diffusion": diff / n_canvas, "autoregressive": ar / n_ar}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    p.add_argument("--valid", required=True, help="held-out text (scripts/build_corpus.py's valid.txt)")
    p.add_argument("--schemes", default="none,int8,int4+emb8,int4", help="comma-separated; none = float32")
    p.add_argument("--windows", type=int, default=None, help="first N held-out windows (default: all)")
    p.add_argument("--canvases", type=int, default=2)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results, batches = {}, None
    for scheme in args.schemes.split(","):
        t0 = time.perf_counter()
        model = dgemma.load(args.model, dtype="float32", quantize=None if scheme == "none" else scheme)
        if batches is None:
            tok, c = model.tokenizer, model.module.cfg.canvas_length
            data = load_dataset(args.valid, tok, c, args.canvases, args.max_prompt, seed=1)
            n = min(len(data), args.windows or len(data))
            eos = tok.token_id(tok.eos_token)
            batches = [collate([data.get(j, 0) for j in range(i, min(n, i + 16))], c, eos) for i in range(0, n, 16)]
        results[scheme] = {k: round(v, 4) for k, v in held_out(model, batches).items()}
        print(f"{scheme:>12}: diffusion {results[scheme]['diffusion']:.4f}, autoregressive "
              f"{results[scheme]['autoregressive']:.4f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    base = results.get("none")
    for r in results.values():
        if base:
            r["d_diffusion"] = round(r["diffusion"] - base["diffusion"], 4)
            r["d_autoregressive"] = round(r["autoregressive"] - base["autoregressive"], 4)
    print(json.dumps({"windows": sum(b.ids.shape[0] for b in batches), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
