"""Images in prompts: the Gemma 4 image processor (resize keeping the aspect ratio to a soft-token budget, rescale
to [0, 1], patches with their (x, y) positions), and chat messages with image parts turned into prompt ids (each
image: boi, its soft-token ids, eoi). Where images come from and how they are decoded: `image_sources`. Text prompts
never import Pillow."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dgemma.image_limits import ImageLimits
from dgemma.image_sources import open_image, pil
from dgemma.model.soft_tokens import HeldIds
from dgemma.sampling import SamplingParamsError

MARKER = "\ue000dgemma-image\ue000"  # stands for an image in the rendered chat template (private-use characters)


@dataclass(frozen=True)
class Patches:
    """One preprocessed image: pixels [P, 3 * patch^2] in [0, 1] (rows of patches, each patch row-major then
    channel), positions [P, 2] (x, y), and the soft tokens it becomes (P / pooling^2)."""

    pixels: torch.Tensor
    positions: torch.Tensor
    soft_tokens: int

    def key(self, partition: str | None = None) -> str:
        """Identical pixels in the same partition (API key, cache salt), identical key: the model reuses the image's
        soft-token ids and features; another partition computes its own (no client learns what another sent)."""
        salt = b"" if partition is None else hashlib.sha256(partition.encode()).digest()
        return hashlib.sha256(salt + self.pixels.numpy().tobytes() + self.positions.numpy().tobytes()).hexdigest()


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
    Image = pil()
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


def prompt_ids(encoder, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               limits: ImageLimits, partition: str | None = None, extra: dict[str, Any] | None = None) -> HeldIds:
    """The ids of chat messages with content parts (`encoder`: a `dgemma.api.prompts.PromptEncoder`): the
    template's text with each image as boi + its soft-token ids + eoi, holding the images' features. Every input
    check runs before the vision tower does; `partition` keeps one client's images apart from another's; `extra`: the
    chat template's own arguments."""
    module, tokenizer = encoder.module, encoder.require_tokenizer()
    cfg = module.cfg
    if _count(messages) and module.vision is None:
        raise SamplingParamsError("this checkpoint has no vision tower: it takes text prompts only", "messages")
    plain, images = split_messages(messages, limits, _keep_pixels(cfg.vision, limits))
    wraps = [t for t in (cfg.boi_token_id, cfg.eoi_token_id) if t is not None]
    if any(not 0 <= t < cfg.text.vocab_size for t in wraps):
        raise SamplingParamsError(f"this checkpoint's boi/eoi token ids {wraps} lie outside its vocabulary",
                                  "messages")
    v = cfg.vision
    patches = [preprocess(image, v.patch_size, v.pooling_kernel_size, limits.max_soft_tokens) for image in images]
    pieces = tokenizer.encode_chat_pieces(plain, tools, MARKER, extra)  # text parts stay text, as in a text chat
    if len(pieces) != len(images) + 1:
        raise SamplingParamsError("the chat template dropped or repeated an image part", "messages")
    encoder.check_ids([t for piece in pieces for t in piece])
    ids, held = pieces[0], []
    for image, piece in zip(patches, pieces[1:]):
        soft, features = module.image_ids(image.key(partition), image.pixels, image.positions)
        ids, held = [*ids, *wraps[:1], *soft, *wraps[1:], *piece], [*held, features]
    return HeldIds(ids, tuple(held))


def _keep_pixels(vision, limits: ImageLimits) -> int:
    """The fewest pixels a reduction while decoding may leave: 4x the most the resize keeps (twice each side)."""
    return 0 if vision is None else 4 * limits.max_soft_tokens * (vision.pooling_kernel_size * vision.patch_size) ** 2


def split_messages(messages: list[dict[str, Any]], limits: ImageLimits,
                   keep_pixels: int = 0) -> tuple[list[dict[str, Any]], list]:
    """Messages whose list contents become strings (an image part becomes MARKER), and the images in order,
    decoded after their number is checked (`keep_pixels`: `open_image`'s)."""
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
                images.append(open_image(_source(part, kind, where), limits, where, keep_pixels))
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
