"""`dgemma train`: train or fine-tune from a config file (JSON / TOML) and/or flags; `--merge-adapter` folds a saved
LoRA adapter into a full checkpoint. Flags override the file; every option is a TrainConfig field."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from dgemma.errors import DgemmaError
from dgemma.jsonfile import read_json
from dgemma.options import add_threads_option, apply_threads

# flag -> (TrainConfig field, type, help); booleans are handled apart
_FLAGS = {
    "--tokenizer": ("tokenizer", str, "tokenizer directory (default: the model's)"),
    "--data": ("train_data", str, "training data: a text file (documents split by two blank lines) or chat .jsonl"),
    "--valid-data": ("valid_data", str, "held-out data, same formats"),
    "--out": ("out", str, "output directory: checkpoints/, final/, adapter/, log.jsonl (default runs/train)"),
    "--steps": ("steps", int, "optimizer steps"),
    "--batch-size": ("batch_size", int, "examples per micro-batch"),
    "--grad-accum": ("grad_accum", int, "micro-batches per optimizer step"),
    "--lr": ("lr", float, "peak learning rate (default 1.5e-4)"),
    "--min-lr": ("min_lr", float, "final learning rate of the cosine decay"),
    "--warmup": ("warmup", int, "linear warmup steps"),
    "--weight-decay": ("weight_decay", float, "AdamW weight decay"),
    "--clip": ("clip", float, "gradient-norm clip (0 disables)"),
    "--canvases": ("canvases", int, "canvases per text window / at most per chat answer"),
    "--max-prompt": ("max_prompt", int, "prompt tokens at most"),
    "--ar-weight": ("ar_weight", float, "weight of the encoder's next-token loss"),
    "--self-cond-prob": ("self_cond_prob", float, "probability of the self-conditioning signal"),
    "--precision": ("precision", str, "auto | float32 | bfloat16 (bf16: autocast over float32 master weights, "
                    "or a bf16 frozen LoRA base)"),
    "--lora-r": ("lora_r", int, "LoRA rank"),
    "--lora-alpha": ("lora_alpha", int, "LoRA alpha"),
    "--eval-every": ("eval_every", int, "held-out loss every N steps (0: never)"),
    "--save-every": ("save_every", int, "checkpoint every N steps (0: only by time)"),
    "--save-minutes": ("save_minutes", float, "checkpoint at least this often"),
    "--max-minutes": ("max_minutes", float, "stop and export after this much wall time"),
    "--save-dtype": ("save_dtype", str, "float32 | bfloat16 for the exported checkpoint"),
    "--seed": ("seed", int, "seed of the initialisation, data order and noise"),
    "--device": ("device", str, "torch device (cpu, cuda)"),
    "--quantize": ("quantize", str, "with --lora (QLoRA): quantize the frozen base while loading: int8 or int4; "
                   "with --merge-adapter: write the merged checkpoint quantized (int8, int4, nvfp4)"),
    "--parallel": ("parallel", str, "under torchrun: fsdp (shard weights, gradients and optimizer; default) or ddp "
                   "(whole model on every rank, gradients averaged: LoRA with a base that fits)"),
    "--backend": ("backend", str, "under torchrun: auto (nccl on cuda, gloo on cpu), gloo or nccl"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="training config file (.json or .toml); flags override it")
    parser.add_argument("--model", help="checkpoint to fine-tune: a directory, a Hugging Face repo id, or demo (the "
                        "bundled model); without it, a --config file's model_config trains a new model")
    for flag, (_, kind, help_) in _FLAGS.items():
        parser.add_argument(flag, type=kind, default=None, help=help_)
    add_threads_option(parser)
    parser.add_argument("--lora", action="store_true", default=None, help="train a LoRA adapter instead of all weights")
    parser.add_argument("--activation-checkpointing", action="store_true", default=None,
                        help="rerun each layer in backward instead of keeping its activations (less memory)")
    parser.add_argument("--lora-targets", default=None,
                        help="comma-separated: attention, mlp, experts, router, self_conditioning, or module names")
    parser.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--merge-adapter", metavar="ADAPTER_DIR",
                        help="instead of training: merge this LoRA adapter into --model (a quantized base is "
                             "dequantized first) and write --out, in full precision or --quantize")


def _config_values(args: argparse.Namespace) -> dict:
    from dgemma.train.config import read_config_file

    values = read_config_file(args.config) if args.config else {}
    if args.model is not None:
        values["model"] = args.model
        values.pop("model_config", None)
    for flag, (name, _, _) in _FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            values[name] = value
    if args.threads:  # the shared flag (options.add_threads_option); the trainer applies it
        values["threads"] = args.threads
    if args.lora:
        values["lora"] = True
    if args.activation_checkpointing:
        values["activation_checkpointing"] = True
    if args.lora_targets:
        values["lora_targets"] = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    if args.no_resume:
        values["resume"] = False
    return values


def run(args: argparse.Namespace) -> int:
    if args.merge_adapter:
        return run_merge(args)
    from dgemma.train.config import make_config
    from dgemma.train.demo_inputs import build_missing
    from dgemma.train.distributed import launch_environment
    from dgemma.train.trainer import train

    values = _config_values(args)
    cfg = make_config(values)
    if launch_environment()[1] == 1:  # under torchrun the ranks would race: the README builds the inputs first
        build_missing(args.config, values)
    final = train(cfg, progress=not args.no_progress)
    if launch_environment()[0] == 0:  # under torchrun, one rank reports
        print(json.dumps({"final": str(final), "out": cfg.out}))
    return 0


def run_merge(args: argparse.Namespace) -> int:
    """--merge-adapter ADAPTER --model BASE --out DIR: a full checkpoint with the adapter folded in (on the CPU)."""
    from dgemma.dtypes import parse_dtype
    from dgemma.quant import parse_quantize
    from dgemma.train.checkpoint import generation_config
    from dgemma.train.lora import export_merged
    from dgemma.weights.compressed import check_out, save_compressed
    from dgemma.train.trainer import checkpoint_dir
    from dgemma.weights.hf import load_model, read_config

    apply_threads(args)
    adapter = Path(args.merge_adapter)
    base = args.model or _adapter_base(adapter)
    if not base:
        raise DgemmaError("--merge-adapter needs --model (the base checkpoint the adapter was trained on)")
    if not args.out:
        raise DgemmaError("--merge-adapter needs --out (where to write the merged checkpoint)")
    base_dir = checkpoint_dir(base)
    t = read_config(base_dir).text
    gen_cfg = generation_config(list(t.eos_token_id), t.pad_token_id, t.bos_token_id, base_dir=base_dir)
    dtype = parse_dtype(args.save_dtype or "float32", "save_dtype")
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else base_dir
    if not args.quantize:
        out = export_merged(base_dir, adapter, Path(args.out), tokenizer_dir, gen_cfg, dtype)
        print(json.dumps({"merged": str(out)}))
        return 0
    spec = parse_quantize(args.quantize)
    if not spec.requantizes or spec.int8_activations:
        raise DgemmaError(f"--quantize {args.quantize}: a merged checkpoint is written as int8, int4 or nvfp4")
    out = Path(args.out)
    check_out(out)
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        merged = export_merged(base_dir, adapter, Path(tmp) / "merged", tokenizer_dir, gen_cfg, dtype)
        save_compressed(load_model(merged, dtype, "cpu", spec), merged, out)
    print(json.dumps({"merged": str(out), "quantized": spec.name}))
    return 0


def _adapter_base(adapter: Path) -> str | None:
    """The base checkpoint an adapter names in its adapter_config.json (None when it has none)."""
    try:
        return read_json(adapter / "adapter_config.json").get("base_model_name_or_path")
    except DgemmaError:
        raise DgemmaError(f"{adapter}/adapter_config.json is not a valid adapter config; pass --model") from None


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m dgemma.train.command`), the same as `dgemma train`."""
    parser = argparse.ArgumentParser(prog="dgemma train", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except DgemmaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
