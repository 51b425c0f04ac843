"""The vision tower and image soft tokens against transformers==5.23.0: encoder and decoder logits of an image +
text prompt, the reference fed exactly as its `generate` feeds its encoder (masks from `create_masks_for_generate`
with `mm_token_type_ids`)."""

import hashlib

import pytest
import torch
import transformers

from dgemma.weights import load_model
from reference import CONFIGS

pytest.importorskip("transformers")

# A small tower that still has GQA, 2D RoPE on 8-dim heads, pooling, clipped linears and standardisation.
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=64, standardize=True,
              use_clipped_linears=True)
# The released checkpoint's tower (about 550M parameters), at reduced depth.
REAL_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=2, num_attention_heads=16,
                   num_key_value_heads=16, head_dim=72, patch_size=16, pooling_kernel_size=3,
                   position_embedding_size=10240, standardize=True)
IMAGE, BOI, EOI = 383, 381, 382


def build(directory, vision, bidirectional="vision", seed=0):
    """A reference model whose every weight, the tower's included, is random; saved to `directory`."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    text = dict(CONFIGS["a"]["text"], use_bidirectional_attention=bidirectional)
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=dict(vision), canvas_length=8, image_token_id=IMAGE,
                               boi_token_id=BOI, eoi_token_id=EOI)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "position_embedding" in name else 0.1))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
            elif name.endswith(("std_bias", "std_scale")):
                b.copy_(torch.randn_like(b) * 0.1 + (1.0 if name.endswith("scale") else 0.0))
            elif name.endswith(("input_min", "output_min")):
                b.fill_(-0.3)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(0.3)
        model.model.decoder.embed_tokens.weight.mul_(5.0)
    model.save_pretrained(directory)
    return model


def images(vision, grids, seed=1):
    """Random patches [P, 3 * patch^2] and their (x, y) positions for images of (rows, cols) patches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows, cols in grids:
        y, x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        positions = torch.stack([x.reshape(-1), y.reshape(-1)], dim=-1)
        out.append((torch.rand(rows * cols, 3 * vision["patch_size"] ** 2, generator=g), positions))
    return out


def prompt_ids(counts, vocab_ids):
    """Text, then for each image boi + soft-token placeholders + eoi and more text: a list of (kind, value)."""
    g = torch.Generator().manual_seed(3)
    text = lambda n: torch.randint(3, 300, (n,), generator=g).tolist()  # noqa: E731
    ids = [2, *text(5)]
    for n, image_ids in zip(counts, vocab_ids):
        ids += [BOI, *image_ids(n), EOI, *text(3)]
    return ids


def reference(model, pics, ids, canvas, generate_masks=True):
    """Encoder logits of the prompt and the decoder's logits of `canvas` after it, as the reference's generate
    computes them (its masks, its cache); without `generate_masks`, as 5.23's plain encoder forward does (which
    builds those masks and discards them: plain causal attention)."""
    from transformers.cache_utils import DynamicCache

    k2 = model.config.vision_config.pooling_kernel_size ** 2
    most = max(p.shape[0] for p, _ in pics)
    pixel = torch.zeros(len(pics), most, pics[0][0].shape[1])
    pos = torch.full((len(pics), most, 2), -1, dtype=torch.long)
    for i, (p, q) in enumerate(pics):  # padded to one patch count, as the reference processor pads
        pixel[i, :p.shape[0]], pos[i, :p.shape[0]] = p, q
    assert most % k2 == 0
    input_ids = torch.tensor([ids])
    n = input_ids.shape[1]
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    positions = torch.arange(n)[None]
    masks = model.model.encoder.create_masks_for_generate(
        config=model.config, inputs_embeds=torch.empty(1, n, 0), attention_mask=torch.ones(1, n, dtype=torch.bool),
        past_key_values=cache, position_ids=positions, mm_token_type_ids=(input_ids == IMAGE).long())
    enc = model.model.encoder(input_ids=input_ids, pixel_values=pixel, image_position_ids=pos,
                              attention_mask=masks if generate_masks else None, past_key_values=cache,
                              position_ids=positions, mm_token_type_ids=(input_ids == IMAGE).long())
    cap = model.config.text_config.final_logit_softcapping
    encoder_logits = torch.tanh(model.lm_head(enc.last_hidden_state).float() / cap) * cap
    c = canvas.shape[1]
    out = model(decoder_input_ids=canvas, past_key_values=cache, decoder_attention_mask=torch.ones(1, n + c).bool(),
                decoder_position_ids=torch.arange(n, n + c)[None])
    return encoder_logits, out.logits


def spliced(model, pics, ids):
    """The prompt ids with each image's soft-token ids (dgemma's) in place of its placeholders."""
    queue = [model.image_ids(hashlib.sha256(p.numpy().tobytes() + q.numpy().tobytes()).hexdigest(), p, q)[0]
             for p, q in pics]
    full, i = [], 0
    while i < len(ids):
        if ids[i] == IMAGE:
            run = queue.pop(0)
            full += run
            i += len(run)
        else:
            full.append(ids[i])
            i += 1
    return full


def ours(model, pics, ids, canvas, chunk=None):
    """The same through dgemma."""
    full = spliced(model, pics, ids)
    cache = model.new_cache(1, 4)
    prompt = torch.tensor([full])
    if chunk is None:
        encoder_logits = model.head(model.encode(prompt, cache))
    else:
        model.prefill(prompt, cache, chunk=chunk)
        encoder_logits = None
    return encoder_logits, model.head(model.denoise(canvas, cache))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("vision")
    return build(d, VISION), load_model(d)


def _case(vision, grids):
    k2 = vision["pooling_kernel_size"] ** 2
    pics = images(vision, grids)
    counts = [r * c // k2 for r, c in grids]
    ids = prompt_ids(counts, [lambda n: [IMAGE] * n] * len(counts))
    canvas = torch.randint(0, 384, (1, 8), generator=torch.Generator().manual_seed(4))
    return pics, ids, canvas


@torch.no_grad()
def test_image_prompt_logits_fp32(pair):
    """Two images of transposed shapes (4 x 6 and 6 x 4 patches, 6 soft tokens each): encoder logits over the whole
    prompt and the first denoising step's logits within 1e-4."""
    ref, model = pair
    assert model.vision is not None and model.cfg.bidirectional_vision
    pics, ids, canvas = _case(VISION, [(4, 6), (6, 4)])
    expected = reference(ref, pics, ids, canvas)
    got = ours(model, pics, ids, canvas)
    for e, g in zip(expected, got):
        assert (e - g).abs().max() <= 1e-4
    # the mask matters here: 5.23's plain forward builds the image mask and drops it (causal), 5.25's applies it
    plain = reference(ref, pics, ids, canvas, generate_masks=False)
    if _version(transformers.__version__) >= (5, 25):
        assert all((c - g).abs().max() <= 1e-4 for c, g in zip(plain, got))
    else:
        assert all((c - g).abs().max() > 1e-2 for c, g in zip(plain, got))


@torch.no_grad()
def test_padded_batch_features(pair):
    """Images of different patch counts, padded to one count in the reference's batch (padding patches masked
    out there), against dgemma's unpadded one-image-at-a-time tower: soft tokens within float rounding."""
    ref, model = pair
    pics = images(VISION, [(4, 6), (2, 4), (2, 2)])
    pixel = torch.zeros(3, 24, 48)
    pos = torch.full((3, 24, 2), -1, dtype=torch.long)
    for i, (p, q) in enumerate(pics):
        pixel[i, :p.shape[0]], pos[i, :p.shape[0]] = p, q
    expected = ref.model.encoder.get_image_features(pixel, pos).pooler_output
    got = torch.cat([model.vision(p, q) for p, q in pics])
    assert got.shape == expected.shape == (6 + 2 + 1, 64)
    assert (expected - got).abs().max() <= 1e-5


@torch.no_grad()
def test_prefill_chunks_never_split_an_image(pair):
    """Chunks of 4 tokens would cut the 6-token run: the chunk ends move, and the logits do not change."""
    ref, model = pair
    pics, ids, canvas = _case(VISION, [(4, 6), (2, 4)])
    expected = reference(ref, pics, ids, canvas)[1]
    got = ours(model, pics, ids, canvas, chunk=4)[1]
    assert (expected - got).abs().max() <= 1e-4


@torch.no_grad()
def test_images_without_bidirectional_flag_are_causal(tmp_path):
    """use_bidirectional_attention unset (the smaller Gemma 4 models): plain causal attention over soft tokens."""
    ref = build(tmp_path, VISION, bidirectional=None, seed=5)
    model = load_model(tmp_path)
    assert not model.cfg.bidirectional_vision
    pics, ids, canvas = _case(VISION, [(2, 4)])
    for e, g in zip(reference(ref, pics, ids, canvas), ours(model, pics, ids, canvas)):
        assert (e - g).abs().max() <= 1e-4


@pytest.mark.slow
@torch.no_grad()
def test_real_vision_shapes_reduced_depth(tmp_path):
    """The released tower's widths (1152 hidden, 16 heads of 72, 16-pixel patches, 3 x 3 pooling), two layers."""
    ref = build(tmp_path, REAL_VISION, seed=6)
    model = load_model(tmp_path)
    pics, ids, canvas = _case(REAL_VISION, [(6, 9), (3, 3)])
    for e, g in zip(reference(ref, pics, ids, canvas), ours(model, pics, ids, canvas)):
        assert (e - g).abs().max() <= 1e-4


@torch.no_grad()
def test_batched_left_padded_image_prompts(pair):
    """Two image prompts of different lengths in one left-padded prefill (each row at its own positions, its cache
    then taken out, as the engine batches them): each row's first-step logits are the ones it gets alone."""
    _, model = pair
    pics, ids, canvas = _case(VISION, [(4, 6)])
    long_pics, long_ids, _ = _case(VISION, [(4, 6), (6, 4)])
    rows = [spliced(model, pics, ids), spliced(model, long_pics, long_ids)]
    alone = []
    for r in rows:
        cache = model.new_cache(1, 4)
        model.prefill(torch.tensor([r]), cache)
        alone.append(model.head(model.denoise(canvas, cache)))
    n = max(len(r) for r in rows)
    pads = torch.tensor([n - len(r) for r in rows])
    prompt = torch.tensor([[0] * (n - len(r)) + r for r in rows])
    slots = torch.arange(n)[None]
    cache = model.new_cache(2, 4)
    model.prefill(prompt, cache, valid=slots >= pads[:, None], positions=(slots - pads[:, None]).clamp(min=0))
    for i in range(2):  # each row's cache taken out, as the engine does
        row = cache.extract(i, int(pads[i]), cache.length)
        assert (model.head(model.denoise(canvas, row)) - alone[i]).abs().max() <= 1e-4


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2])
