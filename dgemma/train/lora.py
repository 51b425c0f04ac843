"""LoRA through peft on dgemma's module tree.

The encoder and decoder are one stack of weights, so one adapter serves both. Linear layers are matched by
name suffix (`q_proj`, `mlp.up_proj`, ...); the experts' stacked 3D weights go through peft's `target_parameters`
(a rank-r update per expert). Adapters are saved in peft's format (`adapter_config.json`,
`adapter_model.safetensors`) with dgemma's module names, and merge into a plain `DiffusionGemma` on the CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dgemma.errors import DgemmaError
from dgemma.weights.files import readable


def _module_regex(model: torch.nn.Module, suffixes: list[str]) -> str:
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and any(n == s or n.endswith("." + s) for s in suffixes)]
    unmatched = [s for s in suffixes if not any(n == s or n.endswith("." + s) for n in names)]
    if unmatched:
        raise DgemmaError(f"LoRA target(s) {', '.join(unmatched)} match no linear layer of this model")
    return "^(" + "|".join(re.escape(n) for n in names) + ")$"


def apply_lora(model: torch.nn.Module, r: int, alpha: int, modules: list[str], parameters: list[str]):
    """Wrap `model` in place; returns the PeftModel (save / merge handle). Only adapter weights train."""
    from peft import LoraConfig, get_peft_model

    if not modules and not parameters:
        raise DgemmaError("LoRA needs at least one target")
    bad = [p for p in parameters if p not in ("experts.gate_up_proj", "experts.down_proj")]
    if bad:
        raise DgemmaError(f"unknown LoRA parameter target(s): {', '.join(bad)}")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                        target_modules=_module_regex(model, modules) if modules else [],
                        target_parameters=parameters or None)
    return get_peft_model(model, config)


def save_adapter(peft_model, directory: Path, base: str | None, state_dict: dict | None = None) -> None:
    """`state_dict`: the adapter's weights gathered from sharded ranks (default: the model's own)."""
    peft_model.peft_config["default"].base_model_name_or_path = base
    peft_model.save_pretrained(str(directory), state_dict=state_dict)
    readable(directory)


def merge_adapter(model: torch.nn.Module, adapter_dir: str | Path) -> torch.nn.Module:
    """Apply a saved adapter to `model` (a plain DiffusionGemma; quantized weights are dequantized first, so a
    quantized base merges in full precision) and fold it in; returns the plain model."""
    from peft import PeftModel

    dequantize_weights(model)
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise DgemmaError(f"{adapter_dir}: not a LoRA adapter directory (no adapter_config.json)")
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    except (ValueError, RuntimeError, KeyError, TypeError, AttributeError, OSError) as e:
        raise DgemmaError(f"{adapter_dir}: cannot apply the adapter to this model ({e})") from None
    return peft_model.merge_and_unload()


def dequantize_weights(model: torch.nn.Module) -> None:
    """Replace every quantized weight of `model` with a float parameter of its values (in its float dtype)."""
    from dgemma.weights.quantize import quantized_weights

    for name, weight in quantized_weights(model).items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        delattr(module, leaf)
        module.register_parameter(leaf, torch.nn.Parameter(weight.dequantize(), requires_grad=False))


def export_merged(base_dir: Path, adapter_dir: Path, out: Path, tokenizer_dir: Path | None,
                  gen_config: dict, dtype: torch.dtype) -> Path:
    """Fold a saved adapter into its base checkpoint, read afresh in float32 on the CPU, and export the result."""
    from dgemma.train.checkpoint import export_model
    from dgemma.weights import load_model

    model = merge_adapter(load_model(base_dir, dtype=torch.float32, device="cpu"), adapter_dir)
    return export_model(model, out, tokenizer_dir, gen_config, dtype)
