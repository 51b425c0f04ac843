"""Test helper: write a dgemma / Hugging Face checkpoint as a GGUF file in the layout of llama.cpp's converter.

The names, key set and types follow what llama.cpp's `convert_hf_to_gguf.py` (its `DiffusionGemmaModel` on the
Gemma 4 tensor map) writes for a DiffusionGemma checkpoint, written here with the `gguf` package's GGUFWriter. The
map below is written from the converter's output, independently of dgemma's reader. k-quant types, which `gguf`
cannot quantize, are filled with random blocks (finite scales): their exact values come from `gguf`'s dequantiser.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quantize
from gguf.constants import GGML_QUANT_SIZES

ARCH = "diffusion-gemma"

# HF name (without "model.decoder.") -> GGUF name, as llama.cpp's converter maps them; {i} is the layer.
LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight", "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight", "experts.down_proj": "ffn_down_exps.weight",
    "layer_scalar": "layer_output_scale.weight",
}
GLOBAL_MAP = {
    "embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
    "self_conditioning.pre_norm.weight": "self_cond_pre_norm.weight",
    "self_conditioning.gate_proj.weight": "self_cond_gate.weight",
    "self_conditioning.up_proj.weight": "self_cond_up.weight",
    "self_conditioning.down_proj.weight": "self_cond_down.weight",
}
TOKEN_TYPES = {"normal": 1, "control": 3, "user_defined": 4, "byte": 6}


def gguf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (model.decoder.* and the encoder's layer scalars) -> GGUF name -> tensor."""
    out = {}
    for name, t in state.items():
        if name.startswith("model.encoder.language_model.layers."):
            i = name.split(".")[4]
            out[f"blk.{i}.enc_layer_output_scale.weight"] = t
            continue
        rest = name.removeprefix("model.decoder.")
        if rest in GLOBAL_MAP:
            out[GLOBAL_MAP[rest]] = t
        elif rest.startswith("layers."):
            _, i, tail = rest.split(".", 2)
            out[f"blk.{i}.{LAYER_MAP[tail]}"] = t
        else:
            raise KeyError(name)
    return out


def encode(t: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Tensor data for GGUFWriter: quantized by `gguf` where it can, random valid k-quant blocks otherwise."""
    if qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
        return quantize(t.astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    rows = t.reshape(-1, t.shape[-1])
    raw = rng.integers(0, 256, size=(rows.shape[0], t.shape[-1] // block, size), dtype=np.uint8)
    scale = np.float16(float(np.abs(rows).max()) / 64)
    # the f16 super-block scales: d, dmin at the start (Q4_K, Q5_K), d at the end (Q6_K)
    spots = [0, 2] if qtype in (Q.Q4_K, Q.Q5_K) else [size - 2]
    for at in spots:
        raw[..., at:at + 2] = np.frombuffer(scale.tobytes(), np.uint8)
    if qtype == Q.Q6_K:  # int8 sub-block scales: keep them small
        raw[..., size - 18:size - 2] = rng.integers(-4, 5, size=raw[..., size - 18:size - 2].shape).astype(np.uint8)
    return raw.reshape(*t.shape[:-1], -1)


def write_gguf(checkpoint: Path, out: Path, qtype: Q = Q.F32, types: dict[str, Q] | None = None,
               drop: tuple[str, ...] = (), arch: str = ARCH, seed: int = 0) -> Path:
    """checkpoint (config.json, model.safetensors, generation_config.json, tokenizer files) -> GGUF at `out`.
    Matrices get `qtype` (or `types[gguf_name]`); norms, scales and the router stay F32, as the converter does."""
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    text = config["text_config"]
    w = GGUFWriter(out, arch)
    _write_config(w, config, text, arch)
    _write_sampler(w, json.loads((checkpoint / "generation_config.json").read_text()))
    _write_tokenizer(w, checkpoint)
    head_full = _global_head_dim(text)
    n_rot = int(head_full * text["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * (head_full // 2 - n_rot), np.float32))
    rng = np.random.default_rng(seed)
    state = load_file(str(checkpoint / "model.safetensors"))
    for name, t in gguf_names(state).items():
        if name in drop:
            continue
        arr = t.float().numpy()
        matrix = arr.ndim >= 2 and not name.endswith("ffn_gate_inp.weight")
        kind = (types or {}).get(name, qtype if matrix else Q.F32)
        w.add_tensor(name, encode(arr, kind, rng), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _global_head_dim(text: dict) -> int:
    full = [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"]
    return (text.get("per_layer_config") or {}).get(str(full[-1]), {}).get("head_dim", text["head_dim"])


def _write_config(w: GGUFWriter, config: dict, text: dict, arch: str) -> None:
    a = f"{arch}."
    full = [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"]
    per = text.get("per_layer_config") or {}
    kv = [per.get(str(i), {}).get("num_key_value_heads", text["num_key_value_heads"]) if i in full
          else text["num_key_value_heads"] for i in range(text["num_hidden_layers"])]
    w.add_uint32(a + "block_count", text["num_hidden_layers"])
    w.add_uint32(a + "context_length", text["max_position_embeddings"])
    w.add_uint32(a + "embedding_length", text["hidden_size"])
    w.add_uint32(a + "feed_forward_length", text["intermediate_size"])
    w.add_uint32(a + "attention.head_count", text["num_attention_heads"])
    w.add_array(a + "attention.head_count_kv", kv)
    w.add_float32(a + "rope.freq_base", text["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_float32(a + "rope.freq_base_swa", text["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_float32(a + "attention.layer_norm_rms_epsilon", text["rms_norm_eps"])
    w.add_uint32(a + "expert_count", text["num_experts"])
    w.add_uint32(a + "expert_used_count", text["top_k_experts"])
    w.add_uint32(a + "attention.key_length", _global_head_dim(text))
    w.add_uint32(a + "attention.value_length", _global_head_dim(text))
    w.add_uint32(a + "attention.sliding_window", text["sliding_window"])
    w.add_array(a + "attention.sliding_window_pattern", [t == "sliding_attention" for t in text["layer_types"]])
    w.add_uint32(a + "attention.key_length_swa", text["head_dim"])
    w.add_uint32(a + "attention.value_length_swa", text["head_dim"])
    w.add_uint32(a + "expert_feed_forward_length", text["moe_intermediate_size"])
    if "final_logit_softcapping" in text:
        w.add_float32(a + "final_logit_softcapping", text["final_logit_softcapping"])
    w.add_bool(a + "attention.causal", False)
    w.add_uint32("diffusion.canvas_length", config["canvas_length"])


def _write_sampler(w: GGUFWriter, gen: dict) -> None:
    w.add_uint32("diffusion.eb_max_steps", gen["max_denoising_steps"])
    w.add_float32("diffusion.eb_t_min", gen["t_min"])
    w.add_float32("diffusion.eb_t_max", gen["t_max"])
    w.add_float32("diffusion.eb_entropy_bound", gen["sampler_config"]["entropy_bound"])
    w.add_uint32("diffusion.eb_stability_threshold", gen["stability_threshold"])
    w.add_float32("diffusion.eb_confidence_threshold", gen["confidence_threshold"])


def _write_tokenizer(w: GGUFWriter, checkpoint: Path) -> None:
    """As the converter's Gemma 4 path: tokens by id, score -1000, types, merges "a b", special ids, template."""
    tj = json.loads((checkpoint / "tokenizer.json").read_text())
    cfg = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    specials = {cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token") if k in cfg}
    specials |= set(cfg.get("additional_special_tokens", []))
    types = [TOKEN_TYPES["control"] if t in specials else TOKEN_TYPES["byte"] if t.startswith("<0x") and len(t) == 6
             else TOKEN_TYPES["normal"] for t in tokens]
    w.add_string("tokenizer.ggml.model", "gemma4")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", [-1000.0] * len(tokens))
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    for key, gkey in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding"), ("mask_token", "mask")):
        if key in cfg:
            w.add_uint32(f"tokenizer.ggml.{gkey}_token_id", vocab[cfg[key]])
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_string("tokenizer.chat_template", cfg["chat_template"])
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
