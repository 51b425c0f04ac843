"""What the trainer writes: resumable training states and HF-layout model directories, both atomically.

Training states live in `out/checkpoints/step-NNNNNNN/` (trainable weights, optimizer, scheduler, RNG and data
position); `out/checkpoints/latest` names the newest complete one and is replaced with one rename, so an
interrupted save leaves the previous state in force. Exported models (`out/final/`, `out/adapter/`) are built in a
temporary directory and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dgemma.errors import ConfigError, DgemmaError
from dgemma.sampling.params import SamplingParams
from dgemma.jsonfile import read_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model")
TRANSFORMERS_VERSION = "5.23.0"
# SamplingParams fields a generation_config.json carries (entropy_bound inside sampler_config)
GENERATION_KEYS = ("max_new_tokens", "max_denoising_steps", "t_min", "t_max", "stability_threshold",
                   "confidence_threshold", "entropy_bound")


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished directory into place; the old one is removed only after the new one is there."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def save_state(root: Path, step: int, weights: dict[str, torch.Tensor], extra: dict[str, Any],
               meta: dict[str, Any], keep: int) -> Path:
    """Write one training state and point `latest` at it; keep the newest `keep` states."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    tmp = root / (name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(tmp / "trainable.safetensors"))
    torch.save(extra, tmp / "state.pt")
    (tmp / "state.json").write_text(json.dumps(meta, indent=2) + "\n")
    replace_dir(tmp, root / name)
    write_text_atomic(root / "latest", name + "\n")
    states = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith((".tmp", ".old")))
    for stale in states[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return root / name


def latest_state(root: Path) -> Path | None:
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "state.pt").is_file():
        raise DgemmaError(f"{pointer} names {path.name}, which is incomplete; remove {pointer} to start over")
    return path


def load_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    weights = load_file(str(path / "trainable.safetensors"))
    extra = torch.load(path / "state.pt", weights_only=False)
    meta = read_json(path / "state.json", required=True)
    return weights, extra, meta


def sampling_params(base: dict[str, Any], overrides: dict[str, Any]) -> SamplingParams:
    """A base generation_config.json dict ({} for the defaults) with `overrides` (GENERATION_KEYS) applied."""
    if unknown := sorted(set(overrides) - set(GENERATION_KEYS)):
        raise ConfigError(f"generation: unknown key(s) {', '.join(unknown)} (known: {', '.join(GENERATION_KEYS)})")
    return SamplingParams.from_generation_config(base).replace(**overrides)


def generation_config(eos_ids: list[int], pad: int, bos: int, overrides: dict[str, Any] | None = None,
                      base_dir: Path | None = None) -> dict[str, Any]:
    """generation_config.json in the reference's format (sampler_config carries its dataclass name): sampling
    values from SamplingParams (defaults, or the base checkpoint's file) with `overrides`; the base file's other
    keys are kept."""
    base = read_json(base_dir / "generation_config.json") if base_dir else {}
    params = sampling_params(base, overrides or {})
    cfg = {k: v for k, v in base.items() if k not in ("sampler_config", "transformers_version")}
    cfg.update({k: getattr(params, k) for k in GENERATION_KEYS if k != "entropy_bound"})
    cfg.update({"bos_token_id": bos, "pad_token_id": pad, "eos_token_id": eos_ids})
    cfg["sampler_config"] = {"entropy_bound": params.entropy_bound, "_cls_name": "EntropyBoundSamplerConfig"}
    cfg["transformers_version"] = TRANSFORMERS_VERSION
    return cfg


def export_model(model, directory: Path, tokenizer_dir: Path | None, gen_config: dict[str, Any],
                 dtype: torch.dtype | None) -> Path:
    """HF-layout checkpoint: config.json, model.safetensors, generation_config.json and the tokenizer files."""
    from dgemma.weights import save_model

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_model(model, tmp, dtype=dtype)
    (tmp / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
    replace_dir(tmp, directory)
    return directory
