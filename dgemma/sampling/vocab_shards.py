"""The fused vocabulary step (sampling/fused.py) under tensor parallelism: each rank streamed its own rows of the
vocabulary; `merge` combines the ranks' running statistics by the rules the chunks combine by, so that every rank
ends with the whole vocabulary's argmax, normaliser, entropy moment, soft embedding or top-k, and the sample one
process draws from the same uniforms."""

from __future__ import annotations

import torch
from torch import Tensor

from dgemma.model.head import VocabShard
from dgemma.model.layers import all_gather, all_reduce
from dgemma.sampling.samplers import inverse_cdf


def merge(run, shard: VocabShard, uniforms: Tensor, p: Tensor, want_signal: bool, top_k: int | None) -> None:
    """run: this rank's `_Running` over its rows, with its chunks recorded; uniforms [N, 2 * chunks of the whole
    vocabulary]: each chunk's inverse-CDF point and its uniform for replacing the sample; p [N, w]: the last
    chunk's probabilities. Two all-gathers of per-row statistics, one all-reduce of the dense soft embedding when
    it is wanted, and one of the sample when ranks share a chunk."""
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
    piece_mass = _side_by_side(floats[..., 4 + k:4 + 2 * k] * torch.exp2(floats[..., 4:4 + k] - run.peak[:, None]))
    share = piece_mass.shape[1] * 2 // uniforms.shape[1]  # ranks a chunk of one process's stream spans
    if share == 1:
        run.sample = _side_by_side(longs[..., 1:1 + k]).gather(1, _replay(piece_mass, uniforms[:, 1::2]))[:, 0]
    else:
        run.sample = _shared_chunk_sample(piece_mass.unflatten(1, (-1, share)), uniforms, shard, p, masses[:, 0])
    if want_signal and top_k:
        top, ids = _side_by_side(floats[..., 4 + 2 * k:]), _side_by_side(longs[..., 1 + k:])
        run.top, keep = top.topk(min(top_k, top.shape[1]), dim=-1)
        run.top_ids = ids.gather(1, keep)
    elif want_signal:
        run.soft = all_reduce(run.soft.mul_(decay[shard.rank, :, None]), shard.group)


def _side_by_side(x: Tensor) -> Tensor:
    """[W, N, K] of every rank -> [N, W * K] in vocabulary order."""
    return x.transpose(0, 1).flatten(1)


def _replay(chunk_mass: Tensor, u_take: Tensor) -> Tensor:
    """The weighted-reservoir choice of one process's stream over chunks [N, C]: chunk c replaces the sample when
    u_take[c] * (mass of chunks ..c) < its mass, so the sample is the last such chunk's candidate; returns its
    index [N, 1]."""
    take = u_take * chunk_mass.cumsum(1) < chunk_mass
    order = torch.arange(chunk_mass.shape[1], device=chunk_mass.device)
    return torch.where(take, order, -1).amax(1, keepdim=True).clamp_(min=0)


def _shared_chunk_sample(pieces: Tensor, uniforms: Tensor, shard: VocabShard, p: Tensor, mass: Tensor) -> Tensor:
    """The sample when each chunk spans `share` ranks, each holding one piece of it (pieces [N, C, share] masses at
    the common peak; p [N, w] this rank's probabilities, `mass` their sum): the chunk the replay chooses, the piece
    holding its inverse-CDF point, and the entry there of the rank holding that piece (summed over the ranks)."""
    share = pieces.shape[2]
    chunk = _replay(pieces.sum(-1), uniforms[:, 1::2])  # [N, 1]
    parts = pieces.gather(1, chunk[..., None].expand(-1, -1, share))[:, 0]  # [N, share] the chosen chunk's pieces
    upto = parts.cumsum(1)
    target = uniforms[:, 0::2].gather(1, chunk) * upto[:, -1:]
    piece = (upto <= target).sum(1, keepdim=True).clamp_(max=share - 1)
    into = (target - (upto - parts).gather(1, piece)) / parts.gather(1, piece)  # the fraction of that piece's mass
    entry = inverse_cdf(p, into[:, 0].clamp(0, 1), mass) + shard.lo
    held = chunk[:, 0] * share + piece[:, 0] == shard.rank
    return all_reduce(torch.where(held, entry, 0), shard.group)
