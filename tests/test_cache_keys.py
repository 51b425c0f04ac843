"""Full-attention layers cache k_proj's output alone: the keys and values the decoder attends to, derived from it
at read time, are bit for bit transformers==5.23.0's ops (k_norm, rotary embedding, v_norm) applied to the
tokens' k_proj outputs, in float32 and bfloat16, whatever the prefill chunks and the derive block size."""

import pytest
import torch

import dgemma.model.attention as attention
from dgemma.weights import load_model
from reference import build_reference, reference_logits

modeling = pytest.importorskip("transformers.models.diffusion_gemma.modeling_diffusion_gemma")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Config "b": two sliding layers, then two full-attention layers."""
    d = tmp_path_factory.mktemp("keys")
    return build_reference("b", d), d


def _reference_kv(ref, attn, raw, positions):
    """transformers' keys and values [B, kv_heads, L, D] from k_proj outputs raw [B, L, kv_heads * D]: its own
    k_norm, v_norm and rotary embedding (the full-attention layers' rope, built from the reference's config)."""
    d = attn.head_dim
    k_norm = modeling.DiffusionGemmaRMSNorm(d, eps=attn.k_norm.eps).to(raw.dtype)
    k_norm.weight.data.copy_(attn.k_norm.weight)
    v_norm = modeling.DiffusionGemmaRMSNorm(d, eps=attn.v_norm.eps, with_scale=False)
    raw = raw.view(*raw.shape[:2], -1, d)
    rotary = modeling.DiffusionGemmaTextRotaryEmbedding(ref.config.get_text_config())
    cos, sin = rotary(raw, positions, "full_attention")
    keys = modeling.apply_rotary_pos_emb(k_norm(raw), cos, sin, unsqueeze_dim=2)
    return keys.transpose(1, 2), v_norm(raw).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("whole", [True, False])
@torch.no_grad()
def test_derived_keys_and_values_are_the_references_bit_for_bit(checkpoint, monkeypatch, dtype, whole):
    """A batch with positions of its own (not the slots), prefilled in chunks, then a canvas denoised (all keys at
    once, or a block of keys at a time): the full layer's keys and values equal the reference ops on every
    token's k_proj output exactly."""
    if not whole:
        monkeypatch.setattr(attention, "WHOLE_KEYS", 0)
        monkeypatch.setattr(attention, "BLOCK_FLOATS", 1)  # blocks of 16 keys
    m = load_model(checkpoint[1], dtype=dtype)
    full = [i for i in range(len(m.layers)) if not m.layers[i].self_attn.sliding]
    attn = m.layers[full[0]].self_attn
    raw, derived = [], []
    attn.k_proj.register_forward_hook(lambda mod, args, out: raw.append(out))
    real = attention.Attention.derive
    monkeypatch.setattr(attention.Attention, "derive",
                        lambda self, r, p: derived.append((self, real(self, r, p))) or derived[-1][1])
    g = torch.Generator().manual_seed(1)
    c = m.cfg.canvas_length
    prompt, canvas = torch.randint(0, 500, (2, 13), generator=g), torch.randint(0, 500, (2, c), generator=g)
    positions = torch.arange(13 + c)[None] + torch.tensor([[0], [7]])
    cache = m.new_cache(2, 4)
    m.prefill(prompt, cache, positions=positions[:, :13], chunk=4)
    derived.clear()
    m.denoise(canvas, cache, positions=positions[:, 13:])
    blocks = [kv for layer, kv in derived if layer is attn]
    assert len(blocks) == (1 if whole else 2)
    keys, values = (torch.cat(t, dim=2) for t in zip(*blocks))
    want_keys, want_values = _reference_kv(checkpoint[0], attn, torch.cat(raw, dim=1), positions)
    assert keys.dtype == dtype and keys.shape == want_keys.shape
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    assert len(cache.stores[full[0]].data) == 1 and len(cache.stores[0].data) == 2  # one tensor full, two sliding


@pytest.mark.parametrize("name", ["a", "b"])
@torch.no_grad()
def test_attention_a_block_of_keys_at_a_time_matches_reference(monkeypatch, tmp_path, name):
    """Full-attention layers forced onto the blocked path (blocks of 16 keys, online softmax) with a left-padded
    batch, a prompt prefilled in chunks and canvases denoised and committed: every logit equals transformers'."""
    monkeypatch.setattr(attention, "WHOLE_KEYS", 0)
    monkeypatch.setattr(attention, "BLOCK_FLOATS", 1)
    ref = build_reference(name, tmp_path)
    ours = load_model(tmp_path)
    g = torch.Generator().manual_seed(2)
    v, c, w = ours.cfg.text.vocab_size, ours.cfg.canvas_length, ours.cfg.text.sliding_window
    prompt = torch.randint(0, v, (2, 5 * w + 3), generator=g)
    canvases = [torch.randint(0, v, (2, c), generator=g) for _ in range(3)]
    mask = torch.ones(prompt.shape, dtype=torch.bool)
    mask[1, :w + 2] = False
    expected = reference_logits(ref, prompt, canvases, attention_mask=mask)
    cache = ours.new_cache(2, 4)
    got = [ours.head(ours.prefill(prompt, cache, valid=mask, chunk=7))]
    for canvas in canvases:
        got += [ours.head(ours.denoise(canvas, cache)), ours.head(ours.encode(canvas, cache))]
    assert (expected[0][:, -1] - got[0]).abs().max() <= 1e-4
    for i, (e, o) in enumerate(zip(expected[1:], got[1:])):
        assert (e - o).abs().max() <= 1e-4, f"output {i + 1}"
