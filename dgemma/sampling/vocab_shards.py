"""The fused vocabulary step (sampling/fused.py) under tensor parallelism: each rank streamed its own rows of the
vocabulary; `merge` combines the ranks' running statistics by the rules the chunks combine by, so that every rank
ends with the whole vocabulary's argmax, normaliser, entropy moment, soft embedding or top-k, and the sample one
process draws from the same uniforms."""

from __future__ import annotations

import torch
from torch import Tensor

from dgemma.model.head import VocabShard
from dgemma.model.layers import all_gather, all_reduce


def merge(run, shard: VocabShard, u_take: Tensor, want_signal: bool, top_k: int | None) -> None:
    """run: this rank's `_Running` over its rows, with its chunks recorded; u_take [N, chunks of the whole
    vocabulary]: each chunk's uniform for replacing the sample. Two all-gathers of per-row statistics, and one
    all-reduce of the dense soft embedding when it is wanted."""
    peaks, masses, candidates = (torch.stack(x, 1) for x in zip(*run.chunks))  # [N, K] each
    k = peaks.shape[1]
    floats = all_gather(torch.cat([torch.stack([run.best, run.peak, run.mass, run.moment], 1), peaks, masses,
                                   run.top], 1), shard.group)  # [W, N, 4 + 2K + top]
    longs = all_gather(torch.cat([run.argmax[:, None], candidates, run.top_ids], 1), shard.group)
    best, peak, mass, moment = floats[..., :4].unbind(-1)  # [W, N]
    first = best.argmax(0, keepdim=True)  # the first rank holding the maximum, as one process keeps the first chunk
    run.argmax, run.best = longs[..., 0].gather(0, first)[0], best.amax(0)
    run.peak = peak.amax(0)
    decay = torch.exp2(peak - run.peak)  # each rank's sums rescaled to the common peak
    run.moment = (decay * (moment + (peak - run.peak) * mass)).sum(0)
    run.mass = (decay * mass).sum(0)
    chunk_mass = _side_by_side(floats[..., 4 + k:4 + 2 * k] * torch.exp2(floats[..., 4:4 + k] - run.peak[:, None]))
    run.sample = _replay(chunk_mass, _side_by_side(longs[..., 1:1 + k]), u_take)
    if want_signal and top_k:
        top, ids = _side_by_side(floats[..., 4 + 2 * k:]), _side_by_side(longs[..., 1 + k:])
        run.top, keep = top.topk(min(top_k, top.shape[1]), dim=-1)
        run.top_ids = ids.gather(1, keep)
    elif want_signal:
        run.soft = all_reduce(run.soft.mul_(decay[shard.rank, :, None]), shard.group)


def _side_by_side(x: Tensor) -> Tensor:
    """[W, N, K] of every rank -> [N, W * K] in vocabulary order."""
    return x.transpose(0, 1).flatten(1)


def _replay(chunk_mass: Tensor, candidates: Tensor, u_take: Tensor) -> Tensor:
    """The weighted-reservoir choice of one process's stream over chunks [N, C]: chunk c replaces the sample when
    u_take[c] * (mass of chunks ..c) < its mass, so the sample is the last such chunk's candidate."""
    take = u_take * chunk_mass.cumsum(1) < chunk_mass
    order = torch.arange(chunk_mass.shape[1], device=chunk_mass.device)
    last = torch.where(take, order, -1).amax(1, keepdim=True).clamp_(min=0)
    return candidates.gather(1, last)[:, 0]
