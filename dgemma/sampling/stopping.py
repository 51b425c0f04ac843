"""When to stop: early exit of a canvas's denoising loop (stable and confident argmax), EOS padding of
a finished canvas, and stop strings on decoded text."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dgemma.sampling.samplers import token_entropy


def freeze_rows(finished: Tensor, old: Tensor, new: Tensor) -> Tensor:
    """Rows already finished keep their old value, as HF's `_denoising_step` does for the argmax canvas,
    the canvas and the self-conditioning logits. finished: bool [B]; old, new: [B, ...]."""
    return torch.where(finished.view(-1, *([1] * (new.dim() - 1))), old, new)


class StableConfidentStopper:
    """HF `StableAndConfidentStoppingCriteria`: a row stops when its argmax canvas equals each of the
    previous `stability_threshold` ones and its mean token entropy is below `confidence_threshold`.

    Keeps the previous argmax and a run length of unchanged steps per row instead of HF's
    [threshold, B, C] history; the previous argmax starts at -1 like HF's history, so a row can be
    stable at the earliest on step threshold + 1 (threshold 0: always stable). Thresholds are numbers,
    or tensors [B] for per-row values."""

    def __init__(self, stability_threshold: int | Tensor, confidence_threshold: float | Tensor):
        self.stability_threshold = stability_threshold
        self.confidence_threshold = confidence_threshold
        self._prev: Tensor | None = None  # [B, C] argmax of the previous step
        self._run: Tensor | None = None  # [B] consecutive steps with an unchanged argmax

    def select(self, rows: Tensor) -> None:
        """Keep only these batch rows (index tensor), e.g. when aborted requests leave mid-canvas."""
        if self._prev is not None:
            self._prev, self._run = self._prev[rows], self._run[rows]
        if isinstance(self.stability_threshold, Tensor):
            self.stability_threshold = self.stability_threshold[rows]
        if isinstance(self.confidence_threshold, Tensor):
            self.confidence_threshold = self.confidence_threshold[rows]

    def put(self, rows: Tensor, fresh: StableConfidentStopper) -> None:
        """Rows `rows` (index tensor) start over with `fresh`'s thresholds and history (a new canvas)."""
        if self._prev is not None:
            prev, run = fresh._history(self._prev.shape[1], self._prev.device, len(rows))
            self._prev[rows], self._run[rows] = prev, run
        self.stability_threshold[rows] = fresh.stability_threshold
        self.confidence_threshold[rows] = fresh.confidence_threshold

    def extend(self, fresh: StableConfidentStopper) -> None:
        """`fresh`'s rows join after these (per-row threshold tensors on both sides)."""
        if self._prev is not None:
            prev, run = fresh._history(self._prev.shape[1], self._prev.device, len(fresh.stability_threshold))
            self._prev, self._run = torch.cat([self._prev, prev]), torch.cat([self._run, run])
        self.stability_threshold = torch.cat([self.stability_threshold, fresh.stability_threshold])
        self.confidence_threshold = torch.cat([self.confidence_threshold, fresh.confidence_threshold])

    def _history(self, width: int, device, rows: int) -> tuple[Tensor, Tensor]:
        """(previous argmax [rows, width], run [rows]): this stopper's, or a fresh one's (-1, 0)."""
        if self._prev is not None:
            return self._prev, self._run
        return (torch.full((rows, width), -1, dtype=torch.long, device=device),
                torch.zeros(rows, dtype=torch.long, device=device))

    def update(self, argmax_canvas: Tensor, scores: Tensor, active: Tensor | None = None) -> Tensor:
        """One denoising step. argmax_canvas [B, C]; scores: token entropies [B, C] (as returned by the
        step) or processed logits [B, C, V]. Returns bool [B]: stable & confident, or not active.
        Pass finished rows their frozen argmax (`freeze_rows`) as HF does."""
        entropy = token_entropy(scores, dtype=None) if scores.dim() == 3 else scores
        done = self._stable(argmax_canvas) & (entropy.mean(-1) < self.confidence_threshold)
        return done if active is None else done | ~active

    def _stable(self, argmax: Tensor) -> Tensor:
        if self._prev is None:
            self._prev = torch.full_like(argmax, -1)
            self._run = torch.zeros(argmax.shape[0], dtype=torch.long, device=argmax.device)
        same = (argmax == self._prev).all(-1)
        self._run = torch.where(same, self._run + 1, 0)
        self._prev = argmax.clone()
        return self._run >= self.stability_threshold


def finalize_canvas(canvas: Tensor, eos_ids: Tensor | Sequence[int], pad_id: int, finished: Tensor) -> Tensor:
    """Pad a finished canvas [B, C] like HF `_finalize_canvas`: rows finished in an earlier canvas become
    all pad; in the others every token after the first EOS becomes pad (the EOS stays). eos_ids: [E] for
    every row, or [B, E] per row (padded with -1)."""
    eos = torch.as_tensor(eos_ids, dtype=torch.long, device=canvas.device)
    eos = eos.view(1, -1) if eos.dim() == 1 else eos
    is_eos = (canvas[:, :, None] == eos[:, None, :]).any(-1)
    seen = is_eos.cumsum(-1)
    after_first = (seen > 0) & ~((seen == 1) & is_eos)
    return canvas.masked_fill(after_first | finished[:, None], pad_id)


def truncate_at_stop_strings(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Text before the earliest occurrence of any stop string, and whether one occurred."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters a streamer must hold back: the longest suffix of `text` that is a
    proper prefix of some stop string (it may still become a stop). Looks at the last len(stop) - 1
    characters only, so the cost does not grow with `text`."""
    best = 0
    for s in stops:
        tail = text[len(text) - min(len(s) - 1, len(text)):]
        i = tail.find(s[:1]) if s else -1
        while i >= 0 and len(tail) - i > best:  # the first start that fits is the longest suffix
            if s.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return best
