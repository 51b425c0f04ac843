"""Write a random Gemma 4 26B-A4B-shaped `Gemma4ForCausalLM` checkpoint (bf16) and turn it into GGUF files with
llama.cpp's own converter and `llama-quantize`: the autoregressive peer of dgemma's `real_shape.py` file.

The shapes are `real_shape.real_config(layers)` (hidden 2816, 16 heads, sliding layers 8 KV heads of 256, full
layers 2 KV heads of 512 with keys as values, dense MLP 2112 beside 128 experts of 704, top-8, vocabulary 262,144;
the last layer full) as transformers 5.23's `Gemma4TextConfig`. Tensors are drawn one at a time and written in
~2 GB shards, so the peak memory is a shard, not the model; the scales match `real_shape.py`'s int4 weights
(root mean square 4.64 / (4 sqrt(fan_in)); norms and scalars 1, router 1 / sqrt(hidden)). The tokenizer is
`gguf_checkpoint.gemma_tokenizer` (what the converter's Gemma 4 vocabulary path accepts), and
`gguf_checkpoint.convert` runs the converter (q8_0, bf16) and `llama-quantize` (Q4_0, Q4_K_M from the bf16 file).

    python benchmarks/gemma4_gguf.py --out DIR --llama-src SRC --llama-bin BIN [--layers 4]
        [--types q8_0,Q4_0,Q4_0-pure,Q4_K_M] [--keep]

Writes DIR/hf (the checkpoint) and DIR/model-TYPE.gguf; without `--keep` the checkpoint and the bf16 GGUF (when
not asked for) are deleted afterwards. Last stdout line: JSON {files: {type: path}, bytes, parameters, seconds}.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dgemma.config import FULL  # noqa: E402
from gguf_checkpoint import convert, prepare  # noqa: E402
from real_shape import real_config  # noqa: E402

SHARD_BYTES = 2 << 30
CODE_RMS = 4.64  # root mean square of the 16 int4 codes -8..7, each equally likely (real_shape.py's weights)


def hf_config(layers: int):
    """transformers' `Gemma4TextConfig` for the real 26B-A4B text model with `layers` layers."""
    from transformers import Gemma4TextConfig

    t = real_config(layers).text
    full = next(i for i, kind in enumerate(t.layer_types) if kind == FULL)
    spec = t.layer(full)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": t.rope_sliding.theta},
            "full_attention": {"rope_type": t.rope_full.rope_type, "rope_theta": t.rope_full.theta,
                               "partial_rotary_factor": t.rope_full.partial_rotary_factor}}
    return Gemma4TextConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, global_head_dim=spec.head_dim,
        num_global_key_value_heads=spec.num_kv_heads, attention_k_eq_v=True, enable_moe_block=True,
        num_experts=t.num_experts, top_k_experts=t.top_k_experts, moe_intermediate_size=t.moe_intermediate_size,
        hidden_size_per_layer_input=0, layer_types=list(t.layer_types), sliding_window=t.sliding_window,
        final_logit_softcapping=t.final_logit_softcapping, max_position_embeddings=t.max_position_embeddings,
        rope_parameters=rope, eos_token_id=list(t.eos_token_id), tie_word_embeddings=True, dtype="bfloat16")


def random_tensor(name: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """bf16 values at real_shape.py's scales: matrices by fan-in, the router by hidden, norms and scalars 1."""
    if name.endswith("router.proj.weight"):
        return (torch.randn(shape, generator=g) / math.sqrt(shape[-1])).to(torch.bfloat16)
    if len(shape) < 2:
        return torch.ones(shape, dtype=torch.bfloat16)
    out = torch.empty(shape, dtype=torch.bfloat16)
    std = CODE_RMS / (4 * math.sqrt(shape[-1]))
    for row in out.view(-1, shape[-1]).split(1 << 16):  # float32 temporaries of a slice, not of the tensor
        row.copy_(torch.randn(row.shape, generator=g).mul_(std))
    return out


def write_checkpoint(out: Path, layers: int, seed: int) -> int:
    """The bf16 safetensors shards, index and config.json of a random checkpoint; returns its parameters."""
    from transformers import Gemma4ForCausalLM

    cfg = hf_config(layers)
    with torch.device("meta"):
        names = {k: v.shape for k, v in Gemma4ForCausalLM(cfg).state_dict().items() if k != "lm_head.weight"}
    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    current, size, weight_map, shard = {}, 0, {}, 0

    def flush():
        nonlocal current, size, shard
        shard += 1
        file = f"model-{shard:05d}.safetensors"
        save_file(current, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(current, file))
        current, size = {}, 0

    for name, shape in names.items():
        current[name] = random_tensor(name, shape, g)
        size += current[name].nbytes
        if size >= SHARD_BYTES:
            flush()
    if current:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg.architectures = ["Gemma4ForCausalLM"]  # the converter picks its model class by this
    cfg.save_pretrained(out)
    return sum(math.prod(s) for s in names.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--llama-src", type=Path, required=True, help="llama.cpp source tree (its converter)")
    p.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-quantize and llama-completion")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--types", default="q8_0,Q4_0,Q4_0-pure,Q4_K_M")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the safetensors checkpoint and the bf16 GGUF")
    args = p.parse_args(argv)
    if args.layers < 2:  # llama.cpp asserts that a gemma4 model has a sliding layer; the last one is full
        p.error("--layers must be at least 2")
    t0 = time.perf_counter()
    hf = args.out / "hf"
    if hf.exists():
        p.error(f"{hf} exists; choose another --out")
    params = write_checkpoint(hf, args.layers, args.seed)
    print(f"checkpoint: {params / 1e9:.2f} B parameters in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    prepare(hf)
    types = args.types.split(",")
    files = convert(hf, args.llama_src, args.llama_bin, types, args.out)
    first = files[types[0]]  # the file loads and generates (llama-completion, 4 tokens)
    subprocess.run([str(args.llama_bin / "llama-completion"), "-m", first, "-p", "hello world", "-n", "4", "-t", "2",
                    "-no-cnv", "--temp", "0", "-c", "256"], check=True, stdout=sys.stderr, stderr=sys.stderr)
    if not args.keep:
        shutil.rmtree(hf)
        if "bf16" not in [t.lower() for t in types]:
            (args.out / "model-bf16.gguf").unlink(missing_ok=True)
    print(json.dumps({"files": files, "bytes": {t: Path(f).stat().st_size for t, f in files.items()},
                      "parameters": params, "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
