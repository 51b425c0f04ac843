"""Where an image comes from and how it is decoded, for untrusted input: a `data:` URL, an http(s) URL only when the
deployment fetches them, a local path or a PIL image only for a caller on its own machine (`ImageLimits.local_files`:
the Python API and the CLI, never the server); every read stops at the byte cap plus one. Only PNG, JPEG, GIF and
WebP are decoded (Pillow's `formats=`: no plugin that starts a process), the header is checked against the caps
(pixels, longest side, aspect ratio) before any pixel is decoded, and an image much larger than the model will see
is reduced while it is decoded (JPEG's DCT scaling) or right after (an integer box reduce), so that what it costs is
bounded by the caps."""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from dgemma.image_limits import ImageLimits
from dgemma.errors import SamplingParamsError

FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
MEDIA_TYPES = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "gif": "GIF", "webp": "WEBP"}  # data:image/<subtype>
# Images with more pixels than this are reduced (by an integer factor) to keep at least `keep_pixels` before the
# reference's resize; below it the pixels are exactly the reference processor's
EXACT_PIXELS = 8 << 20
STRIP_PIXELS = 1 << 22  # pixels of the source reduced at a time
WEBP_PIXELS = 1 << 24  # Pillow decodes a WebP whole, at about 15 bytes a pixel (a reduction cannot come first)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def pil():
    try:
        from PIL import Image
    except ImportError:
        raise SamplingParamsError("image inputs need Pillow: pip install pillow", "image") from None
    return Image


def open_image(source: Any, limits: ImageLimits = ImageLimits(), param: str = "image", keep_pixels: int = 0):
    """A decoded PIL image from a `data:` URL, an http(s) URL, bytes, and for a local caller a path or a PIL image;
    every failure is one clear error that says nothing about the server's files. `keep_pixels`: the fewest pixels a
    reduction may leave (about 4x what the model's resize keeps)."""
    Image = pil()
    if isinstance(source, Image.Image) and limits.local_files:
        return _checked(source, limits, param)
    data = _read(source, limits, param)
    if len(data) > limits.max_bytes:
        raise SamplingParamsError(f"the image has more than {limits.max_bytes} bytes; at most {limits.max_bytes} "
                                  "are allowed", param)
    return decode(data, limits, param, keep_pixels)


def _read(source: Any, limits: ImageLimits, param: str) -> bytes:
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, Path) and limits.local_files:
        return _file(source, limits, param)
    if not isinstance(source, str):
        raise SamplingParamsError(_expected(limits), param)
    scheme = (m.group(1).lower() if (m := _SCHEME.match(source)) else "")
    if scheme == "data":
        return _data_url(source, limits, param)
    if scheme in ("http", "https"):
        return _fetch(source, limits, param)
    if limits.local_files and scheme in ("", "file"):
        return _file(Path(source[len("file://"):] if scheme else source), limits, param)
    raise SamplingParamsError(_expected(limits), param)


def _expected(limits: ImageLimits) -> str:
    if limits.local_files:
        return "an image is a PIL image, a file path, bytes, a data: URL or an http(s) URL"
    remote = " or an http(s) URL" if limits.fetch_urls else ""
    return f"an image is a data:image/...;base64,... URL{remote}"


def _data_url(url: str, limits: ImageLimits, param: str) -> bytes:
    head, _, payload = url.partition(",")
    media = head[len("data:"):].lower().split(";")
    if media[-1] != "base64" or not media[0].startswith("image/"):
        raise SamplingParamsError("an image data URL must be data:image/...;base64,...", param)
    if media[0][len("image/"):] not in MEDIA_TYPES:
        raise SamplingParamsError(f"{media[0]} images are not accepted; send PNG, JPEG, GIF or WebP", param)
    if len(payload) > 4 * (limits.max_bytes // 3 + 1):
        raise SamplingParamsError(f"the image is larger than {limits.max_bytes} bytes", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise SamplingParamsError("the image data URL is not valid base64", param) from None


def _fetch(url: str, limits: ImageLimits, param: str) -> bytes:
    if not limits.fetch_urls:
        raise SamplingParamsError("remote image URLs are not fetched by this server (send the image as a data: URL, "
                                  "or start it with --fetch-image-urls)", param)
    import urllib.request

    class HttpOnly(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            if (m := _SCHEME.match(newurl)) is None or m.group(1).lower() not in ("http", "https"):
                raise ValueError("a redirect leaves http(s)")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    try:
        with urllib.request.build_opener(HttpOnly).open(url, timeout=10) as response:
            return response.read(limits.max_bytes + 1)
    except (OSError, ValueError) as e:
        raise SamplingParamsError(f"cannot fetch the image at {url}: {e}", param) from None


def _file(path: Path, limits: ImageLimits, param: str) -> bytes:
    """A regular file's first max_bytes + 1 bytes (a FIFO, a device or a directory is refused before any read)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError:
            os.close(fd)
            raise
        if not regular:
            os.close(fd)
            raise SamplingParamsError(f"{path} is not a regular file", param)
        with os.fdopen(fd, "rb") as f:
            return f.read(limits.max_bytes + 1)
    except OSError as e:
        raise SamplingParamsError(f"cannot read image {path}: {e.strerror}", param) from None


def decode(data: bytes, limits: ImageLimits, param: str = "image", keep_pixels: int = 0):
    """PNG, JPEG, GIF or WebP bytes -> a loaded PIL image, checked from its header before decoding and reduced
    while decoding when it is large (`reduce_factor`)."""
    Image = pil()
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Exception:  # UnidentifiedImageError, or a header Pillow cannot parse
        raise SamplingParamsError("the image is not a PNG, JPEG, GIF or WebP file", param) from None
    _checked(image, limits, param)
    if image.format == "WEBP" and image.width * image.height > WEBP_PIXELS:
        raise SamplingParamsError(f"the WebP image has {image.width}x{image.height} pixels; a WebP image may have "
                                  f"at most {WEBP_PIXELS} (send a larger image as PNG or JPEG)", param)
    try:
        factor = reduce_factor(image.size, keep_pixels)
        if factor > 1 and image.format == "JPEG":
            image.draft(image.mode, (image.width // factor, image.height // factor))  # DCT scaling, 1/2 to 1/8
        image.load()
        return _reduced(image, reduce_factor(image.size, keep_pixels))
    except SamplingParamsError:
        raise
    except Exception as e:  # Pillow raises many kinds (OSError, ValueError, DecompressionBombError, SyntaxError)
        detail = re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", str(e))  # no object reprs of the in-memory buffer
        raise SamplingParamsError(f"the image cannot be decoded ({type(e).__name__}: {detail})", param) from None


def reduce_factor(size: tuple[int, int], keep_pixels: int) -> int:
    """1 for an image of at most EXACT_PIXELS (exact), else the largest integer k that leaves at least
    `keep_pixels` pixels."""
    pixels = size[0] * size[1]
    if pixels <= EXACT_PIXELS:
        return 1
    return max(1, min(int(math.sqrt(pixels / max(keep_pixels, 1))), min(size)))


def _reduced(image, factor: int):
    """A box reduce by `factor`, a strip of rows at a time (Pillow's own reduce of RGBA or LA makes a premultiplied
    copy of the whole image first: twice the memory); modes it cannot average take the nearest pixel."""
    if factor <= 1:
        return image
    size = (max(1, image.width // factor), max(1, image.height // factor))
    if image.mode not in ("L", "LA", "RGB", "RGBA", "I", "F"):  # palette indices, 16-bit grey, bilevel, CMYK...
        return image.resize(size, resample=pil().Resampling.NEAREST)
    out = pil().new(image.mode, size)
    rows = factor * max(1, STRIP_PIXELS // (image.width * factor))
    for top in range(0, size[1] * factor, rows):
        bottom = min(top + rows, size[1] * factor)
        out.paste(image.crop((0, top, size[0] * factor, bottom)).reduce(factor), (0, top // factor))
    return out


def _checked(image, limits: ImageLimits, param: str):
    width, height = image.size
    if width < 1 or height < 1:
        raise SamplingParamsError("the image is empty", param)
    if width * height > limits.max_pixels:
        raise SamplingParamsError(f"the image has {width}x{height} pixels; at most {limits.max_pixels} are allowed",
                                  param)
    if max(width, height) > limits.max_side:
        raise SamplingParamsError(f"the image is {width}x{height}; its longest side may have at most "
                                  f"{limits.max_side} pixels", param)
    if max(width, height) > limits.max_aspect * min(width, height):
        raise SamplingParamsError(f"the image is {width}x{height}; its sides may differ by a factor of "
                                  f"{limits.max_aspect} at most", param)
    return image
