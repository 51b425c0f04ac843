"""Attention spans: unmasked SDPA (is_causal prefill, plain decoder) equals the masked path, padding still
masks, and deciding between them reads nothing from the device."""

import pytest
import torch
import torch.nn.functional as F

from dgemma.cache import KVCache
from dgemma.config import ModelConfig, TextConfig
from dgemma.model import DiffusionGemma
from dgemma.instruments import Recorder

WINDOW = 6


@pytest.fixture(scope="module")
def model():
    text = TextConfig(vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                      num_experts=4, top_k_experts=2, moe_intermediate_size=16,
                      layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                      per_layer={1: {"head_dim": 32, "num_key_value_heads": 1}})
    m = DiffusionGemma(ModelConfig(text, canvas_length=5)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name or "scale" in name else 0.3 * noise)
    return m


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Records (mask given, is_causal) of every SDPA call."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is not None, kwargs.get("is_causal", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def prefill_and_denoise(model, prompt, valid=None, positions=None):
    cache = model.new_cache(prompt.shape[0], 4)
    hidden = model.encode(prompt, cache, valid=valid, positions=positions)
    canvas = torch.randint(0, 200, (prompt.shape[0], 5), generator=torch.Generator().manual_seed(1))
    return hidden, model.denoise(canvas, cache), cache


@pytest.mark.parametrize("n", [5, WINDOW, 15])  # prompts past attention.FEW_QUERIES: SDPA
@torch.no_grad()
def test_unmasked_prefill_and_decoder_equal_masked(model, n, sdpa_calls, monkeypatch):
    prompt = torch.randint(0, 200, (2, n), generator=torch.Generator().manual_seed(n))
    fast = prefill_and_denoise(model, prompt)
    sliding, full = sdpa_calls[0], sdpa_calls[1]
    assert full == (False, True)  # full layers: plain causal at any length
    assert sliding == ((True, False) if n > WINDOW else (False, True))  # the window cuts in past its size
    assert all(call == (False, False) for call in sdpa_calls[3:])  # the decoder: no mask
    monkeypatch.setattr(KVCache, "has_padding", lambda self, lo: True)  # force the masked paths
    slow = prefill_and_denoise(model, prompt)
    for a, b in zip(fast[:2], slow[:2]):
        assert (model.head(a) - model.head(b)).abs().max() <= 1e-5


@torch.no_grad()
def test_padded_batch_matches_rows_alone(model, sdpa_calls):
    """Row 1 is left-padded by 2 (with its own positions); the window covers every slot, so the row must give
    what it gives alone, for the prompt and for a canvas."""
    prompt = torch.randint(0, 200, (2, 5), generator=torch.Generator().manual_seed(5))
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, :2] = False
    shift = torch.tensor([[0], [2]])
    cache = model.new_cache(2, 4)
    hidden = model.encode(prompt, cache, valid=valid, positions=(torch.arange(5)[None] - shift).clamp(min=0))
    canvas = torch.randint(0, 200, (2, 5), generator=torch.Generator().manual_seed(1))
    denoised = model.denoise(canvas, cache, positions=torch.arange(5, 10)[None] - shift)
    assert cache.has_padding(0) and all(mask for mask, _ in sdpa_calls)
    alone = model.new_cache(1, 4)
    assert (model.head(hidden[1, 2:]) - model.head(model.encode(prompt[1:, 2:], alone)[0])).abs().max() <= 1e-5
    assert (model.head(denoised[1]) - model.head(model.denoise(canvas[1:], alone)[0])).abs().max() <= 1e-5


@torch.no_grad()
def test_padding_known_through_extract_and_window(model):
    cache = model.new_cache(2, 8)
    valid = torch.tensor([[False, False, True, True, True], [True] * 5])
    model.encode(torch.randint(0, 200, (2, 5)), cache, valid=valid)
    assert cache.has_padding(4) and not cache.has_padding(5)
    own = cache.extract(0, 2, cache.length)  # a row's own cache leaves its left padding behind
    assert own.length == 3 and not own.has_padding(0) and bool(own.valid[:, :3].all())
    # padding that has slid out of every sliding window no longer needs a mask there
    model.encode(torch.randint(0, 200, (2, 12)), cache)
    assert not cache.has_padding(cache.window_start(True, cache.length))


@torch.no_grad()
def test_steps_read_nothing_from_the_device(model):
    """A denoising step and an autoregressive token decide their masks on the host."""
    for valid in (None, torch.tensor([[False, True, True, True], [True] * 4])):
        cache = model.new_cache(2, 16)
        model.encode(torch.randint(0, 200, (2, 4)), cache, valid=valid)
        with Recorder() as rec:
            model.denoise(torch.randint(0, 200, (2, 5)), cache)
            model.encode(torch.randint(0, 200, (2, 1)), cache)
        assert rec.reads == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("head_dim,kv_heads,keys", [(16, 2, 3), (64, 2, 40), (128, 1, 300)])
@torch.inference_mode()
def test_few_queries_match_float64_softmax(dtype, n, head_dim, kv_heads, keys, sdpa_calls):
    """A few queries on a CPU (a decoded token, a short draft) take the float32 block softmax, not SDPA: the float64
    reference's softmax(q k^T) v over GQA heads, unmasked, with a padding mask, and causal (lower right)."""
    from dgemma.cache.views import Span
    from dgemma.model.attention import attend

    g = torch.Generator().manual_seed(keys)
    q = torch.randn(2, 4, n, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(2, kv_heads, keys, head_dim, generator=g).div(head_dim ** 0.5).to(dtype) for _ in range(2))
    mask = torch.rand(2, 1, n, keys, generator=g) > 0.3
    mask[..., -1] = True  # the token's own slot
    causal = torch.arange(keys) <= torch.arange(keys - n, keys)[:, None]
    for m, span in ((None, Span(0)), (mask, Span(0, mask)), (causal, Span(0, None, True))):
        got = attend(q, k, v, span)
        kr, vr = (t.double().repeat_interleave(4 // kv_heads, dim=1) for t in (k, v))
        scores = q.double() @ kr.transpose(-1, -2)
        if m is not None:
            scores = scores.masked_fill(~m, float("-inf"))
        ref = scores.softmax(-1) @ vr
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        assert ((got.double() - ref).abs() / ref.abs().clamp_min(1)).max() <= tol
    assert not sdpa_calls
