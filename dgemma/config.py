"""Typed model configuration. The Hugging Face `config.json` enters in one place: `ModelConfig.from_hf`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dgemma.errors import ConfigError

SLIDING, FULL = "sliding_attention", "full_attention"
MODEL_TYPES = ("diffusion_gemma", "diffusion_gemma4")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    partial_rotary_factor: float = 1.0
    rope_type: str = "default"


@dataclass(frozen=True)
class LayerSpec:
    """What differs between layers: attention kind, head size and kv heads."""

    sliding: bool
    head_dim: int
    num_kv_heads: int


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    layer_types: tuple[str, ...] = ()
    per_layer: dict[int, dict[str, int]] = field(default_factory=dict)
    sliding_window: int = 512
    num_experts: int = 8
    top_k_experts: int = 2
    moe_intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0
    rope_sliding: RopeConfig = RopeConfig(10_000.0)
    rope_full: RopeConfig = RopeConfig(1_000_000.0, 0.25, "proportional")
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    pad_token_id: int = 0
    eos_token_id: tuple[int, ...] = (1,)
    bos_token_id: int = 2

    def __post_init__(self) -> None:
        if not self.layer_types:
            types = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        types = list(self.layer_types)
        types[-1] = FULL  # the reference forces the last layer to full attention
        object.__setattr__(self, "layer_types", tuple(types))
        self._check()

    def _check(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "sliding_window", "num_experts", "top_k_experts",
                    "moe_intermediate_size", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config value {name}={value!r} must be a positive integer")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries, expected num_hidden_layers="
                              f"{self.num_hidden_layers}")
        if bad := set(self.layer_types) - {SLIDING, FULL}:
            raise ConfigError(f"unsupported layer type(s) {sorted(bad)}")
        if self.top_k_experts > self.num_experts:
            raise ConfigError(f"top_k_experts={self.top_k_experts} exceeds num_experts={self.num_experts}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu"):
            raise ConfigError(f"unsupported hidden_activation {self.hidden_activation!r}")
        for i in range(self.num_hidden_layers):
            spec = self.layer(i)
            if spec.head_dim <= 0 or spec.num_kv_heads <= 0 or self.num_attention_heads % spec.num_kv_heads:
                raise ConfigError(f"layer {i}: num_attention_heads={self.num_attention_heads} is not a multiple "
                                  f"of its kv heads ({spec.num_kv_heads})")
        for rope in (self.rope_sliding, self.rope_full):
            if not rope.theta > 0 or not 0 < rope.partial_rotary_factor <= 1:
                raise ConfigError(f"rope parameters out of range: {rope}")

    def layer(self, i: int) -> LayerSpec:
        over = self.per_layer.get(i, {})
        return LayerSpec(
            sliding=self.layer_types[i] == SLIDING,
            head_dim=over.get("head_dim", self.head_dim),
            num_kv_heads=over.get("num_key_value_heads", self.num_key_value_heads),
        )

    def rope(self, sliding: bool) -> RopeConfig:
        return self.rope_sliding if sliding else self.rope_full


@dataclass(frozen=True)
class VisionConfig:
    """Gemma 4's vision tower (`vision_config`, model_type gemma4_vision): patches of `patch_size` pixels, a
    bidirectional encoder with 2D RoPE, average pooling of `pooling_kernel_size`^2 patches into one soft token."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    hidden_activation: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "patch_size", "pooling_kernel_size",
                     "position_embedding_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"vision_config value {name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 4:
            raise ConfigError("vision_config: heads must be a multiple of kv heads and head_dim of 4 (2D RoPE)")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu"):
            raise ConfigError(f"unsupported vision hidden_activation {self.hidden_activation!r}")


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    canvas_length: int = 256
    image_token_id: int = 258_880
    vision: VisionConfig | None = None  # None: the checkpoint has no vision tower (text prompts only)
    boi_token_id: int | None = 255_999  # wrap each image's soft tokens (None: not wrapped)
    eoi_token_id: int | None = 258_882
    # text_config.use_bidirectional_attention == "vision": the soft tokens of one image see each other
    bidirectional_vision: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.canvas_length, int) or not 0 < self.canvas_length <= 65_536:
            raise ConfigError(f"canvas_length={self.canvas_length!r} must be an integer in 1..65536")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (model_type diffusion_gemma or its alias)."""
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {model_type!r}; dgemma loads {' or '.join(MODEL_TYPES)}")
        if hf.get("tie_word_embeddings", True) is False:
            raise ConfigError("tie_word_embeddings=false (untied encoder/decoder) is not supported")
        text = dict(hf.get("text_config") or {})
        return cls(
            text=_text_from_hf(text),
            canvas_length=hf.get("canvas_length", 256),
            image_token_id=hf.get("image_token_id", 258_880),
            vision=_vision_from_hf(hf.get("vision_config")),
            boi_token_id=hf.get("boi_token_id", 255_999),
            eoi_token_id=hf.get("eoi_token_id", 258_882),
            bidirectional_vision=text.get("use_bidirectional_attention") == "vision",
        )

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict the reference implementation reads back."""
        t = self.text
        return {
            "architectures": ["DiffusionGemmaForBlockDiffusion"],
            "model_type": "diffusion_gemma",
            "canvas_length": self.canvas_length,
            "image_token_id": self.image_token_id,
            "boi_token_id": self.boi_token_id,
            "eoi_token_id": self.eoi_token_id,
            "tie_word_embeddings": True,
            "vision_config": _vision_to_hf(self.vision),
            "text_config": {
                "model_type": "diffusion_gemma_text",
                "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
                "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_hidden_layers,
                "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
                "head_dim": t.head_dim, "layer_types": list(t.layer_types),
                "per_layer_config": {str(k): v for k, v in t.per_layer.items()},
                "sliding_window": t.sliding_window, "num_experts": t.num_experts,
                "top_k_experts": t.top_k_experts, "moe_intermediate_size": t.moe_intermediate_size,
                "rms_norm_eps": t.rms_norm_eps, "hidden_activation": t.hidden_activation,
                "max_position_embeddings": t.max_position_embeddings,
                "rope_parameters": {SLIDING: _rope_to_hf(t.rope_sliding), FULL: _rope_to_hf(t.rope_full)},
                "pad_token_id": t.pad_token_id, "eos_token_id": list(t.eos_token_id),
                "bos_token_id": t.bos_token_id, "tie_word_embeddings": True,
                "use_bidirectional_attention": "vision" if self.bidirectional_vision else None,
            },
        }


def _vision_to_hf(v: VisionConfig | None) -> dict[str, Any]:
    """Without a tower, a minimal one keeps the reference from building a full-size one (its weights unsaved)."""
    if v is None:
        return {"model_type": "gemma4_vision", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8}
    out: dict[str, Any] = {k: getattr(v, k) for k in VisionConfig.__dataclass_fields__ if k != "rope_theta"}
    return {"model_type": "gemma4_vision", **out,
            "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}


def _vision_from_hf(v: dict[str, Any] | None) -> VisionConfig | None:
    if not v:
        return None
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"unsupported vision rope_type {rope.get('rope_type')!r} (Gemma 4 uses axial)")
    kwargs = {k: v[k] for k in VisionConfig.__dataclass_fields__ if k in v and v[k] is not None}
    kwargs["rope_theta"] = float(rope.get("rope_theta", VisionConfig.rope_theta))
    try:
        return VisionConfig(**kwargs)
    except TypeError as e:
        raise ConfigError(f"bad vision_config: {e}") from None


def _rope_to_hf(r: RopeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = r.partial_rotary_factor
    return out


def _rope_from_hf(d: dict[str, Any] | None, default: RopeConfig) -> RopeConfig:
    if not d:
        return default
    rope_type = d.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ConfigError(f"unsupported rope_type {rope_type!r}")
    factor = float(d.get("partial_rotary_factor", 1.0))
    if rope_type == "default" and factor != 1.0:
        raise ConfigError("partial_rotary_factor is only supported with proportional RoPE")
    if float(d.get("factor", 1.0)) != 1.0:
        raise ConfigError("RoPE scaling 'factor' is not supported")
    return RopeConfig(float(d.get("rope_theta", default.theta)), factor, rope_type)


def _text_from_hf(t: dict[str, Any]) -> TextConfig:
    if t.get("use_bidirectional_attention") == "all":
        raise ConfigError("use_bidirectional_attention='all' (bidirectional encoder) is not supported")
    base = TextConfig.__dataclass_fields__
    kwargs = {k: t[k] for k in base if k in t and t[k] is not None and k not in ("layer_types", "eos_token_id")}
    n_layers = t.get("num_hidden_layers", base["num_hidden_layers"].default)
    if "layer_types" in t and t["layer_types"]:
        kwargs["layer_types"] = tuple(t["layer_types"])
    else:
        kwargs["layer_types"] = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n_layers))
    kwargs["per_layer"] = _per_layer_from_hf(t, kwargs["layer_types"])
    eos = t.get("eos_token_id", 1)
    kwargs["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    rope = t.get("rope_parameters") or {}
    kwargs["rope_sliding"] = _rope_from_hf(rope.get(SLIDING), TextConfig.rope_sliding)
    kwargs["rope_full"] = _rope_from_hf(rope.get(FULL), TextConfig.rope_full)
    kwargs.pop("final_logit_softcapping", None)
    if t.get("final_logit_softcapping") is not None:
        kwargs["final_logit_softcapping"] = float(t["final_logit_softcapping"])
    try:
        return TextConfig(**kwargs)
    except TypeError as e:
        raise ConfigError(f"bad text_config: {e}") from None


def _per_layer_from_hf(t: dict[str, Any], layer_types: tuple[str, ...]) -> dict[int, dict[str, int]]:
    """Per-layer overrides; without `per_layer_config`, full layers use global_head_dim (default 512)."""
    types = list(layer_types)
    types[-1] = FULL
    if "per_layer_config" in t and t["per_layer_config"] is not None:
        raw = t["per_layer_config"]
        return {int(k): {n: int(v) for n, v in d.items() if n in ("head_dim", "num_key_value_heads")}
                for k, d in raw.items()}
    over = {"head_dim": int(t.get("global_head_dim", 512))}
    if t.get("num_global_key_value_heads") is not None:
        over["num_key_value_heads"] = int(t["num_global_key_value_heads"])
    return {i: dict(over) for i, kind in enumerate(types) if kind == FULL}
