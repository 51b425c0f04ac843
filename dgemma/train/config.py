"""Training configuration: one typed dataclass, read from JSON / TOML and overridden by command-line flags."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dgemma.dtypes import NAMES, parse_dtype
from dgemma.errors import ConfigError

LORA_GROUPS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
    "experts": ["experts.gate_up_proj", "experts.down_proj"],
    "router": ["router.proj"],
    "self_conditioning": ["self_conditioning.gate_proj", "self_conditioning.up_proj",
                          "self_conditioning.down_proj"],
}
PARALLEL = ("fsdp", "ddp")  # how torchrun's ranks share the model (train/distributed.py)
BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class TrainConfig:
    # model: fine-tune a checkpoint, or train from scratch with an HF-style `config.json` dict
    model: str | None = None
    model_config: dict[str, Any] | None = None
    tokenizer: str | None = None  # default: the model checkpoint's tokenizer
    # data: .jsonl is chat ({"messages": [...]}), anything else plain text
    train_data: str = ""
    valid_data: str | None = None
    canvases: int = 4  # canvases per text window / at most per chat answer
    max_prompt: int = 64  # text: prompt = <bos> + up to max_prompt - 1 preceding tokens; chat: truncation
    # objective
    t_eps: float = 1e-3
    self_cond_prob: float = 0.5
    ar_weight: float = 1.0
    # optimisation (published fine-tuning settings as defaults)
    steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1.5e-4
    min_lr: float = 1.5e-5
    warmup: int = 25
    weight_decay: float = 1e-4
    betas: tuple[float, float] = (0.95, 0.99)
    adam_eps: float = 1e-8
    clip: float = 1.0
    precision: str = "auto"  # auto | float32 | bfloat16 (auto: bfloat16 where matmuls are native, else float32)
    init_std: float = 0.02  # from-scratch initialisation
    # LoRA (peft): targets are groups from LORA_GROUPS or module / parameter names
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: list[str] = field(default_factory=lambda: ["attention", "mlp"])
    quantize: str | None = None  # QLoRA: the frozen base quantized on load (int8 | int4, see dgemma.quant.spec)
    # bookkeeping
    out: str = "runs/train"
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None
    eval_every: int = 200
    eval_batches: int = 8
    save_every: int = 200
    save_minutes: float = 10.0
    keep_checkpoints: int = 2
    log_every: int = 10
    max_minutes: float | None = None  # stop (and export) after this much wall time
    save_dtype: str = "float32"  # dtype of the exported checkpoint
    generation: dict[str, Any] = field(default_factory=dict)  # generation_config.json overrides
    resume: bool = True
    # many devices (under torchrun; train/distributed.py) and activation memory
    parallel: str = "fsdp"  # fsdp: shard weights, gradients, optimizer | ddp: replicate (LoRA with a base that fits)
    backend: str = "auto"  # auto: nccl on cuda, gloo on cpu
    activation_checkpointing: bool = False  # rerun each layer in backward instead of keeping its activations

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        self.check()

    def check(self) -> None:
        self._check_sources()
        self._check_numbers()
        from dgemma.train.checkpoint import sampling_params

        sampling_params({}, self.generation)  # bad generation overrides fail now, not at the export

    def _check_sources(self) -> None:
        """What is trained on what: data, model or config + tokenizer, LoRA / QLoRA combinations."""
        if not self.train_data:
            raise ConfigError("no training data: give --data (train_data in a config file): a text file or a .jsonl "
                              "chat file")
        if self.model is None and self.model_config is None:
            raise ConfigError("nothing to train: give --model (a checkpoint to fine-tune: a directory, a repo id or "
                              "demo), or --config with a file whose model_config describes a new model "
                              "(configs/demo.json)")
        if self.model is not None and self.model_config is not None:
            raise ConfigError("the config sets both model (a checkpoint to fine-tune) and model_config (a new model "
                              "from scratch): keep one (--model replaces the file's model_config)")
        if self.model_config is not None and self.tokenizer is None:
            raise ConfigError("training from scratch needs --tokenizer (tokenizer in a config file): a directory with "
                              "tokenizer.json")
        if self.lora and self.model is None:
            raise ConfigError("lora needs model (the checkpoint the adapter is trained on and merged into)")
        if self.quantize is not None:
            from dgemma.quant.spec import parse_quantize

            if parse_quantize(self.quantize).int8_activations:
                raise ConfigError("quantize: +a8 (int8 activations) is for inference; train with int8, int4 or nvfp4")
            if not self.lora:
                raise ConfigError("quantize needs lora: a quantized base is frozen, only adapters train (QLoRA)")
            if any(t == "experts" or t.startswith("experts.") for t in self.lora_targets):
                raise ConfigError("LoRA on experts needs float expert weights: drop experts from lora_targets "
                                  "or drop quantize")

    def _check_numbers(self) -> None:
        optional = ("threads",) if self.threads is not None else ()  # unset: torch's choice
        for name in ("steps", "batch_size", "grad_accum", "canvases", "max_prompt", "lora_r", "eval_batches",
                     "keep_checkpoints", "log_every", *optional):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        for name in ("warmup", "eval_every", "save_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a non-negative integer (0 disables)")
        if not 0 < self.t_eps < 0.5:
            raise ConfigError(f"t_eps={self.t_eps} must be in (0, 0.5)")
        if not 0 <= self.self_cond_prob <= 1:
            raise ConfigError(f"self_cond_prob={self.self_cond_prob} must be in [0, 1]")
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"need lr > 0 and 0 <= min_lr <= lr (got lr={self.lr}, min_lr={self.min_lr})")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas={self.betas} must be two numbers in [0, 1)")
        if self.precision not in ("auto", *NAMES):
            raise ConfigError(f"precision={self.precision!r} must be one of auto, {', '.join(NAMES)}")
        parse_dtype(self.save_dtype, "save_dtype")
        if self.parallel not in PARALLEL or self.backend not in BACKENDS:
            raise ConfigError(f"parallel={self.parallel!r} must be one of {', '.join(PARALLEL)} and "
                              f"backend={self.backend!r} one of {', '.join(BACKENDS)}")
        if self.ar_weight < 0 or self.clip < 0 or self.weight_decay < 0:
            raise ConfigError("ar_weight, clip and weight_decay must be >= 0")

    def lora_target_names(self) -> tuple[list[str], list[str]]:
        """(module name suffixes, 3D parameter names) for peft."""
        names = [n for t in self.lora_targets for n in LORA_GROUPS.get(t, [t])]
        params = [n for n in names if n.startswith("experts.")]
        return [n for n in names if n not in params], params

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    toml = _toml() if path.suffix == ".toml" else None
    try:
        data = toml.loads(text) if toml else json.loads(text)
    except (json.JSONDecodeError, ValueError) as e:  # TOMLDecodeError is a ValueError
        raise ConfigError(f"{path}: invalid {'TOML' if toml else 'JSON'} ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table / object at the top level")
    return data


def _toml():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError("TOML config files need Python 3.11+ or the tomli package; use JSON") from None
    return tomllib


def make_config(values: dict[str, Any]) -> TrainConfig:
    """TrainConfig from a dict; unknown keys are an error. Relative paths are relative to the working directory."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    if unknown := sorted(set(values) - known):
        raise ConfigError(f"unknown training option(s): {', '.join(unknown)}")
    try:
        return TrainConfig(**values)
    except TypeError as e:
        raise ConfigError(f"bad training option: {e}") from None
