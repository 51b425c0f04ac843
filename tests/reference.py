"""The oracle: tiny random checkpoints built and saved by transformers==5.23.0, and its outputs."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VISION = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                   num_key_value_heads=1, head_dim=8)

# Configs that differ in layer pattern, head dims, kv heads, experts / top-k, vocabulary and canvas length.
CONFIGS = {
    "a": dict(text=dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                        num_global_key_value_heads=1, sliding_window=8, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=32,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
              canvas_length=8),
    "b": dict(text=dict(vocab_size=520, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=6, num_key_value_heads=3, head_dim=8, global_head_dim=16,
                        num_global_key_value_heads=2, sliding_window=6, num_experts=6, top_k_experts=3,
                        moe_intermediate_size=24,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                     "full_attention"]),
              canvas_length=12),
    "c": dict(text=dict(vocab_size=300, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                        sliding_window=5, num_experts=3, top_k_experts=1, moe_intermediate_size=16,
                        layer_types=["sliding_attention", "full_attention"]),
              canvas_length=5),
}


def build_reference(name: str, directory: Path, seed: int = 0, dtype=torch.float32, spread: float = 1.0,
                    embed: float = 5.0, **save_kwargs):
    """Random reference model with every weight (norms, scalars, scales included) randomised, saved to disk."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    spec = CONFIGS[name]
    cfg = DiffusionGemmaConfig(text_config=dict(spec["text"]), vision_config=dict(TINY_VISION),
                               canvas_length=spec["canvas_length"])
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "vision" in pname:
                continue
            if pname.endswith(("norm.weight", "scale")) or "layernorm" in pname:
                p.copy_(1.0 + 0.3 * spread * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.1 * spread)
        for bname, b in model.named_buffers():
            if bname.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
        model.model.decoder.embed_tokens.weight.mul_(embed)  # sharper distributions than pure noise
    model = model.to(dtype)
    model.save_pretrained(directory, **save_kwargs)
    return model


def reference_logits(model, prompt: torch.Tensor, canvases: list[torch.Tensor], attention_mask=None,
                     sc_logits=None):
    """Encode the prompt, then for each canvas: decoder logits, then commit it through the encoder."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    b, n = prompt.shape
    mask = torch.ones(b, n, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    enc = model.model.encoder(input_ids=prompt, attention_mask=mask, past_key_values=cache,
                              position_ids=torch.arange(n)[None])
    outs = [_softcap(model, model.lm_head(enc.last_hidden_state))]
    cur = n
    for i, canvas in enumerate(canvases):
        c = canvas.shape[1]
        dmask = torch.nn.functional.pad(mask, (0, c), value=True)
        out = model(decoder_input_ids=canvas, past_key_values=cache, decoder_attention_mask=dmask,
                    decoder_position_ids=torch.arange(cur, cur + c)[None], self_conditioning_logits=sc_logits)
        outs.append(out.logits)
        mask = dmask
        enc = model.model.encoder(input_ids=canvas, attention_mask=mask, past_key_values=cache,
                                  position_ids=torch.arange(cur, cur + c)[None])
        outs.append(_softcap(model, model.lm_head(enc.last_hidden_state)))
        cur += c
    return outs


def _softcap(model, logits):
    cap = model.config.text_config.final_logit_softcapping
    return torch.tanh(logits.float() / cap) * cap
