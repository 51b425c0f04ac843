"""DiffusionGemma text model.

One stack of layers used two ways: `encode` runs it causally over new tokens and writes their keys/values to
the cache (prompt prefill, committing a canvas, autoregressive decoding); `denoise` runs it bidirectionally
over a canvas that attends to the cache and returns hidden states without committing anything.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from dgemma.cache import KVCache
from dgemma.cache.kv import POSITION_DTYPE
from dgemma.config import ModelConfig, TextConfig
from dgemma.errors import DgemmaError
from dgemma.model.attention import Attention, Part
from dgemma.model.head import Head
from dgemma.model.layers import GatedMLP, RMSNorm, rope_cos_sin
from dgemma.model.moe import Experts, Router
from dgemma.model.soft_tokens import SoftTokens, chunk_bounds
from dgemma.model.vision import Vision

# Prompt tokens encoded per pass by `prefill`: bounds activation memory (MoE rows, attention masks) at any
# prompt length while keeping each pass large enough to use the matmul units well.
PREFILL_CHUNK = 512


Caches = KVCache | list[KVCache]


def _listed(cache: Caches) -> list[KVCache]:
    return cache if isinstance(cache, list) else [cache]


def _rows(caches: list[KVCache]) -> list[slice]:
    """The batch rows each cache holds, in order."""
    ends = itertools.accumulate(c.batch_size for c in caches)
    return [slice(end - c.batch_size, end) for c, end in zip(caches, ends)]


class Block(nn.Module):
    """Attention, then a dense MLP and an MoE in parallel on the same residual, then the layer scalar."""

    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer)
        self.mlp = GatedMLP(h, cfg.intermediate_size)
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            setattr(self, name, RMSNorm(h, eps))
        # The encoder and decoder share every weight but this one (a buffer in the reference, saved for both).
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], parts: list[Part], encoder: bool,
                write: bool = True, keep: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, parts, write, keep)
        x = x + self.post_attention_layernorm(attn)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(flat)
        moe = self.experts(self.pre_feedforward_layernorm_2(flat), weights, ids).view_as(x)
        x = x + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(moe))
        return x * (self.encoder_layer_scalar if encoder else self.layer_scalar)


class SelfConditioning(GatedMLP):
    """Adds a gated-MLP projection of the previous step's soft embedding to the canvas embedding, then norms."""

    def __init__(self, cfg: TextConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size)
        self.pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)

    def forward(self, embeds: torch.Tensor, signal: torch.Tensor | None) -> torch.Tensor:
        if signal is None:  # the MLP maps a zero signal to exactly zero
            return self.post_norm(embeds)
        return self.post_norm(embeds + super().forward(self.pre_norm(signal)))


class DiffusionGemma(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        t = cfg.text
        # a load's skeleton (meta device) has nothing to initialise; normal_ there imports torch._dynamo: 1.3 s a load
        skeleton = torch.empty(t.vocab_size, t.hidden_size) if torch.get_default_device().type == "meta" else None
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size, _weight=skeleton)
        self.layers = nn.ModuleList(Block(t, i) for i in range(t.num_hidden_layers))
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.self_conditioning = SelfConditioning(t)
        self.embed_scale = t.hidden_size**0.5
        self.lm_head = Head(self.embed_tokens, t.final_logit_softcapping, self.embed_scale)  # not a submodule
        self.vision = Vision(cfg.vision, t) if cfg.vision is not None else None
        self.soft_tokens = SoftTokens(t.vocab_size)  # images' features, addressed by ids past the vocabulary
        self.parallel = None  # this rank's tensor-parallel group once dgemma/parallel sharded the model

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A cache for inference: sliding layers keep a ring of window - 1 + canvas slots."""
        return KVCache(self.cfg.text, batch, capacity, self.dtype, self.device, room=self.cfg.canvas_length)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        return self.lm_head.rows(ids) * torch.tensor(self.embed_scale, dtype=w.dtype, device=w.device)

    @torch.no_grad()
    def image_ids(self, key: str, patches: torch.Tensor, positions: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """The prompt ids of one image's soft tokens and its features (patches [P, 3 * patch^2] at positions
        [P, 2], the same image `key` giving the same ids while its features are kept); the vision tower runs on
        first sight."""
        if self.vision is None:
            raise DgemmaError("this checkpoint has no vision tower: it takes text prompts only")
        return self.soft_tokens.ids(key, lambda: self.vision(patches.to(self.device), positions.to(self.device)))

    def soft_embed(self, logits: torch.Tensor) -> torch.Tensor:
        """softmax(logits) @ E * sqrt(H): the self-conditioning signal."""
        return self.lm_head.soft_embed(logits)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head with the final softcap, float32 logits (`model/head.py`)."""
        return self.lm_head.logits(hidden)

    def encode(self, ids: torch.Tensor, cache: Caches, valid: torch.Tensor | None = None,
               positions: torch.Tensor | None = None, rows_apart: bool = False) -> torch.Tensor:
        """Causal pass over new tokens ids [B, L]; appends them to the cache; returns normed hidden [B, L, H].

        `cache` is one cache for the batch, or a list of caches each holding consecutive rows (one per request,
        so that requests join and leave without copying each other's): each part's positions then default to
        its own slots. `rows_apart`: each position attends as a pass of one token would, so that its hidden state
        is bit for bit a one-token pass's where the matmuls' rounding does not depend on L (bfloat16 on CPUs)."""
        return self.norm(self._encode(ids, cache, valid, positions, rows_apart))

    def prefill(self, ids: torch.Tensor, cache: Caches, valid: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, chunk: int | None = PREFILL_CHUNK) -> torch.Tensor:
        """`encode` in chunks of at most `chunk` tokens (None: one pass), so activation memory stays that of one
        chunk whatever the prompt's length; returns the last position's normed hidden state [B, H]."""
        n, lo = ids.shape[1], 0
        step = chunk or n
        bounds = chunk_bounds((ids >= self.soft_tokens.vocab).cpu(), step) if self.soft_tokens else \
            range(step, n + step, step)
        for hi in bounds:
            part, lo = slice(lo, hi), hi
            x = self._encode(ids[:, part], cache, None if valid is None else valid[:, part],
                             None if positions is None else positions[:, part])
        return self.norm(x[:, -1])

    def _encode(self, ids, cache, valid, positions, rows_apart=False):
        n, caches = ids.shape[1], _listed(cache)
        x, groups = self._embed_prompt(ids)
        starts = [c.reserve(n, None if valid is None else valid[rows]) for c, rows in zip(caches, _rows(caches))]
        parts = {s: [Part(c, start, c.encoder_span(start, n, s, None if groups is None else groups[rows], rows_apart))
                     for c, start, rows in zip(caches, starts, _rows(caches))] for s in (True, False)}
        return self._run(x, parts, n, positions, encoder=True)

    def _embed_prompt(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embeddings of ids [B, n] with images' soft tokens in place, and the image run of each position when the
        model lets an image's tokens see each other (None: plain causal)."""
        images = self.soft_tokens
        if not images or not bool((ids >= images.vocab).any()):  # one host read, only once an image was seen
            return self.embed(ids), None
        x = images.place(ids, self.embed(images.text_ids(ids)))
        return x, images.groups(ids) if self.cfg.bidirectional_vision else None

    def denoise(self, canvas: torch.Tensor, cache: Caches, signal: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, context: torch.Tensor | None = None,
                keep: torch.Tensor | None = None, hide: list[int] | None = None) -> torch.Tensor:
        """Bidirectional pass over canvas [B, C] attending to the cache (or caches, as in `encode`); returns normed
        hidden [B, C, H].

        `signal` is the self-conditioning soft embedding [B, C, H] (`soft_embed` of the previous logits), or None
        for the zero signal of the first step. `context` [B] (training, one cache) limits row b to its first
        context[b] cached tokens and leaves the cache untouched; `positions` then default to context[b] + arange(C).
        `keep` [B, m] (inference): run only these positions, returning [B, m, H]; the others' keys and values are
        those the canvas's previous pass left in the cache (an approximation once their inputs moved on).
        `hide` (inference, one entry per cache): each cache's first canvas positions that the cache already holds
        (early commit moved them there), left out of what the canvas sees; the canvas's positions continue from
        the cached ones.
        """
        n, caches = canvas.shape[1], _listed(cache)
        if keep is not None:
            canvas = canvas.gather(1, keep)
            signal = None if signal is None else signal.gather(1, keep[..., None].expand(-1, -1, signal.shape[-1]))
        x = self.self_conditioning(self.embed(canvas), signal)
        if context is not None:
            (c,) = caches
            if positions is None:
                positions = context[:, None] + torch.arange(n, device=canvas.device)
            parts = {s: [Part(c, c.length, c.context_span(context, n, s))] for s in (True, False)}
            return self.norm(self._run(x, parts, n, positions, encoder=False, write=False))
        hide = hide or [0] * len(caches)
        for c in caches:
            c.scratch(n)
        if any(hide):
            positions = torch.cat([torch.arange(c.length - h, c.length - h + n, device=canvas.device)
                                   .expand(c.batch_size, n) for c, h in zip(caches, hide)])
        parts = {s: [Part(c, c.length, c.decoder_span(n, s, h)) for c, h in zip(caches, hide)] for s in (True, False)}
        return self.norm(self._run(x, parts, n, positions, encoder=False, keep=None if keep is None else (keep, n)))

    def _run(self, x, parts, n, positions, encoder, write=True, keep=None):
        if positions is None:
            positions = torch.cat([torch.arange(p.start, p.start + n, device=x.device).expand(p.cache.batch_size, n)
                                   for p in parts[True]])
        parts = {True: parts[True], False: self._full_parts(parts[False], positions, n, write)}
        rope_at = positions if keep is None else positions.gather(1, keep[0])
        ropes = {}
        for block in self.layers:
            attn = block.self_attn
            key = (attn.sliding, attn.head_dim)
            if key not in ropes:
                ropes[key] = rope_cos_sin(attn.inv_freq, rope_at, x.dtype)
            x = block(x, ropes[key], parts[attn.sliding], encoder, write, keep)
        return x

    def _full_parts(self, parts: list[Part], positions: torch.Tensor, n: int, write: bool) -> list[Part]:
        """Record the new tokens' positions in their caches (when writing), and give each part the positions of
        every slot the full-attention layers read, from which they derive those slots' keys."""
        out = []
        for p, rows in zip(parts, _rows([p.cache for p in parts])):
            new = positions[rows].to(POSITION_DTYPE)
            if write:
                p.cache.place(p.start, new)
                seen = p.cache.positions[:, p.span.lo:p.start + n]
            else:
                seen = torch.cat([p.cache.positions[:, p.span.lo:p.start], new], dim=1)
            out.append(p._replace(positions=seen))
        return out
