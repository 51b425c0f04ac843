"""Make a checkpoint that llama.cpp's `diffusion-gemma` (or, from a `Gemma4ForCausalLM` one, `gemma4`) converter
accepts, and optionally convert it to GGUF.

llama.cpp's converter (`convert_hf_to_gguf.py`, `conversion/diffusion_gemma.py`, `conversion/gemma.py`) needs two
things dgemma's own checkpoints lack: a Gemma-style tokenizer (BPE with byte fallback, `▁` for spaces, a `<mask>`
token: its Gemma 4 vocabulary path) and `global_head_dim` / `num_global_key_value_heads` in config.json (it does not
read the `per_layer_config` that transformers 5.23 saves, and that version's text config class drops them, so they
go where the converter merges them but the class does not read them: the root of a nested config, a `text_config`
of a flat one). `prepare` adds both to a checkpoint directory; `convert` runs llama.cpp's own converter (and
`llama-quantize` for the other types) with this Python.

    python benchmarks/gguf_checkpoint.py --checkpoint DIR [--llama-src SRC --llama-bin BIN
        --types q8_0,Q4_K_M,Q4_0-pure]

Last stdout line: JSON {checkpoint, files: {type: path}}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                 "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CORPUS = ("the quick brown fox jumps over the lazy dog. block diffusion denoises a canvas of tokens at once; "
          "the encoder writes a cache and the decoder refines the canvas.\nHello world! Numbers 0123456789 and "
          "accents: café, naïve, Zürich. 日本語のテキスト.\n\n  indented code: def f(x): return x * 2\n") * 4


def gemma_tokenizer(vocab_size: int, merges_from: str = CORPUS):
    """A `tokenizers.Tokenizer` shaped like Gemma's: specials, then the 256 byte-fallback tokens, then BPE tokens
    learnt on `merges_from`, padded with unmergeable filler tokens up to `vocab_size`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Replace(" ", "▁")
    learner.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    budget = min(vocab_size - len(SPECIALS) - 256, 2000)
    learner.train_from_iterator([merges_from], trainers.BpeTrainer(vocab_size=budget, show_progress=False))
    learnt = json.loads(learner.to_str())["model"]
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(SPECIALS) + b for b in range(256)})
    for token in sorted(learnt["vocab"], key=learnt["vocab"].get):
        vocab.setdefault(token, len(vocab))
    filler = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"<unused{filler}>", len(vocab))
        filler += 1
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is too small for the specials, bytes and learnt tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in learnt["merges"]], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = learner.normalizer
    tok.pre_tokenizer = learner.pre_tokenizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(list(SPECIALS))
    return tok


def prepare(directory: Path) -> Path:
    """Add a Gemma-style tokenizer (sized to the model's vocabulary) and the config keys the converter reads."""
    config = json.loads((directory / "config.json").read_text())
    flat = "layer_types" in config  # Gemma4ForCausalLM; DiffusionGemma nests its text config
    text = config if flat else config["text_config"]
    full = [int(i) for i, t in enumerate(text["layer_types"]) if t == "full_attention"]
    per_layer = text.get("per_layer_config") or {}
    over = per_layer.get(str(full[-1]), {}) if full else {}
    # transformers 5.23's text config class drops these keys where it reads them, before the converter sees them:
    # nested, they go at the root; flat, into a `text_config` the class keeps as is and the converter merges in
    target = config.setdefault("text_config", {}) if flat else config
    target["global_head_dim"] = over.get("head_dim", text["head_dim"])
    target["num_global_key_value_heads"] = over.get("num_key_value_heads", text["num_key_value_heads"])
    text.setdefault("final_logit_softcapping", 30.0)  # dgemma's default; without the key llama.cpp applies none
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gemma_tokenizer(text["vocab_size"]).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "mask_token": "<mask>", "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    return directory


def convert(directory: Path, llama_src: Path, llama_bin: Path | None, types: list[str], out: Path) -> dict:
    """GGUF files of `directory` written by llama.cpp's converter (q8_0, bf16, f16, f32) and by `llama-quantize`
    from the bf16 file for the other types (Q4_0, Q4_K_M, ...: llama.cpp's mixes, where the tied embedding stays
    Q6_K; a `-pure` suffix, e.g. Q4_0-pure, makes every tensor the named type)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(llama_src / "gguf-py"))
    files: dict[str, str] = {}
    direct = {t.lower() for t in types if t.lower() in ("q8_0", "bf16", "f16", "f32")}
    if any(t.lower() not in direct for t in types):
        direct.add("bf16")
    for kind in sorted(direct):
        path = out / f"model-{kind}.gguf"
        subprocess.run([sys.executable, str(llama_src / "convert_hf_to_gguf.py"), str(directory), "--outtype", kind,
                        "--outfile", str(path)], check=True, env=env, stdout=sys.stderr)
        files[kind] = str(path)
    for kind in (t for t in types if t.lower() not in ("q8_0", "bf16", "f16", "f32")):
        if llama_bin is None:
            raise SystemExit(f"{kind} needs llama-quantize: pass --llama-bin")
        base, pure = kind.removesuffix("-pure"), kind.endswith("-pure")  # -pure: every tensor that type
        path = out / f"model-{kind}.gguf"
        subprocess.run([str(llama_bin / "llama-quantize"), *(["--pure"] if pure else []), files["bf16"], str(path),
                        base], check=True, stdout=sys.stderr, stderr=sys.stderr)
        files[kind] = str(path)
    return {t: files[t.lower()] if t.lower() in files else files[t] for t in types}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path, help="dgemma / Hugging Face checkpoint directory")
    p.add_argument("--llama-src", type=Path, default=None, help="llama.cpp source tree (its converter); "
                   "without it only the checkpoint is prepared")
    p.add_argument("--llama-bin", type=Path, default=None, help="folder with llama-quantize (for k-quant types)")
    p.add_argument("--types", default="q8_0,Q4_K_M", help="GGUF types to write (default q8_0,Q4_K_M)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: the checkpoint directory)")
    args = p.parse_args(argv)
    prepare(args.checkpoint)
    files = {}
    if args.llama_src is not None:
        files = convert(args.checkpoint, args.llama_src, args.llama_bin, args.types.split(","),
                        args.out or args.checkpoint)
    print(json.dumps({"checkpoint": str(args.checkpoint), "files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
