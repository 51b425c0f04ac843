"""Image prompts through the Python API on the bundled model (its untrained tiny tower): reference-compatible
sampling token for token against transformers==5.23.0, batching, the prefix cache, and the bad-input table."""

import json

import pytest
import torch

import dgemma
from dgemma.api import DEMO_MODEL
from dgemma.cache import PrefixCache
from dgemma.engine import Engine
from dgemma.image_limits import ImageLimits
from dgemma.images import preprocess
from dgemma.sampling import SamplingParams, SamplingParamsError

Image = pytest.importorskip("PIL.Image")


def picture(width, height, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


def chat(*images, text="What is in the picture?"):
    return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def demo():
    return dgemma.load(dtype="float32")


def test_image_prompt_ids(demo):
    """One id per soft token, past the vocabulary, in place of the image part; the same image, the same ids."""
    image = picture(100, 60)
    soft = preprocess(image, 16, 3).soft_tokens
    ids = demo.encode_prompt(chat(image))
    vocab = demo.module.cfg.text.vocab_size
    image_ids = [t for t in ids if t >= vocab]
    assert len(image_ids) == soft and image_ids == list(range(image_ids[0], image_ids[0] + soft))
    text = [t for t in ids if t < vocab]
    assert text == demo.encode_prompt([{"role": "user", "content": "What is in the picture?"}])
    assert demo.encode_prompt(chat(image)) == ids
    other = demo.encode_prompt(chat(picture(100, 60, seed=1)))
    assert len(other) == len(ids) and set(other).isdisjoint(image_ids)


@torch.no_grad()
def test_reference_sampling_on_an_image_prompt_is_token_exact(demo):
    """transformers' generate with the reference processor's pixel values, and dgemma's reference sampling on the
    same chat: the same ids over two canvases."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    image = picture(90, 130, seed=2)
    messages = chat(image, text="Describe it.")
    ids = demo.encode_prompt(messages)
    cfg = demo.module.cfg
    ref_ids = torch.tensor([[cfg.image_token_id if t >= cfg.text.vocab_size else t for t in ids]])
    pixels = Gemma4ImageProcessorPil(max_soft_tokens=280)(images=[image], return_tensors="pt")
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    kw = dict(max_new_tokens=2 * cfg.canvas_length, t_min=0.005, t_max=0.01)
    torch.manual_seed(5)
    out = ref.generate(ref_ids, pixel_values=pixels["pixel_values"], image_position_ids=pixels["image_position_ids"],
                       mm_token_type_ids=(ref_ids == cfg.image_token_id).long(), eos_token_id=[1], pad_token_id=0,
                       **kw)
    row = out.sequences[0, ref_ids.shape[1]:].tolist()
    expected = row[:next((i for i, t in enumerate(row) if t == 1), len(row))]
    got = demo.generate(messages, seed=5, sampling="reference", eos_token_ids=(1,), **kw)
    assert got.token_ids == expected and got.prompt_tokens == len(ids)


def _run(engine, prompts, seeds):
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=8, seed=s, max_denoising_steps=4))
            for p, s in zip(prompts, seeds)]
    for _ in engine.stream():
        pass
    return reqs


def test_batch_and_prefix_cache_tell_images_apart(demo, monkeypatch):
    """Two prompts with the same text and different images (identical lengths): batched, each answer is the one it
    gets alone; the prefix cache reuses a prompt for the same image and only the text before the image for another
    (70 soft tokens: the prompt stays within the sliding window, so a short match is usable)."""
    monkeypatch.setattr(demo, "image_limits", ImageLimits(max_soft_tokens=70))
    a, b = demo.encode_prompt(chat(picture(64, 64, 3))), demo.encode_prompt(chat(picture(64, 64, 4)))
    first_image = next(i for i, t in enumerate(a) if t >= demo.module.cfg.text.vocab_size)
    engine = lambda cache=None: Engine(demo.module, (1,), 0, 4, prefix_cache=cache)  # noqa: E731
    together = _run(engine(), [a, b], [0, 1])
    alone = [_run(engine(), [p], [s])[0] for p, s in ((a, 0), (b, 1))]
    assert [r.output for r in together] == [r.output for r in alone]
    cached = engine(PrefixCache(64 << 20))
    _run(cached, [a], [0])
    (same,) = _run(cached, [a], [0])
    (other,) = _run(cached, [b], [1])
    assert same.stats.cached_tokens == len(a) and same.output == alone[0].output
    assert other.stats.cached_tokens == first_image and other.output == alone[1].output


def _text_only(tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "text_only"
    d.mkdir()
    for f in DEMO_MODEL.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    index = json.loads((d / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        tensors = load_file(d / shard)
        save_file({k: v for k, v in tensors.items() if "vision" not in k}, str(d / shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "vision" not in k}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return dgemma.load(d)


def test_bad_input_is_refused_before_the_tower_runs(demo, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(type(demo.module.vision), "forward", lambda *a: ran.append(1))
    monkeypatch.setattr(demo, "image_limits", ImageLimits(max_images=2, max_bytes=10_000))
    cases = [
        (chat(*[picture(10, 10)] * 3), "3 images; at most 2"),
        (chat(b"\x89PNG not really"), "not a PNG, JPEG, GIF or WebP"),
        (chat("data:image/png;base64," + "A" * 20_000), "larger than 10000 bytes"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}],
         "not fetched"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "must be a text or image part"),
    ]
    for messages, message in cases:
        with pytest.raises(SamplingParamsError, match=message):
            demo.generate(messages, max_new_tokens=2)
    with pytest.raises(SamplingParamsError, match="outside the vocabulary"):  # another request's image's ids
        demo.generate([2, demo.module.soft_tokens.vocab, demo.module.soft_tokens.vocab + 1], max_new_tokens=2)
    with pytest.raises(SamplingParamsError, match="no vision tower"):
        _text_only(tmp_path).generate(chat(picture(10, 10)), max_new_tokens=2)
    assert not ran


def test_prompt_limits_count_soft_tokens_not_data_url_characters(demo):
    """A data URL's characters are not prompt text (a 200 x 200 PNG is ~160,000 characters of base64, far past
    the character pre-check of a 100-token limit); its soft tokens are prompt tokens."""
    import base64
    import io

    from dgemma.sampling import Limits

    out = io.BytesIO()
    picture(200, 200).save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Hi"}]}]
    demo.image_limits = ImageLimits(max_soft_tokens=70)
    try:
        ids = demo.encode_prompt(messages, max_tokens=100)
    finally:
        demo.image_limits = ImageLimits()
    assert len(url) > 100_000 and 64 < len(ids) < 100
    params = demo.params(max_new_tokens=4)
    demo.check_request(ids, params, Limits(max_prompt_tokens=len(ids)))
    with pytest.raises(SamplingParamsError, match="prompt"):
        demo.check_request(ids, params, Limits(max_prompt_tokens=len(ids) - 1))


@torch.no_grad()
def test_bundled_shape_logits_fp32(demo):
    """The bundled checkpoint (its tiny tower at 16-pixel patches): encoder logits over an image prompt and the
    first denoising step's within 1e-4 of the reference fed the reference processor's pixels."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import DynamicCache
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    image = picture(70, 50, seed=6)
    ids = demo.encode_prompt(chat(image, text="Describe it."))
    cfg, module = demo.module.cfg, demo.module
    ref_ids = torch.tensor([[cfg.image_token_id if t >= cfg.text.vocab_size else t for t in ids]])
    pixels = Gemma4ImageProcessorPil(max_soft_tokens=280)(images=[image], return_tensors="pt")
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    cache, n = DynamicCache(config=ref.config.get_text_config(decoder=True)), len(ids)
    enc = ref.model.encoder(input_ids=ref_ids, pixel_values=pixels["pixel_values"], past_key_values=cache,
                            image_position_ids=pixels["image_position_ids"], position_ids=torch.arange(n)[None])
    canvas = torch.randint(0, cfg.text.vocab_size, (1, cfg.canvas_length), generator=torch.Generator().manual_seed(7))
    expected = [torch.tanh(ref.lm_head(enc.last_hidden_state) / 30) * 30,
                ref(decoder_input_ids=canvas, past_key_values=cache, decoder_position_ids=torch.arange(
                    n, n + canvas.shape[1])[None], decoder_attention_mask=torch.ones(1, n + canvas.shape[1])).logits]
    ours = module.new_cache(1, 4)
    got = [module.head(module.encode(torch.tensor([ids]), ours)), module.head(module.denoise(canvas, ours))]
    for e, g in zip(expected, got):
        assert (e - g).abs().max() <= 1e-4
