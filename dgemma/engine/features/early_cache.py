"""Early commit into the cache (`SamplingParams.early_commit_cache`): a row's frozen prefix (features/early_commit.py)
is encoded into the row's own KV cache before the next pass, as the canvas's commit would encode it (the encoder
is causal: those positions' keys and values do not depend on what follows them), and the canvas's own commit
encodes only the rest. The pass then starts at the smallest moved prefix among its rows; a row that moved more
keeps the rest of its moved positions in the pass, hidden from the canvas (`DiffusionGemma.denoise(hide=...)`), so
that what it sees does not depend on its batch-mates. Every frozen position, moved or still held, leaves the head
work like a settled one (its previous outputs kept, its entropy 0); the canvas's bookkeeping keeps its full width."""

from __future__ import annotations

import torch
from torch import Tensor

from dgemma.engine.batch import Canvas
from dgemma.engine.request import Request
from dgemma.model import DiffusionGemma
from dgemma.sampling.fused import Reuse

# A move is one more encoder pass (every weight read once more, however few its tokens): frozen positions wait
# until they are at least 1 / MOVE_SHARE of the canvas (or the canvas ends without them).
MOVE_SHARE = 8


def move(model: DiffusionGemma, rows: list[Request], cv: Canvas, caches: list) -> None:
    """Encode each opted-in live row's frozen, not yet moved ids (its committed text) into its cache, rows with as
    many to move together."""
    least = max(1, cv.tokens.shape[1] // MOVE_SHARE)
    going: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if r.params.early_commit_cache and not r.finished and not cv.done[i] and r.sent - r.moved >= least:
            going.setdefault(r.sent - r.moved, []).append(i)
    for group in going.values():
        ids = torch.stack([cv.argmax[i, rows[i].moved:rows[i].sent] for i in group])
        model.encode(ids, [caches[i] for i in group])
        for i in group:
            rows[i].moved = rows[i].sent


def denoise(model: DiffusionGemma, rows: list[Request], cv: Canvas, caches: list,
            reuse: Reuse | None) -> tuple[Tensor, Reuse] | None:
    """The decoder pass [B, C, H] over the positions no row moved (zeros for the others) and what the step leaves
    out: `reuse` and every opted-in row's frozen positions (held ones too: their head work decides nothing); None
    when no row has any."""
    held = [r.sent if r.params.early_commit_cache else 0 for r in rows]
    if not any(held):
        return None
    moved = [r.moved for r in rows]
    low = min(moved)
    signal = None if cv.signal is None else cv.signal[:, low:]
    hidden = model.denoise(cv.tokens[:, low:], caches, signal, hide=[m - low for m in moved])
    hidden = torch.nn.functional.pad(hidden, (0, 0, low, 0))
    device = hidden.device
    skip = torch.arange(cv.tokens.shape[1], device=device)[None] < torch.tensor(held, device=device)[:, None]
    _count(rows, cv, low, skip if reuse is None else skip & ~reuse.skip)  # settled positions count already
    return hidden, Reuse(skip if reuse is None else skip | reuse.skip, cv.argmax, cv.tokens, cv.signal)


def _count(rows: list[Request], cv: Canvas, low: int, skip: Tensor) -> None:
    """The work left out, for bench/flops.py: `low` positions of the body and the skipped ones' head and soft
    embedding, per row that stepped."""
    wanted_signal = not cv.last_step(rows)
    for r, done, n in zip(rows, cv.done, skip.sum(1).tolist()):
        if not done:
            r.stats.skipped_body_rows += low
            r.stats.skipped_head_rows += n
            r.stats.skipped_soft_rows += n * wanted_signal
