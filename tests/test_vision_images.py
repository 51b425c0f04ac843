"""Image preprocessing against the reference's Gemma 4 image processor (Pillow backend, transformers==5.23.0), and
the image input checks."""

import base64
import io

import pytest
import torch

from dgemma.image_limits import ImageLimits
from dgemma.images import open_image, preprocess
from dgemma.sampling import SamplingParamsError

Image = pytest.importorskip("PIL.Image")


def picture(width, height, mode="RGB", seed=0):
    g = torch.Generator().manual_seed(seed)
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = torch.randint(0, 256, (height, width, bands), generator=g, dtype=torch.uint8).squeeze(-1).numpy()
    return Image.fromarray(pixels, mode)


@pytest.mark.parametrize("size,mode,budget", [
    ((640, 480, ), "RGB", 280),  # landscape, downscaled
    ((300, 1000), "RGB", 280),  # tall
    ((2000, 40), "RGB", 70),  # a strip: one side rounds to zero patches
    ((48, 48), "L", 280),  # small, grey: upscaled
    ((333, 517), "RGBA", 140),  # transparency composited on white
    ((144, 96), "RGB", 560),  # already the target size: no resize
])
def test_pixels_match_reference_processor(size, mode, budget):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    image = picture(*size, mode=mode)
    expected = Gemma4ImageProcessorPil(max_soft_tokens=budget)(images=[image], return_tensors="pt")
    got = preprocess(image, patch=16, pooling=3, max_soft_tokens=budget)
    n = got.pixels.shape[0]
    assert got.soft_tokens == int(expected["num_soft_tokens_per_image"][0]) == n // 9
    assert (expected["image_position_ids"][0, n:] == -1).all()  # the reference pads; dgemma does not
    assert torch.equal(expected["image_position_ids"][0, :n], got.positions)
    assert (expected["pixel_values"][0, :n] - got.pixels).abs().max() <= 1e-6


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_sources_path_bytes_data_url(tmp_path):
    image = picture(20, 10)
    path = tmp_path / "a.png"
    path.write_bytes(_png(image))
    url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    for source in (image, path, str(path), _png(image), url):
        assert open_image(source).size == (20, 10)


@pytest.mark.parametrize("source,limits,message", [
    (b"not an image", ImageLimits(), "not a PNG, JPEG, GIF or WebP"),
    ("data:image/png;base64,@@@", ImageLimits(), "not valid base64"),
    ("data:text/plain;base64,aGk=", ImageLimits(), "data:image/"),
    ("https://example.com/a.png", ImageLimits(), "not fetched"),
    ("/nonexistent/a.png", ImageLimits(), "cannot read image"),
    (12, ImageLimits(), "a PIL image, a file path"),
    ("BIG", ImageLimits(max_bytes=100), "at most 100 are allowed"),
    ("WIDE", ImageLimits(max_pixels=1000), "at most 1000 are allowed"),
])
def test_bad_images_are_one_clear_error(source, limits, message):
    if source == "BIG":
        source = _png(picture(64, 64))
    elif source == "WIDE":
        source = _png(picture(100, 20))  # 2000 pixels, refused from the header
    with pytest.raises(SamplingParamsError, match=message) as e:
        open_image(source, limits)
    assert " at 0x" not in str(e.value)  # Pillow's message names the in-memory buffer object
