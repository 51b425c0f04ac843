#!/usr/bin/env python3
"""Reproduce the bundled demo model: corpus -> tokenizer -> training -> dgemma/assets/demo.

    python scripts/train_demo.py                 # every step; skips the corpus / tokenizer if already built
    python scripts/train_demo.py --install-only  # copy runs/demo/final into the package
    python scripts/train_demo.py --report        # held-out losses + fixed-prompt samples -> runs/demo/report.json

Steps: `scripts/build_corpus.py` (public-domain texts from package registries), `scripts/train_tokenizer.py`
(4096-token byte-level BPE), then `dgemma train --config configs/demo.json` (resumes from runs/demo if
interrupted), then the exported checkpoint is copied to `dgemma/assets/demo/`. Extra arguments after `--` go to
the trainer, e.g. `-- --threads 2 --max-minutes 70`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSET = ROOT / "dgemma" / "assets" / "demo"
PROMPTS = ("It is a truth universally acknowledged", "To be, or not to be:", "In the beginning",
           "My dear Elizabeth,", "The king said unto")
ASSET_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json")


def step(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def install(final: Path) -> None:
    missing = [f for f in ASSET_FILES if not (final / f).is_file()]
    if missing:
        sys.exit(f"train_demo: {final} lacks {', '.join(missing)}")
    ASSET.mkdir(parents=True, exist_ok=True)
    for name in ASSET_FILES:
        shutil.copyfile(final / name, ASSET / name)
    size = sum((ASSET / f).stat().st_size for f in ASSET_FILES)
    print(f"installed {final} -> {ASSET} ({size / 2**20:.1f} MiB)")


def report(final: Path, valid: Path, out: Path) -> dict:
    """Held-out diffusion loss (t ~ U and fixed t) and autoregressive loss on the whole valid split, plus samples
    for fixed prompts (diffusion and greedy autoregressive decoding), written to `out` as JSON."""
    import json

    import torch

    sys.path.insert(0, str(ROOT))
    import dgemma
    from dgemma.train.data import collate, load_dataset
    from dgemma.train.objective import ObjectiveConfig, compute_losses

    torch.manual_seed(0)
    model = dgemma.load(final, dtype="float32")
    net, tok = model.model, model.tokenizer
    c = net.cfg.canvas_length
    cfg = json.loads((ROOT / "configs/demo.json").read_text())
    data = load_dataset(valid, tok, c, cfg["canvases"], cfg["max_prompt"], seed=1)
    eos = tok.token_id(tok.eos_token)
    batches = [collate([data.get(j, 0) for j in range(i, min(len(data), i + 16))], c, eos)
               for i in range(0, len(data), 16)]
    result: dict = {"valid_windows": len(data), "valid_tokens": sum(b.tokens for b in batches)}
    with torch.no_grad():
        for name, fixed in (("uniform", None), ("t=0.25", 0.25), ("t=0.5", 0.5), ("t=0.75", 0.75), ("t=1", 1.0)):
            g = torch.Generator().manual_seed(0)
            diff = ar = 0.0
            n_canvas = n_ar = 0
            for b in batches:
                losses = compute_losses(net, b, ObjectiveConfig(fixed_t=fixed), g)
                diff += losses.diffusion * losses.canvas_tokens
                ar += losses.autoregressive * losses.ar_tokens
                n_canvas += losses.canvas_tokens
                n_ar += losses.ar_tokens
            result[f"diffusion_loss_{name}"] = round(diff / n_canvas, 4)
            result["autoregressive_loss"] = round(ar / n_ar, 4)
    samples = []
    for prompt in PROMPTS:
        d = model.generate(prompt, max_new_tokens=96, seed=0)
        a = model.generate(prompt, max_new_tokens=64, seed=0, mode="autoregressive")
        samples.append({"prompt": prompt, "diffusion": d.text, "diffusion_stats": d.stats,
                        "autoregressive": a.text})
    result["samples"] = samples
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.json")
    parser.add_argument("--install-only", action="store_true", help="only copy runs/demo/final into the package")
    parser.add_argument("--no-install", action="store_true", help="train, but leave dgemma/assets/demo alone")
    parser.add_argument("--report", action="store_true", help="only evaluate runs/demo/final (see report())")
    parser.add_argument("trainer_args", nargs="*", help="extra `dgemma train` flags (after --)")
    args = parser.parse_args()
    py = sys.executable
    if args.report:
        report(ROOT / "runs/demo/final", ROOT / "data/corpus/valid.txt", ROOT / "runs/demo/report.json")
        return
    if not args.install_only:  # dgemma train builds the corpus and tokenizer first if missing (train/demo_inputs.py)
        step([py, "-m", "dgemma.train.command", "--config", args.config, *args.trainer_args])
    if not args.no_install:
        install(ROOT / "runs/demo/final")


if __name__ == "__main__":
    main()
