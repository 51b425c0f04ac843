"""What one request may send as images (bytes, decoded pixels, count, soft tokens per image), declared once for the
Python API, `dgemma generate` and `dgemma serve`, with the command-line options that set it (no torch import here:
`--help` stays fast)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dgemma.errors import ConfigError

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the reference processor's allowed max_soft_tokens


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 << 20  # encoded (file, data: URL payload, or fetched) bytes per image
    max_pixels: int = 50_000_000  # decoded width x height per image, read from the header before decoding
    max_side: int = 32768  # the longest side, in pixels
    max_aspect: int = 64  # the longer side over the shorter, at most
    max_images: int = 8  # per request
    max_soft_tokens: int = 280  # per image: the image is resized to at most this many soft tokens
    fetch_urls: bool = False  # http(s) image URLs: refused unless the deployment allows fetching them
    local_files: bool = True  # paths and PIL images: the caller's own machine (the server sets False)

    def __post_init__(self) -> None:
        if self.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ConfigError(f"max_soft_tokens={self.max_soft_tokens} must be one of {SOFT_TOKEN_BUDGETS}")
        if min(self.max_bytes, self.max_pixels, self.max_side, self.max_aspect) <= 0 or self.max_images < 0:
            raise ConfigError("image limits must be positive")


def add_image_options(p: argparse.ArgumentParser, fetch: bool = False) -> None:
    d = ImageLimits()
    p.add_argument("--image-tokens", type=int, choices=SOFT_TOKEN_BUDGETS, default=d.max_soft_tokens,
                   help=f"soft tokens per image at most (the image is resized to fit; default {d.max_soft_tokens})")
    p.add_argument("--max-images", type=int, default=d.max_images,
                   help=f"images per request at most (default {d.max_images})")
    p.add_argument("--max-image-bytes", type=int, default=d.max_bytes,
                   help=f"encoded bytes per image at most (default {d.max_bytes}, {d.max_bytes >> 20} MiB)")
    p.add_argument("--max-image-pixels", type=int, default=d.max_pixels,
                   help=f"decoded width x height per image at most (default {d.max_pixels})")
    p.add_argument("--max-image-side", type=int, default=d.max_side,
                   help=f"pixels on an image's longest side at most (default {d.max_side})")
    p.add_argument("--max-image-aspect", type=int, default=d.max_aspect,
                   help=f"an image's longer side over its shorter at most (default {d.max_aspect})")
    if fetch:
        p.add_argument("--fetch-image-urls", action="store_true", help="fetch http(s) image_url parts (default: "
                       "refused with 400; data: URLs are always accepted). The server then makes requests for clients")


def limits_from_args(args: argparse.Namespace, fetch_urls: bool = False, local_files: bool = True) -> ImageLimits:
    return ImageLimits(args.max_image_bytes, args.max_image_pixels, args.max_image_side, args.max_image_aspect,
                       args.max_images, args.image_tokens, fetch_urls, local_files)
