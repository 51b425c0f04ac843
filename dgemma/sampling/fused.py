"""The fast denoising step's vocabulary-sized work, fused and streamed over vocabulary chunks.

Per chunk of the (tied) embedding: head logits for every position, softcap, temperature, then online
(rescaled, flash-attention style) running max / argmax, normaliser, entropy accumulator and the
self-conditioning soft embedding p @ E, and a weighted-reservoir sample (inverse CDF inside the chunk, kept
with probability chunk mass / mass so far: exactly softmax-distributed). The embedding is read once per step,
only [positions, chunk] blocks are alive (preallocated once per step), and no random number is drawn per
vocabulary entry. Scores are kept in base 2 (log2 e folded into the scale) because exp2 is several times
cheaper than exp on CPUs.

Under tensor parallelism (`head.shard`) each rank streams its own vocabulary rows, in the chunks (or the part
of one chunk) one process streams there, with the same uniforms; `vocab_shards.merge` then makes every rank's
statistics the whole vocabulary's.

Two opt-in savings (defaults off, `SamplingParams.soft_top_k` / `skip_settled`): a sparse soft embedding (the
running top-k of each position's distribution, renormalised, times those k embedding rows, instead of the p @ E
GEMM over the whole vocabulary), and settled positions left out of the step (their previous outputs reused).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from dgemma.model.head import Head, VocabShard, embedding_rows
from dgemma.model.layers import all_reduce, gemm_dtype
from dgemma.quant import QuantizedWeight
from dgemma.quant.a8 import quantize_rows
from dgemma.sampling.processing import Processor, processed_step
from dgemma.sampling.samplers import StepOutput, entropy_bound_accept, inverse_cdf, random_tokens, renoise
from dgemma.sampling.vocab_shards import merge

LOG2E = 1.0 / math.log(2.0)


class VocabStep(NamedTuple):
    argmax: Tensor  # [N] long
    sample: Tensor  # [N] long, drawn from softmax(logits / T)
    entropy: Tensor  # [N] float32 entropy of softmax(logits / T)
    signal: Tensor | None  # [N, H] soft embedding softmax(logits / T) @ E * sqrt(H), in E's dtype


def vocab_chunk(device: torch.device, shard: VocabShard | None = None) -> int:
    """Vocabulary entries per chunk: small blocks that stay in a CPU's caches; on accelerators few large
    blocks, so that a step is tens of kernel launches, not thousands. A vocabulary shard streams one process's
    chunks, whole ones or (a narrower shard) an equal part of one; other widths take chunks that divide them,
    and so draw otherwise than one process."""
    chunk = 2048 if device.type == "cpu" else 65536
    width = chunk if shard is None else shard.hi - shard.lo
    return chunk if width % chunk == 0 or chunk % width == 0 else math.gcd(chunk, width)


def sync_free_default(device: torch.device) -> bool:
    """Off the CPU a host read stalls the device's queue, so every row is updated each chunk instead."""
    return device.type != "cpu"


def num_uniforms(vocab_size: int, chunk: int) -> int:
    """Uniforms per position that `vocab_step` consumes (two per vocabulary chunk)."""
    return 2 * math.ceil(vocab_size / chunk)


class _Buffers:
    """The per-chunk blocks, allocated once per step: logits in the GEMM dtype, float32 scores and
    probabilities, and the probabilities again in the GEMM dtype for the soft-embedding GEMM."""

    def __init__(self, n: int, width: int, hidden: int, dtype: torch.dtype, device: torch.device, softcap: float):
        f32 = dict(dtype=torch.float32, device=device)
        self.softcap = softcap
        self.score = torch.empty(n, width, **f32)
        self.logits = self.score if dtype == torch.float32 else torch.empty(n, width, dtype=dtype, device=device)
        self.prob = torch.empty(n, width, **f32)
        self.prob_mm = self.prob if dtype == torch.float32 else torch.empty(n, width, dtype=dtype, device=device)
        self.part = torch.empty(n, hidden, dtype=dtype, device=device)

    def head_mm(self, x: Tensor, block: Tensor) -> int:
        """x.block for a chunk into the float32 score buffer [n, w]; returns w."""
        w = block.shape[0]
        torch.mm(x, block.T, out=self.logits[:, :w])
        if self.logits is not self.score:
            self.score[:, :w].copy_(self.logits[:, :w])
        return w

    def squash(self, w: int) -> Tensor:
        """sigmoid(2 logits / softcap) in place in the score buffer [n, w]."""
        return self.score[:, :w].mul_(2 / self.softcap).sigmoid_()

    def soft_part(self, p: Tensor, block: Tensor) -> Tensor:
        """p @ block for the soft embedding, in the GEMM dtype."""
        w = block.shape[0]
        if self.prob_mm is not self.prob:
            self.prob_mm[:, :w].copy_(p)
        return torch.mm(self.prob_mm[:, :w], block, out=self.part)


class _Running:
    """Online statistics over vocabulary chunks (flash-attention style, rescaled to the running peak):
    argmax, normaliser, entropy moment, soft embedding, and a weighted-reservoir sample."""

    def __init__(self, n: int, hidden: int, device: torch.device, sync_free: bool):
        f32 = dict(dtype=torch.float32, device=device)
        self.sync_free = sync_free
        self.peak = torch.full((n,), -math.inf, **f32)  # running max of the base-2 scores
        self.mass = torch.zeros(n, **f32)  # sum of 2^(s - peak)
        self.decay = torch.ones(n, **f32)  # the last chunk's rescaling of the running sums
        self.moment = torch.zeros(n, **f32)  # sum of 2^(s - peak) * (s - peak)
        self.soft = torch.zeros(n, hidden, **f32)
        self.best = torch.full((n,), -math.inf, **f32)
        self.argmax = torch.zeros(n, dtype=torch.long, device=device)
        self.sample = torch.zeros_like(self.argmax)
        self.top = torch.empty(n, 0, **f32)  # sparse soft embedding: the k best squashed scores so far
        self.top_ids = torch.empty(n, 0, dtype=torch.long, device=device)
        self.chunks: list[tuple[Tensor, Tensor, Tensor]] = []  # a vocabulary shard's (peak, mass, candidate) each

    def signal(self, embedding: Tensor | QuantizedWeight, embed_scale: float, scale: Tensor, shift: Tensor,
               shard: VocabShard | None = None) -> Tensor:
        """The soft embedding: dense (the running p @ E), or sparse over the running top-k when it was tracked."""
        if self.top.shape[1]:
            return sparse_soft_embedding(self.top * scale - shift, self.top_ids, embedding, embed_scale, shard)
        return (self.soft / self.mass[:, None] * embed_scale).to(embedding.dtype)

    def update_topk(self, squashed: Tensor, lo: int, k: int) -> None:
        """Merge the chunk's k best (squashed, so monotonic in the logits) entries into the running k best."""
        vals, ids = squashed.topk(min(k, squashed.shape[1]), dim=-1)
        self.top, self.top_ids = torch.cat([self.top, vals], 1), torch.cat([self.top_ids, ids + lo], 1)
        if self.top.shape[1] > k:
            self.top, keep = self.top.topk(k, dim=-1)
            self.top_ids = self.top_ids.gather(1, keep)

    def update_argmax(self, squashed: Tensor, lo: int) -> Tensor:
        """Track the argmax (squashing is monotonic); returns the chunk's row maxima."""
        top = squashed.amax(dim=-1)
        better = top > self.best
        if self.sync_free:
            self.argmax = torch.where(better, squashed.argmax(-1) + lo, self.argmax)
        elif bool(better.any()):  # a new row maximum: rare after the first chunks, so argmax runs on few rows
            rows = better.nonzero().squeeze(1)
            self.argmax[rows] = squashed[rows].argmax(-1) + lo
        self.best = torch.maximum(self.best, top)
        return top

    def update_mass(self, s: Tensor, p: Tensor, new_peak: Tensor) -> Tensor:
        """s: base-2 scores minus the new peak (overwritten), p = 2^s; returns the chunk's mass and rescales the
        running sums: sum p (s - m') = decay * (M + (m - m') S)."""
        decay = torch.exp2(self.peak - new_peak)
        chunk_mass = p.sum(-1)
        dot = s.mul_(p).sum(-1)
        self.moment = decay * (self.moment + torch.nan_to_num(self.peak - new_peak) * self.mass) + dot
        self.mass = self.mass * decay + chunk_mass
        self.decay, self.peak = decay, new_peak
        return chunk_mass

    def update_sample(self, p: Tensor, chunk_mass: Tensor, u_pick: Tensor, u_take: Tensor, lo: int) -> None:
        """The chunk replaces the sample with probability chunk_mass / mass; only the rows it replaces need the
        candidate (an inverse-CDF draw inside the chunk)."""
        take = u_take * self.mass < chunk_mass
        if self.sync_free:
            self.sample = torch.where(take, inverse_cdf(p, u_pick, chunk_mass) + lo, self.sample)
        elif bool(take.any()):
            rows = take.nonzero().squeeze(1)
            self.sample[rows] = inverse_cdf(p[rows], u_pick[rows], chunk_mass[rows]) + lo

    def record_chunk(self, p: Tensor, chunk_mass: Tensor, u_pick: Tensor, lo: int) -> None:
        """A vocabulary shard's chunk: whether it replaces the sample depends on the mass of the ranks before this
        one, so its candidate is drawn for every row and `vocab_shards.merge` makes the choices."""
        self.chunks.append((self.peak, chunk_mass, inverse_cdf(p, u_pick, chunk_mass) + lo))


def vocab_step(hidden: Tensor, embedding: Tensor | QuantizedWeight, softcap: float, embed_scale: float,
               inv_temp: Tensor, uniforms: Tensor, want_signal: bool = True, sync_free: bool | None = None,
               chunk: int | None = None, top_k: int | None = None, shard: VocabShard | None = None) -> VocabStep:
    """hidden [N, H] (final-normed), embedding [V, H], inv_temp [N], uniforms [N, num_uniforms(V, chunk)] in
    [0, 1); chunk defaults to `vocab_chunk(device, shard)`. `shard`: this rank's rows of the vocabulary, the
    embedding [hi - lo, H] (its uniforms still the whole vocabulary's).
    `want_signal=False` skips the soft embedding (half the GEMM work) when no later step will read it; `top_k`
    makes it sparse: softmax over each position's k most likely entries only, times their k embedding rows.
    `sync_free` (default: off the CPU) updates every row each chunk instead of asking the host which rows
    changed: more arithmetic, no device-to-host synchronisation."""
    n, v, device = hidden.shape[0], embedding.shape[0], hidden.device
    chunk = chunk or vocab_chunk(device, shard)
    base = 0 if shard is None else shard.lo  # the vocabulary id of the embedding's first row
    mm_dtype = gemm_dtype(embedding)
    buf = _Buffers(n, min(chunk, v), embedding.shape[1], mm_dtype, device, softcap)
    run = _Running(n, embedding.shape[1], device, sync_free_default(device) if sync_free is None else sync_free)
    x = hidden.to(mm_dtype)
    # softcap * tanh(x / softcap) / T in base 2, as scale * sigmoid(2x / softcap) - shift: sigmoid is much faster
    scale = (2 * softcap * LOG2E * inv_temp)[:, None]
    shift = (softcap * LOG2E * inv_temp)[:, None]
    rows = _Int8Rows(embedding.a8, x, buf) if _int8_ready(embedding, chunk) else _FloatRows(embedding, x, buf,
                                                                                                  mm_dtype)
    for k, lo in enumerate(range(0, v, chunk)):
        w = rows.logits(k, lo, chunk)
        s = buf.squash(w)
        top = run.update_argmax(s, base + lo)
        if want_signal and top_k:
            run.update_topk(s, base + lo, top_k)
        new_peak = torch.maximum(run.peak, (top[:, None] * scale - shift).squeeze(1))
        s.mul_(scale).sub_(shift + new_peak[:, None])  # s - peak <= 0
        p = torch.exp2(s, out=buf.prob[:, :w])
        chunk_mass = run.update_mass(s, p, new_peak)  # s is not needed after this
        if want_signal and not top_k:
            run.soft.mul_(run.decay[:, None]).add_(rows.soft(k, p))
        g = (base + lo) // chunk  # the chunk's place in the whole vocabulary: its uniforms
        if shard is None:
            run.update_sample(p, chunk_mass, uniforms[:, 2 * g], uniforms[:, 2 * g + 1], lo)
        else:
            run.record_chunk(p, chunk_mass, uniforms[:, 2 * g], base + lo)
    if shard is not None:
        merge(run, shard, uniforms, p, want_signal, top_k)
    entropy = (torch.log2(run.mass) - run.moment / run.mass) / LOG2E
    signal = run.signal(embedding, embed_scale, scale, shift, shard) if want_signal else None
    return VocabStep(run.argmax, run.sample, entropy, signal)


def sparse_soft_embedding(scores: Tensor, ids: Tensor, embedding: Tensor | QuantizedWeight,
                          embed_scale: float, shard: VocabShard | None = None) -> Tensor:
    """softmax over base-2 scores [N, k] (renormalised over those k) @ E[ids [N, k]] * embed_scale, in E's dtype:
    a weighted sum of k embedding rows per position (embedding_bag: the [N, k, H] gather is never built). Under
    tensor parallelism each rank sums the rows it holds, then the ranks' sums are summed."""
    w = torch.softmax(scores / LOG2E, dim=-1)
    if shard is not None:
        ids, mine = shard.local(ids)
        w = w * mine
    if isinstance(embedding, QuantizedWeight):
        out = torch.einsum("nk,nkh->nh", w, embedding.embedding(ids).float())
    else:
        out = torch.nn.functional.embedding_bag(ids, embedding, per_sample_weights=w.to(embedding.dtype), mode="sum")
    if shard is not None:
        out = all_reduce(out, shard.group)
    return (out * embed_scale).to(embedding.dtype)


class _FloatRows:
    """Float GEMMs over each chunk's embedding rows (sliced, converted or decoded into the workspace)."""

    def __init__(self, embedding: Tensor | QuantizedWeight, x: Tensor, buf: _Buffers, dtype: torch.dtype):
        self.embedding, self.x, self.buf, self.dtype = embedding, x, buf, dtype
        self.block: Tensor | None = None

    def logits(self, k: int, lo: int, chunk: int) -> int:
        self.block = embedding_rows(self.embedding, lo, lo + chunk, self.dtype)
        return self.buf.head_mm(self.x, self.block)

    def soft(self, k: int, p: Tensor) -> Tensor:
        return self.buf.soft_part(p, self.block)


class _Int8Rows:
    """int8 GEMMs over the embedding's packed blocks (`--quantize ...+a8`, quant/a8.py): the hidden states are
    quantized once per step, each chunk's probabilities once per chunk."""

    def __init__(self, a8, x: Tensor, buf: _Buffers):
        self.a8, self.rows, self.buf = a8, quantize_rows(x), buf

    def logits(self, k: int, lo: int, chunk: int) -> int:
        y = self.a8.blocks[k].mm(self.rows)
        self.buf.score[:, :y.shape[1]].copy_(y)
        return y.shape[1]

    def soft(self, k: int, p: Tensor) -> Tensor:
        return self.a8.blocks_t[k].mm(quantize_rows(p, nonnegative=True))


def _int8_ready(embedding: Tensor | QuantizedWeight, chunk: int) -> bool:
    a8 = getattr(embedding, "a8", None)
    return a8 is not None and bool(a8.blocks_t) and a8.block_rows == chunk


class Reuse(NamedTuple):
    """Settled positions a step leaves out, and their previous outputs it reuses (engine/features/skip_settled.py)."""

    skip: Tensor  # [B, C] bool
    argmax: Tensor  # [B, C] the previous draft
    tokens: Tensor  # [B, C] the previous canvas (their accepted samples); their entropy counts as 0
    signal: Tensor | None  # [B, C, H] the previous self-conditioning signal


def fast_step(hidden: Tensor, head: Head, inv_temp: Tensor, entropy_bound: Tensor, generators: list[torch.Generator],
              done: list[bool], want_signal: bool, top_k: list[int | None] | None = None,
              reuse: Reuse | None = None,
              process: list[Processor | None] | None = None) -> tuple[StepOutput, Tensor | None]:
    """The fast denoising step for hidden [B, C, H]: `vocab_step`, entropy-bound acceptance, renoising; returns
    the step and the self-conditioning signal [B, C, H] (None when not wanted). Each row draws from its own
    generator (uniforms, then renoise tokens); done rows draw nothing, so a row's random stream does not
    depend on how long the rest of the batch runs. inv_temp, entropy_bound: [B]. `top_k`: each row's sparse
    soft embedding (None: dense); `reuse`: positions left out (accepted with their previous outputs); `process`:
    each row's sampling knobs (None: none; such a row's step is `processed_step`'s)."""
    bsz, c, h = hidden.shape
    vocab, device = head.vocab_size, hidden.device
    chunk = vocab_chunk(device, head.shard)
    uniforms = torch.zeros(bsz, c, num_uniforms(vocab, chunk), device=device)
    noise = torch.zeros(bsz, c, dtype=torch.long, device=device)
    for i in (i for i, d in enumerate(done) if not d):  # each generator: uniforms, then noise
        uniforms[i] = torch.rand(uniforms.shape[1:], generator=generators[i], device=device)
        noise[i] = random_tokens((c,), vocab, device, generators[i])
    args = (hidden.reshape(-1, h), head.weight, head.softcap, head.scale, inv_temp.repeat_interleave(c),
            uniforms.flatten(0, 1))
    processed = [i for i, p in enumerate(process or ()) if p is not None and not done[i]]
    if reuse is None and not any(top_k or ()) and not processed:
        out = vocab_step(*args, want_signal=want_signal, chunk=chunk, shard=head.shard)
    else:
        ks = torch.tensor([k or 0 for k in top_k or [0] * bsz]).repeat_interleave(c)
        keep = torch.ones(bsz, c, dtype=torch.bool) if reuse is None else ~reuse.skip.cpu()
        keep[processed] = False
        out = _grouped_step(args, ks, keep.flatten(), want_signal, chunk, head.shard)
    argmax, sample, entropy = out.argmax.view(bsz, c), out.sample.view(bsz, c), out.entropy.view(bsz, c)
    signal = None if out.signal is None else out.signal.view(bsz, c, h)
    for i in processed:
        row = processed_step(hidden[i], head, process[i], inv_temp[i].expand(c), uniforms[i], want_signal)
        argmax[i], sample[i], entropy[i] = row[:3]
        if want_signal:
            signal[i] = row[3]
    if reuse is not None:
        skip = reuse.skip
        argmax, sample = torch.where(skip, reuse.argmax, argmax), torch.where(skip, reuse.tokens, sample)
        entropy = entropy.masked_fill(skip, 0.0)
        if signal is not None and reuse.signal is not None:
            signal = torch.where(skip[..., None], reuse.signal, signal)
    accept = entropy_bound_accept(entropy, entropy_bound[:, None])
    if reuse is not None:
        accept = accept | reuse.skip
    return StepOutput(renoise(sample, accept, noise), argmax, accept, entropy), signal


def _grouped_step(args: tuple, ks: Tensor, keep: Tensor | None, want_signal: bool, chunk: int,
                  shard: VocabShard | None) -> VocabStep:
    """`vocab_step` over the kept positions (keep [N] bool on the host; None: all), one call per soft top-k value
    (ks [N], 0: dense); left-out positions get zeros."""
    hidden, embedding = args[0], args[1]
    n, device = hidden.shape[0], hidden.device
    argmax, sample = (torch.zeros(n, dtype=torch.long, device=device) for _ in range(2))
    entropy = torch.zeros(n, device=device)
    signal = torch.zeros(n, hidden.shape[1], dtype=embedding.dtype, device=device) if want_signal else None
    for k in sorted(set(ks.tolist())):
        rows = (ks == k) if keep is None else (ks == k) & keep
        idx = rows.nonzero().squeeze(1).to(device)
        if idx.numel() == 0:
            continue
        out = vocab_step(args[0][idx], *args[1:4], args[4][idx], args[5][idx], want_signal=want_signal,
                         chunk=chunk, top_k=k or None, shard=shard)
        argmax[idx], sample[idx], entropy[idx] = out.argmax, out.sample, out.entropy
        if want_signal:
            signal[idx] = out.signal
    return VocabStep(argmax, sample, entropy, signal)
