"""Autoregressive decoding of the same weights: the encoder as a plain next-token model (one token per pass)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from dgemma.engine.request import Event, Request
from dgemma.model import DiffusionGemma
from dgemma.sampling import sample_next


@torch.inference_mode()
def decode(model: DiffusionGemma, req: Request) -> Iterator[Event]:
    """Greedy (ar_temperature 0) or sampled decoding; every token is committed as it is produced."""
    req.stats.t_start = time.perf_counter()
    cache = model.new_cache(1, len(req.prompt) + req.params.max_new_tokens + 1)
    hidden = model.encode(torch.tensor([req.prompt], device=model.device), cache)
    while not req.finished:
        logits = model.head(hidden[:, -1])
        token = int(sample_next(logits, req.params.ar_temperature, req.generator)[0])
        req.stats.decoder_passes += 1
        req.stats.t_first_commit = req.stats.t_first_commit or time.perf_counter()
        if token in req.eos:
            reason = "stop"
        else:
            req.output.append(token)
            yield Event(req.id, "commit", [token])
            reason = "length" if req.budget <= 0 else None
        if reason:
            req.finish_reason = reason
            req.stats.t_end = time.perf_counter()
            yield Event(req.id, "finish", finish_reason=reason)
            return
        hidden = model.encode(torch.tensor([[token]], device=model.device), cache)
