"""Encoding one image at the released vision tower's shape: preprocessing (Pillow) and the tower + embedder, time
and memory.

    python benchmarks/vision_encode.py [--layers 27] [--soft-tokens 280] [--dtypes bfloat16,float32]
                                       [--repeats 3] [--threads N] [--device cpu]

The tower (hidden 1152, MLP 4304, 16 heads of 72, 16-pixel patches, 3 x 3 pooling, about 550M parameters at 27
layers) has random weights: time does not depend on their values. A 1024 x 768 photo-sized image is resized to
the soft-token budget (280: 2,520 patches at most). Memory: on CPU the growth of peak RSS over the encode
(activations, once the weights are allocated), on CUDA the peak allocated bytes above the weights.
Last stdout line: JSON {per dtype: preprocess / encode seconds (median), soft tokens, patches, parameter bytes,
activation peak bytes}, threads, device.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from dgemma.config import TextConfig, VisionConfig  # noqa: E402
from dgemma.dtypes import parse_dtype  # noqa: E402
from dgemma.images import preprocess  # noqa: E402
from dgemma.model.vision import Vision  # noqa: E402

REAL = dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, num_key_value_heads=16, head_dim=72,
            patch_size=16, pooling_kernel_size=3, position_embedding_size=10240, standardize=True)


def encode_flops(cfg: VisionConfig, patches: int, text_hidden: int = 2816) -> int:
    """Matmul FLOPs of one encode: per layer q/k/v/o, the gated MLP and attention (scores and values); the patch
    projection and the embedder's projection once."""
    h, i, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    layer = 2 * patches * h * 4 * heads + 2 * patches * h * i * 3 + 2 * 2 * patches**2 * heads
    soft = patches // cfg.pooling_kernel_size**2
    return cfg.num_hidden_layers * layer + 2 * patches * 3 * cfg.patch_size**2 * h + 2 * soft * h * text_hidden


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(dtype: torch.dtype, args, image) -> dict:
    cfg = VisionConfig(num_hidden_layers=args.layers, **REAL)
    device = torch.device(args.device)
    torch.set_default_dtype(dtype)  # the weights are made in their dtype: no float32 copy raises the peak
    with torch.device("meta"):
        vision = Vision(cfg, TextConfig(hidden_size=2816)).eval()
    vision = vision.to_empty(device=device)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in vision.parameters():
            p.normal_(std=0.02)
        for b in vision.buffers():
            b.fill_(1.0)
    weights = sum(p.numel() * p.element_size() for p in vision.parameters())
    t = time.perf_counter()
    patches = preprocess(image, cfg.patch_size, cfg.pooling_kernel_size, args.soft_tokens)
    t_pre = time.perf_counter() - t
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rss0 = _rss_bytes()
    times = []
    with torch.no_grad():
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = vision(patches.pixels.to(device), patches.positions.to(device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else _rss_bytes() - rss0
    assert out.shape == (patches.soft_tokens, 2816)
    return {"preprocess_seconds": t_pre, "encode_seconds_median": statistics.median(times),
            "encode_seconds_best": min(times), "soft_tokens": patches.soft_tokens,
            "patches": patches.pixels.shape[0], "parameter_bytes": weights, "activation_peak_bytes": peak,
            "flops": encode_flops(cfg, patches.pixels.shape[0])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--soft-tokens", type=int, default=280)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    image = Image.fromarray(torch.randint(0, 256, (768, 1024, 3), generator=g, dtype=torch.uint8).numpy())
    names = args.dtypes.split(",")
    if len(names) > 1:  # one process per dtype: each peak RSS is its own
        results = {}
        for name in names:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--dtypes", name]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            results.update(json.loads(out.strip().splitlines()[-1])["dtypes"])
    else:
        results = {names[0]: run(parse_dtype(names[0]), args, image)}
    for name, r in results.items():
        print(f"{name:>9}: preprocess {r['preprocess_seconds']:.3f} s, encode {r['encode_seconds_median']:.2f} s "
              f"(median of {args.repeats}), {r['soft_tokens']} soft tokens from {r['patches']} patches, weights "
              f"{r['parameter_bytes'] / 2**20:.0f} MiB, activations +{r['activation_peak_bytes'] / 2**20:.0f} MiB")
    print(json.dumps({"dtypes": results, "layers": args.layers, "threads": torch.get_num_threads(),
                      "device": args.device}))


if __name__ == "__main__":
    main()
