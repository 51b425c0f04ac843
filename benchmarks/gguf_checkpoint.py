"""Make a checkpoint that llama.cpp's `diffusion-gemma` converter accepts, and optionally convert it to GGUF.

llama.cpp's converter (`convert_hf_to_gguf.py`, `conversion/diffusion_gemma.py`) needs two things dgemma's own
checkpoints lack: a Gemma-style tokenizer (BPE with byte fallback, `▁` for spaces, a `<mask>` token: its Gemma 4
vocabulary path) and `global_head_dim` / `num_global_key_value_heads` in config.json (it does not read the
`per_layer_config` that transformers 5.23 saves, and that version's config class drops them from `text_config`,
so they go at the root, which the converter merges). `prepare` adds both to a checkpoint directory; `convert` runs
llama.cpp's own converter (and `llama-quantize` for k-quant mixes) with this Python.

    python benchmarks/gguf_checkpoint.py --checkpoint DIR [--llama-src SRC --llama-bin BIN --types q8_0,Q4_K_M]

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
    text = config["text_config"]
    full = [int(i) for i, t in enumerate(text["layer_types"]) if t == "full_attention"]
    per_layer = text.get("per_layer_config") or {}
    over = per_layer.get(str(full[-1]), {}) if full else {}
    # at the root: transformers 5.23's config class drops them from text_config before the converter sees it
    config["global_head_dim"] = over.get("head_dim", text["head_dim"])
    config["num_global_key_value_heads"] = over.get("num_key_value_heads", text["num_key_value_heads"])
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
    """GGUF files of `directory` written by llama.cpp's converter (q8_0, bf16, f16, f32) and, for k-quant mixes
    such as Q4_K_M, by `llama-quantize` from the bf16 file."""
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
        path = out / f"model-{kind}.gguf"
        subprocess.run([str(llama_bin / "llama-quantize"), files["bf16"], str(path), kind], check=True,
                       stdout=sys.stderr, stderr=sys.stderr)
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
