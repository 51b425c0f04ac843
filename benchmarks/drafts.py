"""What streaming drafts costs per denoising step and per request: host time to turn one draft event into a
StreamEvent (`OutputStream.feed`: the canvas text and each position's text), first with every id unseen, then
with the per-id text remembered, and the bytes of one server draft chunk's `dgemma_draft` field with and
without the per-position fields (`tokens`, `accepted`) the playground draws. Uses the demo model's tokenizer.

    python benchmarks/drafts.py [--canvas 256] [--steps 48]

Last stdout line: JSON {feed_us_unseen, feed_us_seen, draft_bytes_text_only, draft_bytes, settings}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from dgemma.api import DEMO_MODEL  # noqa: E402
from dgemma.engine import Event, OutputStream  # noqa: E402
from dgemma.tokenizer import Tokenizer  # noqa: E402


def feed_us(tok: Tokenizer, canvases: list[list[int]], accepted: list[bool], forget: bool) -> float:
    """Median microseconds per draft over `canvases` (each a step's ids); `forget`: no remembered id texts."""
    stream, times = OutputStream(tok), []
    for ids in canvases:
        if forget:
            tok._pieces.clear()
        t = time.perf_counter()
        stream.feed(Event("r", "draft", ids, accepted=accepted))
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e6, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--canvas", type=int, default=256)
    p.add_argument("--steps", type=int, default=48)
    args = p.parse_args()
    tok, rng = Tokenizer(DEMO_MODEL), random.Random(0)
    canvases = [[rng.randrange(3, tok.vocab_size) for _ in range(args.canvas)] for _ in range(args.steps)]
    accepted = [rng.random() < 0.5 for _ in range(args.canvas)]
    unseen = feed_us(tok, canvases, accepted, forget=True)
    seen = feed_us(tok, canvases * 2, accepted, forget=False)
    event = OutputStream(tok).feed(Event("r", "draft", canvases[0], accepted=accepted))[0]
    draft = {"canvas": 0, "step": 1, "text": event.text, "token_ids": event.token_ids}
    size = lambda d: len(json.dumps(d, ensure_ascii=False, separators=(",", ":")).encode())  # noqa: E731
    print(json.dumps({"feed_us_unseen": unseen, "feed_us_seen": seen, "draft_bytes_text_only": size(draft),
                      "draft_bytes": size(draft | {"tokens": event.pieces, "accepted": accepted}),
                      "settings": {"canvas": args.canvas, "steps": args.steps, "vocab": tok.vocab_size}}))


if __name__ == "__main__":
    main()
