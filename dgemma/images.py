"""Images in prompts: decoding with Pillow under byte and pixel caps, the Gemma 4 image processor (resize keeping
the aspect ratio to a soft-token budget, rescale to [0, 1], patches with their (x, y) positions), and chat messages
with image parts turned into prompt ids (each image: boi, its soft-token ids, eoi).

Pillow is the `images` extra (`pip install dgemma[images]`); text prompts never import it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dgemma.image_limits import ImageLimits
from dgemma.sampling import SamplingParamsError

MARKER = "\ue000dgemma-image\ue000"  # stands for an image in the rendered chat template (private-use characters)


@dataclass(frozen=True)
class Patches:
    """One preprocessed image: pixels [P, 3 * patch^2] in [0, 1] (rows of patches, each patch row-major then
    channel), positions [P, 2] (x, y), and the soft tokens it becomes (P / pooling^2)."""

    pixels: torch.Tensor
    positions: torch.Tensor
    soft_tokens: int

    def key(self) -> str:
        """Identical pixels, identical key: the model reuses the image's soft-token ids."""
        return hashlib.sha256(self.pixels.numpy().tobytes() + self.positions.numpy().tobytes()).hexdigest()


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise SamplingParamsError("image inputs need Pillow: pip install 'dgemma[images]'", "image") from None
    return Image


def open_image(source: Any, limits: ImageLimits = ImageLimits(), param: str = "image"):
    """A PIL image from a PIL image, a file path, bytes, or a `data:` URL; every failure is one clear error."""
    Image = _pil()
    if isinstance(source, Image.Image):
        return _checked(source, limits, param)
    if isinstance(source, str) and source.startswith("data:"):
        data = _data_url(source, limits, param)
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        data = _fetch(source, limits, param)
    elif isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    elif isinstance(source, (str, Path)):
        data = _file(Path(source), limits, param)
    else:
        raise SamplingParamsError("an image is a PIL image, a file path, bytes or a data: URL", param)
    if len(data) > limits.max_bytes:
        raise SamplingParamsError(f"the image has {len(data)} bytes; at most {limits.max_bytes} are allowed", param)
    try:
        image = Image.open(io.BytesIO(data))
        _checked(image, limits, param)  # from the header, before the pixels are decoded
        image.load()
    except SamplingParamsError:
        raise
    except Exception as e:  # Pillow raises many kinds (UnidentifiedImageError, OSError, DecompressionBombError)
        detail = re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", str(e))  # no object reprs of the in-memory buffer
        raise SamplingParamsError(f"the image cannot be decoded ({type(e).__name__}: {detail})", param) from None
    return image


def _checked(image, limits: ImageLimits, param: str):
    width, height = image.size
    if width * height > limits.max_pixels:
        raise SamplingParamsError(f"the image has {width}x{height} pixels; at most {limits.max_pixels} are allowed",
                                  param)
    if width < 1 or height < 1:
        raise SamplingParamsError("the image is empty", param)
    return image


def _data_url(url: str, limits: ImageLimits, param: str) -> bytes:
    head, _, payload = url.partition(",")
    if not head.endswith(";base64") or not head.startswith("data:image/"):
        raise SamplingParamsError("an image data URL must be data:image/...;base64,...", param)
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

    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (http(s) only, checked above)
            return response.read(limits.max_bytes + 1)
    except (OSError, ValueError) as e:
        raise SamplingParamsError(f"cannot fetch the image at {url}: {e}", param) from None


def _file(path: Path, limits: ImageLimits, param: str) -> bytes:
    try:
        if path.stat().st_size > limits.max_bytes:
            raise SamplingParamsError(f"{path} has more than {limits.max_bytes} bytes", param)
        return path.read_bytes()
    except OSError as e:
        raise SamplingParamsError(f"cannot read image {path}: {e.strerror}", param) from None


def target_size(height: int, width: int, patch: int, pooling: int, max_soft_tokens: int) -> tuple[int, int]:
    """The reference's resize target: the largest size keeping the aspect ratio with at most max_soft_tokens *
    pooling^2 patches, each side a multiple of pooling * patch (a side that rounds to 0 takes one such step)."""
    max_patches = max_soft_tokens * pooling**2
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    step = pooling * patch
    h, w = int(math.floor(factor * height / step)) * step, int(math.floor(factor * width / step)) * step
    longest = (max_patches // pooling**2) * step
    if h == 0 and w == 0:
        raise SamplingParamsError("the image is too small to resize", "image")
    if h == 0:
        h, w = step, min(int(math.floor(width / height)) * step, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * step, longest), step
    return h, w


def preprocess(image, patch: int, pooling: int, max_soft_tokens: int = ImageLimits.max_soft_tokens) -> Patches:
    """What the reference's Gemma 4 image processor (Pillow backend) makes of one image: RGB (transparency on
    white), bicubic resize to `target_size`, pixels / 255, patches in row-major order."""
    Image = _pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    elif image.mode != "RGB":
        image = image.convert("RGB")
    h, w = target_size(image.height, image.width, patch, pooling, max_soft_tokens)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    pixels = (np.asarray(image, dtype=np.float64) * (1 / 255)).astype(np.float32)  # [h, w, 3]
    rows, cols = h // patch, w // patch
    patches = pixels.reshape(rows, patch, cols, patch, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, -1)
    y, x = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    positions = np.stack([x.reshape(-1), y.reshape(-1)], axis=-1)
    return Patches(torch.from_numpy(np.ascontiguousarray(patches)), torch.from_numpy(positions).long(),
                   rows * cols // pooling**2)


def has_parts(prompt: Any) -> bool:
    """Whether a prompt is chat messages of which one has a list of content parts (text and images)."""
    return isinstance(prompt, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                            for m in prompt)


def _count(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list) for p in m["content"]
               if isinstance(p, dict) and p.get("type") in ("image", "image_url"))


def prompt_ids(model, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               limits: ImageLimits) -> list[int]:
    """The ids of chat messages with content parts (`model`: a `dgemma.api.Model`): the template's text with each
    image as boi + its soft-token ids + eoi. Every input check runs before the vision tower does."""
    module, tokenizer = model.module, model._require_tokenizer()
    cfg = module.cfg
    if _count(messages) and module.vision is None:
        raise SamplingParamsError("this checkpoint has no vision tower: it takes text prompts only", "messages")
    plain, images = split_messages(messages, limits)
    wraps = [t for t in (cfg.boi_token_id, cfg.eoi_token_id) if t is not None]
    if any(not 0 <= t < cfg.text.vocab_size for t in wraps):
        raise SamplingParamsError(f"this checkpoint's boi/eoi token ids {wraps} lie outside its vocabulary",
                                  "messages")
    v = cfg.vision
    patches = [preprocess(image, v.patch_size, v.pooling_kernel_size, limits.max_soft_tokens) for image in images]
    pieces = [tokenizer.encode(p, add_bos=False) for p in tokenizer.apply_chat_template(plain, tools=tools)
              .split(MARKER)]
    if len(pieces) != len(images) + 1:
        raise SamplingParamsError("the chat template dropped or repeated an image part", "messages")
    model.check_ids([t for piece in pieces for t in piece])
    ids = pieces[0]
    for image, piece in zip(patches, pieces[1:]):
        soft = module.image_ids(image.key(), image.pixels, image.positions)
        ids = [*ids, *wraps[:1], *soft, *wraps[1:], *piece]
    return ids


def split_messages(messages: list[dict[str, Any]], limits: ImageLimits) -> tuple[list[dict[str, Any]], list]:
    """Messages whose list contents become strings (an image part becomes MARKER), and the images in order,
    decoded after their number is checked."""
    count = _count(messages)
    if count > limits.max_images:
        raise SamplingParamsError(f"{count} images; at most {limits.max_images} per request", "messages")
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        text = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                text.append(part["text"])
            elif kind in ("image", "image_url"):
                images.append(open_image(_source(part, kind, where), limits, where))
                text.append(MARKER)
            else:
                raise SamplingParamsError(f"{where} must be a text or image part", where)
        out.append({**m, "content": "".join(text)})
    return out, images


def _source(part: dict[str, Any], kind: str, where: str) -> Any:
    if kind == "image":
        return part.get("image")
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise SamplingParamsError(f"{where}: image_url must be {{\"url\": \"data:image/...;base64,...\"}}", where)
    return url
