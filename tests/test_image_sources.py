"""Images from untrusted clients (issue 39): nothing but data: URLs (and http(s) when the deployment fetches) is
read for the server, whatever the scheme's case, and the refusal says nothing about the server's files; a local
caller's paths are read only when they are regular files, at most the byte cap plus one; only PNG, JPEG, GIF and
WebP are decoded (no plugin, no child process); the header is checked against the caps before decoding; a large
image is reduced while it is decoded, close to the exact pixels."""

import base64
import io
import os
import subprocess
import threading

import pytest
import torch

from dgemma.image_limits import ImageLimits
from dgemma.image_sources import EXACT_PIXELS, open_image, reduce_factor
from dgemma.images import preprocess
from dgemma.sampling import SamplingParamsError

Image = pytest.importorskip("PIL.Image")
SERVER = ImageLimits(local_files=False)


def encoded(image, fmt="PNG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media="image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def refused(source, limits=SERVER, match=None) -> str:
    with pytest.raises(SamplingParamsError, match=match) as e:
        open_image(source, limits)
    return str(e.value)


@pytest.fixture
def server_files(tmp_path):
    png = tmp_path / "secret.png"
    png.write_bytes(encoded(Image.new("RGB", (8, 8), (1, 2, 3))))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    unreadable = tmp_path / "unreadable.png"
    unreadable.write_bytes(b"x")
    unreadable.chmod(0)
    return png, fifo, tmp_path, unreadable


def test_the_server_reads_no_path_and_tells_nothing_about_its_files(server_files):
    png, fifo, folder, unreadable = server_files
    sources = [str(png), f"file://{png}", f"FILE://{png}", f"File://{png}", str(fifo), str(folder),
               str(unreadable), "/etc/passwd", "/dev/zero", "/nonexistent/a.png", "ftp://example.com/a.png",
               "gopher://x", "\\\\host\\share\\a.png", png]
    messages = {refused(source) for source in sources}
    assert messages == {"an image is a data:image/...;base64,... URL"}  # one answer, whatever is on the disk


def test_http_in_any_case_is_a_fetch_which_the_server_refuses_unless_told():
    for url in ("http://127.0.0.1:9/a.png", "HTTP://127.0.0.1:9/a.png", "HtTpS://127.0.0.1:9/a.png"):
        refused(url, match="not fetched")
    assert "or an http(s) URL" in refused("/etc/passwd", ImageLimits(local_files=False, fetch_urls=True))


def test_a_local_caller_reads_only_regular_files_and_at_most_the_cap(server_files, tmp_path):
    png, fifo, folder, _ = server_files
    assert open_image(png).size == open_image(f"file://{png}").size == (8, 8)
    result = []
    reader = threading.Thread(target=lambda: result.append(refused(str(fifo), ImageLimits())), daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive() and "not a regular file" in result[0]  # a FIFO never blocks the reader
    assert "not a regular file" in refused("/dev/zero", ImageLimits())
    assert "not a regular file" in refused(str(folder), ImageLimits())
    big = tmp_path / "big.png"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: a gigabyte a naive read would hold in memory
    assert "more than 1000 bytes" in refused(big, ImageLimits(max_bytes=1000))


@pytest.mark.parametrize("fmt,options", [("TIFF", {}), ("BMP", {}), ("ICO", {}), ("TIFF", {"mode": "F"}),
                                         ("PPM", {}), ("PCX", {})])
def test_only_png_jpeg_gif_webp_are_decoded_whatever_the_media_type_says(fmt, options):
    image = Image.new(options.get("mode", "RGB"), (16, 16))
    for media in ("image/png", "image/jpeg"):
        refused(data_url(encoded(image, fmt), media), match="not a PNG, JPEG, GIF or WebP")
    refused(data_url(encoded(image, fmt), f"image/{fmt.lower()}"), match="not accepted")


def test_an_eps_payload_never_starts_a_process(monkeypatch):
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail("a process started"))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nnewpath 0 0 moveto 16 16 lineto stroke\nshowpage\n"
    message = refused(data_url(eps), match="not a PNG, JPEG, GIF or WebP")
    assert not started and "gs" not in message and "ghostscript" not in message.lower()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_the_four_formats_decode(fmt):
    image = Image.new("RGB", (20, 10), (200, 10, 10))
    assert open_image(data_url(encoded(image, fmt), f"image/{fmt.lower()}"), SERVER).size == (20, 10)


@pytest.mark.parametrize("size,limits,message", [
    ((1, 49_000_000), ImageLimits(), "longest side"),  # the 127 KB body that cost 2.5 GB
    ((49_000_000, 1), ImageLimits(), "longest side"),
    ((20_000, 100), ImageLimits(), "differ by a factor of 64"),
    ((40_000, 1_000), ImageLimits(), "longest side may have at most 32768"),
    ((8_000, 8_000), ImageLimits(), "at most 50000000 are allowed"),
    ((300, 10), ImageLimits(max_aspect=20), "factor of 20"),
])
def test_caps_are_checked_from_the_header_before_decoding(size, limits, message, monkeypatch):
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("pixels were decoded"))
    header = _png_header(*size)
    refused(data_url(header), limits, match=message)


def test_a_large_webp_is_refused_before_it_is_decoded(monkeypatch):
    from PIL import ImageFile

    data = encoded(Image.new("RGB", (4100, 4100)), "WEBP")  # 16.8 M pixels: 250 MB to decode whole
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("pixels were decoded"))
    refused(data_url(data, "image/webp"), match="a WebP image may have at most 16777216")


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height grey pixels (the data is never reached)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def test_small_images_are_exact_and_large_ones_reduced_to_what_the_model_keeps():
    keep = 4 * 280 * 48 ** 2  # 4x the pixels the 280-token resize keeps
    assert reduce_factor((4032, 2016), keep) == 1  # under EXACT_PIXELS: the reference's own pixels
    assert reduce_factor((6000, 4000), keep) == 3 and 6000 * 4000 > EXACT_PIXELS
    assert reduce_factor((6000, 4000), 0) == 4000  # no floor given: down to one row at most, never zero


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_reduced_image_stays_close_to_the_exact_pixels(fmt):
    """A 12-megapixel photo-like picture (smooth gradients, an edge, noise), reduced while decoding, against the
    same file decoded whole: the model's input pixels differ by at most a few levels."""
    h, w = 3000, 4000
    y, x = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    noise = torch.rand(h, w, generator=torch.Generator().manual_seed(0)) * 0.05
    rgb = torch.stack([x, y, ((x - 0.5) ** 2 + (y - 0.5) ** 2 < 0.1).float()], -1) * 0.9 + noise[..., None]
    picture = Image.fromarray((rgb.clamp(0, 1) * 255).to(torch.uint8).numpy(), "RGB")
    data = encoded(picture, fmt, **({"quality": 95} if fmt == "JPEG" else {"compress_level": 1}))
    keep = 4 * 280 * 48 ** 2
    reduced = open_image(data, ImageLimits(max_bytes=1 << 28), keep_pixels=keep)
    exact = Image.open(io.BytesIO(data))
    exact.load()
    assert reduced.size[0] * reduced.size[1] <= exact.size[0] * exact.size[1] / 4
    a, b = preprocess(reduced, 16, 3), preprocess(exact, 16, 3)
    assert torch.equal(a.positions, b.positions)
    diff = (a.pixels - b.pixels).abs()
    assert diff.mean() < 1 / 255 and diff.max() < 24 / 255, (diff.mean(), diff.max())
