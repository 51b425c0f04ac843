"""Train the quality harness checkpoint: a small DiffusionGemma from scratch on the exactly-checkable tasks of
tasks.py, with dgemma's own trainer and objective, on the CPU in bounded time. Rerunning the same command resumes
from the last training state in --out (written every few minutes). Weights go to --out, never into the repository.

    OMP_NUM_THREADS=1 nice python benchmarks/quality/train.py --out runs/quality   # last stdout line JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tasks  # noqa: E402
from dgemma.api import DEMO_MODEL  # noqa: E402
from dgemma.errors import DgemmaError  # noqa: E402

# a 4-layer body on the bundled model's tokenizer (4,096 tokens), canvas 10 (the short harness's): every answer fits
# one canvas; model_config gives another harness its canvas
MODEL_CONFIG = {
    "canvas_length": tasks.SHORT.canvas,
    "text_config": {
        "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": 64, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 64,
        "max_position_embeddings": 512, "pad_token_id": 0, "eos_token_id": [1, 5], "bos_token_id": 2,
    },
}
# the checkpoint's decoding defaults (its generation_config.json; max_new_tokens: one canvas), the bundled model's
# schedule
GENERATION = {"max_denoising_steps": 32, "entropy_bound": 1.0, "t_max": 0.6, "t_min": 0.3}


def model_config(size: tasks.Sizes) -> dict:
    """MODEL_CONFIG with the harness's canvas; a sliding window that sees a long prompt and its canvas whole."""
    if size == tasks.SHORT:
        return MODEL_CONFIG
    text = MODEL_CONFIG["text_config"] | {"sliding_window": 128}
    return MODEL_CONFIG | {"canvas_length": size.canvas, "text_config": text}


def train_config(args: argparse.Namespace, data: Path) -> dict:
    size = tasks.HARNESSES[args.harness]
    return {
        "model_config": model_config(size), "tokenizer": str(DEMO_MODEL),
        "train_data": str(data / "train.jsonl"), "valid_data": str(data / "valid.jsonl"),
        "canvases": 1, "max_prompt": 64, "steps": args.steps, "batch_size": args.batch_size,
        "lr": args.lr, "min_lr": args.lr / 10, "warmup": 50, "weight_decay": 0.1, "precision": "float32",
        "out": str(args.out), "seed": args.seed, "threads": args.threads, "eval_every": 250, "eval_batches": 4,
        "save_every": 0, "save_minutes": args.save_minutes, "log_every": 25, "max_minutes": args.max_minutes,
        "save_dtype": "float32", "generation": GENERATION | {"max_new_tokens": size.canvas},
    }


def write_data(directory: Path, n_train: int, size: tasks.Sizes, names: tuple[str, ...] = tuple(tasks.TASKS)) -> None:
    """train.jsonl / valid.jsonl (chat form) of the tasks `names`, rewritten identically on every run (the same
    seeds)."""
    train = tasks.examples(n_train, tasks.TRAIN_SEED, names, size)
    tasks.write_jsonl(directory / "train.jsonl", train)
    valid = tasks.held_out(256, tasks.VALID_SEED, {e.prompt for e in train}, names, size)
    tasks.write_jsonl(directory / "valid.jsonl", valid)


def _task_list(text: str) -> tuple[str, ...]:
    try:
        return tasks.parse_tasks(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/quality"), help="run directory (final/ is the model)")
    p.add_argument("--harness", choices=tuple(tasks.HARNESSES), default="short",
                   help="the tasks' sizes: short (canvas 10, ~5-token answers) or long (canvas 32, 5-20-token answers)")
    p.add_argument("--steps", type=int, default=10000, help="optimizer steps (the cosine schedule's length)")
    p.add_argument("--max-minutes", type=float, default=120.0, help="stop and export after this much training time")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--train-examples", type=int, default=tasks.TRAIN_EXAMPLES)
    p.add_argument("--tasks", type=_task_list, default=tuple(tasks.TASKS),
                   help=f"comma-separated tasks to learn (default: all of {', '.join(tasks.TASKS)}); evaluate.py "
                   "scores the ones the checkpoint records")
    p.add_argument("--save-minutes", type=float, default=3.0, help="a resumable training state at least this often")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from dgemma.train.config import make_config
    from dgemma.train.trainer import train

    try:
        write_data(args.out / "data", args.train_examples, tasks.HARNESSES[args.harness], args.tasks)
        final = train(make_config(train_config(args, args.out / "data")), progress=False)
        tasks.write_harness(Path(final), args.harness, args.train_examples, args.tasks)
    except DgemmaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log = [json.loads(line) for line in (args.out / "log.jsonl").read_text().splitlines()]
    evals = [r for r in log if "eval_diffusion" in r]
    print(json.dumps({"final": str(final), "steps": log[-1]["step"] if log else None,
                      "elapsed": max((r.get("elapsed", 0) for r in log), default=0),
                      "last_eval": evals[-1] if evals else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
