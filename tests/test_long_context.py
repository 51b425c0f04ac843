"""Long context: sliding layers keep a ring of window - 1 + canvas slots, prompts are prefilled in chunks, and
both stay equal to transformers==5.23.0 with prompts and generations many windows long."""

import pytest
import torch

from dgemma.cache import KVCache
from dgemma.weights import load_model
from reference import CONFIGS, build_reference, reference_logits

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"long_{request.param}")
    ref = build_reference(request.param, d)
    return ref, load_model(d)


def _inputs(model, batch, prompt_len, n_canvases, seed=1):
    g = torch.Generator().manual_seed(seed)
    v, c = model.cfg.text.vocab_size, model.cfg.canvas_length
    prompt = torch.randint(0, v, (batch, prompt_len), generator=g)
    return prompt, [torch.randint(0, v, (batch, c), generator=g) for _ in range(n_canvases)]


def _ours(model, prompt, canvases, mask, chunk):
    """Prefill in chunks of `chunk` (None: one pass), then denoise and commit each canvas."""
    cache = model.new_cache(prompt.shape[0], 4)
    outs = [model.head(model.prefill(prompt, cache, valid=mask, chunk=chunk))]
    for canvas in canvases:
        outs.append(model.head(model.denoise(canvas, cache)))
        outs.append(model.head(model.encode(canvas, cache)))
    return outs, cache


def _ring(model) -> int:
    return model.cfg.text.sliding_window - 1 + model.cfg.canvas_length


@pytest.mark.parametrize("chunk", [None, 3, 11])
@torch.no_grad()
def test_many_windows_match_reference(pair, chunk):
    """A left-padded batch, a prompt of ~10 windows prefilled whole or in chunks (smaller than the canvas:
    written into the ring; larger: joined with it), then 8 canvases denoised and committed: every logit equals
    the reference's, while the sliding layers hold only their ring."""
    ref, ours = pair
    w = ours.cfg.text.sliding_window
    prompt, canvases = _inputs(ours, 2, 10 * w + 3, 8)
    mask = torch.ones(prompt.shape, dtype=torch.bool)
    mask[1, :w + 2] = False  # padding longer than a window
    expected = reference_logits(ref, prompt, canvases, attention_mask=mask)
    got, cache = _ours(ours, prompt, canvases, mask, chunk)
    assert (expected[0][:, -1] - got[0]).abs().max() <= 1e-4
    for i, (e, g) in enumerate(zip(expected[1:], got[1:])):
        assert (e - g).abs().max() <= 1e-4, f"output {i + 1}"
    for i, store in enumerate(cache.stores):
        assert store.size == (_ring(ours) if ours.cfg.text.layer(i).sliding else cache.capacity)
    assert cache.length > 2 * _ring(ours)


@torch.no_grad()
def test_token_by_token_decoding_through_the_ring(pair):
    """Autoregressive decoding, one token a pass, wraps the ring many times and still equals the reference."""
    ref, ours = pair
    prompt, _ = _inputs(ours, 1, 6 * _ring(ours), 0, seed=3)
    expected = reference_logits(ref, prompt, [])[0]
    cache = ours.new_cache(1, 8)
    ours.prefill(prompt[:, :4], cache)
    steps = [ours.head(ours.encode(prompt[:, i:i + 1], cache)) for i in range(4, prompt.shape[1])]
    assert (torch.cat(steps, 1) - expected[:, 4:]).abs().max() <= 1e-4


@torch.no_grad()
def test_rows_with_caches_of_their_own_match_rows_alone(pair):
    """Prompts of different lengths prefilled together (left-padded, rings wrapped at different points), each
    row's cache extracted, then one batch over the list of caches (each row its own length and positions):
    every row gets what it gets alone, for the decoder and for the next commit."""
    _, ours = pair
    r = _ring(ours)
    lengths = (2 * r + 3, r // 2, r + 1)
    n = max(lengths)
    prompts = [_inputs(ours, 1, k, 0, seed=k)[0] for k in lengths]
    canvas = _inputs(ours, len(lengths), 1, 1, seed=9)[1][0]
    padded = torch.cat([torch.nn.functional.pad(p, (n - p.shape[1], 0)) for p in prompts])
    valid = torch.arange(n)[None] >= torch.tensor([n - k for k in lengths])[:, None]
    group = ours.new_cache(len(lengths), 4)
    ours.prefill(padded, group, valid=valid, positions=(torch.arange(n)[None] - (n - torch.tensor(lengths))[:, None]
                                                        ).clamp(min=0), chunk=7)
    caches = [group.extract(i, n - k, n) for i, k in enumerate(lengths)]
    denoised = ours.head(ours.denoise(canvas, caches))
    committed = ours.head(ours.encode(canvas, caches))
    assert [c.length for c in caches] == [k + canvas.shape[1] for k in lengths]
    for i, p in enumerate(prompts):
        solo = ours.new_cache(1, 4)
        ours.prefill(p, solo)
        assert (denoised[i] - ours.head(ours.denoise(canvas[i:i + 1], solo))[0]).abs().max() <= 1e-4
        assert (committed[i] - ours.head(ours.encode(canvas[i:i + 1], solo))[0]).abs().max() <= 1e-4


def test_sliding_memory_stops_growing_past_the_window(pair):
    """Bytes per added slot past the ring: the full layers' (one tensor each: k_proj's output) and the slot's valid
    flag and int32 position."""
    _, ours = pair
    t, r = ours.cfg.text, _ring(ours)
    full = sum(t.layer(i).num_kv_heads * t.layer(i).head_dim * 4 for i in range(t.num_hidden_layers)
               if not t.layer(i).sliding) + 1 + 4
    sizes = {}
    for n in (r, 4 * r):
        cache = KVCache(t, 1, n, torch.float32, "meta", room=ours.cfg.canvas_length)
        sizes[n] = cache.nbytes
    assert sizes[4 * r] - sizes[r] == 3 * r * full
    linear = KVCache(t, 1, 4 * r, torch.float32, "meta")
    assert linear.nbytes > sizes[4 * r]
