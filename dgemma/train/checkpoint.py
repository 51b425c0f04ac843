"""What the trainer writes: resumable training states and HF-layout model directories, both atomically.

Training states live in `out/checkpoints/step-NNNNNNN/` (trainable weights, optimizer, scheduler, RNG and data
position); `out/checkpoints/latest` names the newest complete one and is replaced with one rename, so an
interrupted save (Ctrl-C, a killed rank) leaves the previous state in force. One process writes
`trainable.safetensors` and the optimizer in `state.pt`; ranks under torchrun write `sharded/` together
(torch.distributed.checkpoint: weights and optimizer by name, each rank its shards), which loads on any number
of ranks, one process included. Exported models (`out/final/`, `out/adapter/`) are built in a
temporary directory and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dgemma.errors import ConfigError, DgemmaError
from dgemma.sampling.params import SamplingParams
from dgemma.jsonfile import read_json
from dgemma.weights.files import save_tensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model")
TRANSFORMERS_VERSION = "5.23.0"
# SamplingParams fields a generation_config.json carries (entropy_bound inside sampler_config)
GENERATION_KEYS = ("max_new_tokens", "max_denoising_steps", "t_min", "t_max", "stability_threshold",
                   "confidence_threshold", "entropy_bound")
# TrainConfig fields a training state must be resumed with
RESUME_KEYS = ("seed", "batch_size", "grad_accum", "canvases", "max_prompt", "lora", "lora_r", "lora_alpha",
               "lora_targets")


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
    tmp = _fresh_tmp(root, step)
    save_tensors({k: v.detach().cpu().contiguous() for k, v in weights.items()}, tmp / "trainable.safetensors")
    return _commit(root, tmp, extra, meta, keep)


def save_sharded_state(root: Path, step: int, state: dict[str, Any], extra: dict[str, Any], meta: dict[str, Any],
                       keep: int, par) -> Path:
    """save_state for the ranks of a process group: all write their shards of `state` (weights and optimizer, by
    name) into one temporary directory; the main rank then adds the small files and renames it into place."""
    import torch.distributed.checkpoint as dcp

    tmp = _fresh_tmp(root, step) if par.main else root / f"step-{step:07d}.tmp"
    par.barrier()
    _dcp(dcp.save, state, tmp / "sharded")
    par.barrier()  # every rank's shards are on disk
    path = _commit(root, tmp, extra, meta, keep) if par.main else root / tmp.name.removesuffix(".tmp")
    par.barrier()
    return path


def load_sharded_state(path: Path, state: dict[str, Any]) -> None:
    """Fill `state` (tensors of this run's shapes and sharding) from a sharded training state, in place."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(path / "sharded")).read_metadata().state_dict_metadata
    wanted = {k: v.shape for k, v in _flat_tensors(state).items()}
    have = {k: getattr(m, "size", None) for k, m in saved.items()}
    if bad := sorted(k for k, shape in wanted.items() if k not in have or tuple(have[k]) != tuple(shape)):
        raise DgemmaError(f"{path}: the saved training state does not fit this model / LoRA setup ({bad[0]}"
                          f"{' and more' if len(bad) > 1 else ''}); use another --out or --no-resume")
    _dcp(dcp.load, state, path / "sharded")


def _dcp(fn, state: dict[str, Any], path: Path) -> None:
    """dcp.save / dcp.load; one process (no process group) reads and writes too, without DCP's warning about it."""
    import warnings

    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def _flat_tensors(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """DCP's names for the tensors of a nested state dict (keys joined with dots)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def _fresh_tmp(root: Path, step: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"step-{step:07d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _commit(root: Path, tmp: Path, extra: dict[str, Any], meta: dict[str, Any], keep: int) -> Path:
    """Add the small files to a written state, rename it into place, point `latest` at it, drop old states."""
    name = tmp.name.removesuffix(".tmp")
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


def is_sharded(path: Path) -> bool:
    return (path / "sharded").is_dir()


def load_state(path: Path) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any], dict[str, Any]]:
    """(weights, extra, meta); weights are None for a sharded state (load_sharded_state reads those)."""
    weights = None if is_sharded(path) else load_file(str(path / "trainable.safetensors"))
    extra = torch.load(path / "state.pt", weights_only=False)
    meta = read_json(path / "state.json", required=True)
    return weights, extra, meta


def check_resumable(path: Path, meta: dict[str, Any], config: dict[str, Any]) -> None:
    """The data order, noise and trained weights of a state depend on these: resuming with others is no resume."""
    saved = meta.get("config", {})
    if differ := [k for k in RESUME_KEYS if k in saved and saved[k] != config[k]]:
        values = ", ".join(f"{k}={saved[k]!r} (now {config[k]!r})" for k in differ)
        raise DgemmaError(f"{path} was trained with {values}; use the same values, another --out or --no-resume")


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
