"""GGUF files of llama.cpp's `diffusion-gemma` architecture: model config, sampler defaults and weights.

The layout is what llama.cpp's converter (`conversion/diffusion_gemma.py`) writes: the Gemma 4 backbone under
llama.cpp's names (`blk.N.attn_q.weight`, ...), the encoder's layer scalars as `blk.N.enc_layer_output_scale`,
the self-conditioning MLP as `self_cond_*`, the router's per-expert scale as `blk.N.ffn_down_exps.scale`, the
proportional RoPE of full layers as a `rope_freqs` tensor (1 for rotated pairs, 1e30 for the rest), and the keys
`diffusion.canvas_length` and `diffusion.eb_*` (the entropy-bound sampler's defaults). Files are read with the `gguf`
package, the format's own library; the tokenizer they carry is rebuilt in `gguf_vocab.py`, the model built in
`gguf_load.py`; the header is parsed in `gguf_header.py` (fast on a 262,144-token vocabulary).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dgemma.config import FULL, SLIDING, ModelConfig, RopeConfig, TextConfig
from dgemma.errors import CheckpointError, ConfigError
from dgemma.weights.gguf_header import Header

log = logging.getLogger(__name__)

ARCH = "diffusion-gemma"
SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
_REQUIRED = object()

# dgemma parameter (under layers.N.) -> GGUF tensor (under blk.N.)
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "layer_scalar": "layer_output_scale.weight",
    "encoder_layer_scalar": "enc_layer_output_scale.weight",
}
_GLOBAL = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "self_conditioning.pre_norm.weight": "self_cond_pre_norm.weight",
    "self_conditioning.gate_proj.weight": "self_cond_gate.weight",
    "self_conditioning.up_proj.weight": "self_cond_up.weight",
    "self_conditioning.down_proj.weight": "self_cond_down.weight",
}
ROPE_FREQS = "rope_freqs.weight"
# Older files (and the loader) may store the expert stack as separate gate and up tensors.
_SPLIT_EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight")


def is_gguf(path: str | Path) -> bool:
    """A file that starts with the GGUF magic."""
    path = Path(path).expanduser()
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_sources(param: str, names: set[str]) -> list[str]:
    """The GGUF tensors a dgemma parameter is read from (two for a gate/up expert stack stored split)."""
    if param in _GLOBAL:
        return [_GLOBAL[param]]
    _, layer, rest = param.split(".", 2)
    fused = f"blk.{layer}.{_BLOCK[rest]}"
    if rest == "experts.gate_up_proj" and fused not in names:
        return [f"blk.{layer}.{part}" for part in _SPLIT_EXPERTS]
    return [fused]


class GGUFFile:
    """An opened (memory-mapped) GGUF file of the diffusion-gemma architecture."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.header = Header(self.path)
        self.fields, self.tensors = self.header.fields, self.header.tensors
        arch = self.value("general.architecture", None)
        if arch != ARCH:
            raise CheckpointError(f"{self.path.name}: GGUF architecture {arch!r} is not {ARCH!r} "
                                  "(dgemma reads DiffusionGemma GGUF files)")

    def value(self, key: str, default: Any = _REQUIRED) -> Any:
        if key not in self.fields:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.path.name}: missing GGUF key {key}")
            return default
        return self.fields[key]

    def arch(self, key: str, default: Any = _REQUIRED) -> Any:
        return self.value(f"{ARCH}.{key}", default)

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy / torch order (GGUF lists dimensions innermost first)."""
        return self.tensors[name].shape

    def type_name(self, name: str) -> str:
        return self.tensors[name].type_name

    # ---- configuration ----------------------------------------------------------------------------------------
    def config(self) -> ModelConfig:
        n = int(self.arch("block_count"))
        sliding = self.arch("attention.sliding_window_pattern")
        if not isinstance(sliding, list) or len(sliding) != n:
            raise CheckpointError(f"{self.path.name}: {ARCH}.attention.sliding_window_pattern must list "
                                  f"{n} layers")
        types = tuple(SLIDING if s else FULL for s in sliding)
        kv = self.arch("attention.head_count_kv")
        kv = list(kv) if isinstance(kv, list) else [kv] * n
        head_swa, head_full = int(self.arch("attention.key_length_swa")), int(self.arch("attention.key_length"))
        first_sliding = next((i for i, t in enumerate(types) if t == SLIDING), 0)
        per_layer = {i: {"head_dim": head_full if t == FULL else head_swa, "num_key_value_heads": int(kv[i])}
                     for i, t in enumerate(types) if t == FULL or kv[i] != kv[first_sliding]}
        eos = self.end_token_ids()
        embedding = _GLOBAL["embed_tokens.weight"]
        if embedding not in self.tensors:
            raise CheckpointError(f"{self.path.name}: missing tensor {embedding}")
        try:
            text = TextConfig(
                vocab_size=self.shape(embedding)[0],
                hidden_size=int(self.arch("embedding_length")), intermediate_size=int(self.arch("feed_forward_length")),
                num_hidden_layers=n, num_attention_heads=int(self.arch("attention.head_count")),
                num_key_value_heads=int(kv[first_sliding]), head_dim=head_swa, layer_types=types, per_layer=per_layer,
                sliding_window=int(self.arch("attention.sliding_window")), num_experts=int(self.arch("expert_count")),
                top_k_experts=int(self.arch("expert_used_count")),
                moe_intermediate_size=int(self.arch("expert_feed_forward_length")),
                rms_norm_eps=float(self.arch("attention.layer_norm_rms_epsilon")),
                final_logit_softcapping=float(self.arch("final_logit_softcapping", 30.0)),
                rope_sliding=RopeConfig(float(self.arch("rope.freq_base_swa", 10_000.0))),
                rope_full=RopeConfig(float(self.arch("rope.freq_base")), self._partial_rotary(head_full),
                                     "proportional"),
                max_position_embeddings=int(self.arch("context_length")),
                pad_token_id=int(self.value("tokenizer.ggml.padding_token_id", 0)),
                eos_token_id=tuple(eos) or (1,), bos_token_id=int(self.value("tokenizer.ggml.bos_token_id", 2)))
            return ModelConfig(text=text, canvas_length=int(self.value("diffusion.canvas_length")))
        except ConfigError as e:
            raise CheckpointError(f"{self.path.name}: {e}") from None

    def _partial_rotary(self, head_dim: int) -> float:
        """Full layers rotate the pairs whose `rope_freqs` factor is 1 (the converter writes 1e30 for the rest)."""
        if ROPE_FREQS not in self.tensors:
            raise CheckpointError(f"{self.path.name}: missing tensor {ROPE_FREQS} (the full layers' RoPE)")
        freqs = self.read(ROPE_FREQS, torch.float32, torch.device("cpu"))
        if freqs.numel() != head_dim // 2:
            raise CheckpointError(f"{self.path.name}: {ROPE_FREQS} has {freqs.numel()} entries, expected "
                                  f"{head_dim // 2} (half the full layers' head size)")
        return 2 * int((freqs == 1).sum()) / head_dim

    def end_token_ids(self) -> list[int]:
        """eos / eot / eom ids, and the Gemma 4 end-of-turn tokens llama.cpp also stops at."""
        ids = [self.value(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
        tokens = self.value("tokenizer.ggml.tokens", None) or []
        ends = {"<eos>", "<end_of_turn>", "<turn|>", "<|tool_response>"}
        ids += [i for i, t in enumerate(tokens) if t in ends]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def generation_config(self) -> dict[str, Any]:
        """The sampler defaults in `generation_config.json` form (SamplingParams.from_generation_config reads it)."""
        keys = {"max_denoising_steps": "eb_max_steps", "t_min": "eb_t_min", "t_max": "eb_t_max",
                "stability_threshold": "eb_stability_threshold", "confidence_threshold": "eb_confidence_threshold"}
        out: dict[str, Any] = {k: self.value(f"diffusion.{v}", None) for k, v in keys.items()}
        out["sampler_config"] = {"entropy_bound": self.value("diffusion.eb_entropy_bound", None)}
        out["eos_token_id"] = self.end_token_ids() or None
        return out

    # ---- tensors -------------------------------------------------------------------------------------------------
    def read(self, name: str, dtype: torch.dtype, device: torch.device, rows: slice = slice(None)) -> torch.Tensor:
        """Rows `rows` of dim 0 of tensor `name` dequantised by `gguf` (the format's reference), in `dtype`,
        a few MB at a time: no float copy of the whole tensor exists besides the result."""
        from gguf import dequantize

        from gguf import GGMLQuantizationType

        t = self.tensors[name]
        shape = self.shape(name)
        data = t.data[rows]
        lead = data.shape[:len(shape) - 1] if len(shape) > 1 else ()
        out = torch.empty(*lead, shape[-1], dtype=dtype, device=device)
        flat_in, flat_out = data.reshape(-1, data.shape[-1]), out.view(-1, shape[-1])
        step = max(1, (8 << 20) // max(1, flat_in.shape[1]))
        for lo in range(0, flat_in.shape[0], step):
            block = dequantize(flat_in[lo:lo + step], GGMLQuantizationType(t.type_id))
            block = torch.from_numpy(np.require(block, requirements="CW"))
            flat_out[lo:lo + step] = block.to(device=device, dtype=dtype)
        return out

    def check_tensors(self, params: list[str]) -> dict[str, list[str]]:
        """param -> its GGUF source tensors, after the one-line checks: every source present with a supported type,
        nothing unexpected in the file."""
        names = set(self.tensors)
        sources = {p: gguf_sources(p, names) for p in params}
        wanted = {s for srcs in sources.values() for s in srcs} | {ROPE_FREQS}
        for param, srcs in sources.items():
            for s in srcs:
                if s not in names:
                    raise CheckpointError(f"{self.path.name}: missing tensor {s} (dgemma's {param})")
        for name in self.tensors:
            if name not in wanted:
                raise CheckpointError(f"{self.path.name}: unexpected tensor {name} in a {ARCH} GGUF file")
            if self.type_name(name) not in SUPPORTED:
                raise CheckpointError(f"{self.path.name}: tensor {name} has type {self.type_name(name)}; dgemma reads "
                                      f"{', '.join(SUPPORTED)}")
        return sources
