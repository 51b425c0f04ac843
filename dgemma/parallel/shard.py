"""Sharding a loaded DiffusionGemma in place over a tensor-parallel group (Megatron's layout):

- attention: each rank keeps heads r*H/N.. of q_proj (column parallel) and the KV heads those heads read (KV heads
  split when their groups fall whole on the ranks, else each rank keeps the one KV head its query heads share);
  o_proj is row parallel and its partial products are all-reduced;
- dense MLP and the self-conditioning MLP: gate/up column parallel, down row parallel, one all-reduce;
- MoE: each rank holds E/N whole experts (expert parallel), the router stays whole on every rank, each rank runs the
  rows routed to its experts and one all-reduce sums the partial outputs (exact; an all-to-all that sends each row
  to its experts' ranks would move k rows per token instead of a whole activation, worth it past one node);
- the tied embedding / LM head: each rank keeps V/N contiguous rows (a `VocabShard` on the head): the input lookup
  and the self-conditioning soft embedding sum the ranks' parts (one all-reduce), logits are gathered from the
  ranks, and the fused vocabulary step merges the ranks' running statistics (sampling/vocab_shards.py);
- everything else (norms, router, vision tower) is replicated.

Quantized weights shard too: rows (and experts) of their codes and scales, and columns at group boundaries.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from dgemma.config import ModelConfig, TextConfig
from dgemma.errors import ConfigError
from dgemma.model.head import VocabShard
from dgemma.parallel.group import Group
from dgemma.quant import QuantizedWeight
from dgemma.quant.int4cpu import CPUInt4Weight

ROWS, COLUMNS, EXPERTS = -2, -1, 0  # the dim of a weight [.., N, K] / [E, N, K] a shard slices


def shard(module: nn.Module, group: Group) -> None:
    """Keep this rank's part of every sharded weight (copies: the rest is freed) and set the all-reduce groups."""
    text = module.cfg.text
    check(text, group.world)
    for block in module.layers:
        _attention(block.self_attn, group, text)
        _mlp(block.mlp, group)
        _experts(block.experts, group)
    _mlp(module.self_conditioning, group)
    _vocabulary(module, group)
    module.cfg = rank_config(module.cfg, group.world)
    module.parallel = group


def check(text: TextConfig, world: int) -> None:
    """One-line errors for a model that `world` ranks cannot share."""
    for name, value in (("num_attention_heads", text.num_attention_heads),
                        ("intermediate_size", text.intermediate_size), ("num_experts", text.num_experts),
                        ("vocab_size", text.vocab_size)):
        if value % world:
            raise ConfigError(f"tensor parallel size {world} does not divide {name}={value}")
    heads = text.num_attention_heads // world
    for i in range(text.num_hidden_layers):
        group = text.num_attention_heads // text.layer(i).num_kv_heads
        if heads % group and group % heads:
            raise ConfigError(f"tensor parallel size {world}: layer {i}'s {heads} query heads per rank neither hold "
                              f"whole groups of {group} nor lie in one")


def kv_heads(heads: int, kv: int, world: int, rank: int) -> tuple[int, int]:
    """(first, count) of the KV heads rank's query heads read (GQA: query head i reads KV head i // (heads / kv))."""
    mine, group = heads // world, heads // kv
    return rank * mine // group, max(1, mine // group)


def rank_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config a rank's module carries: its attention shard's heads (the KV cache takes its shapes from it)."""
    t = cfg.text
    per_layer = {i: {"head_dim": t.layer(i).head_dim,
                     "num_key_value_heads": kv_heads(t.num_attention_heads, t.layer(i).num_kv_heads, world, 0)[1]}
                 for i in range(t.num_hidden_layers)}
    text = replace(t, num_attention_heads=t.num_attention_heads // world, per_layer=per_layer,
                   num_key_value_heads=kv_heads(t.num_attention_heads, t.num_key_value_heads, world, 0)[1])
    return replace(cfg, text=text)


def _attention(attn: nn.Module, group: Group, text: TextConfig) -> None:
    d, heads = attn.head_dim, attn.n_heads // group.world
    first, count = kv_heads(attn.n_heads, attn.n_kv, group.world, group.rank)
    q = (group.rank * heads * d, (group.rank + 1) * heads * d)
    _slice(attn.q_proj, ROWS, *q)
    for proj in (attn.k_proj, attn.v_proj):
        if proj is not None:
            _slice(proj, ROWS, first * d, (first + count) * d)
    _slice(attn.o_proj, COLUMNS, *q)
    attn.o_proj.group = group.pg
    attn.n_heads, attn.n_kv = heads, count


def _mlp(mlp: nn.Module, group: Group) -> None:
    width = mlp.down_proj.weight.shape[-1] // group.world
    part = (group.rank * width, (group.rank + 1) * width)
    _slice(mlp.gate_proj, ROWS, *part)
    _slice(mlp.up_proj, ROWS, *part)
    _slice(mlp.down_proj, COLUMNS, *part)
    mlp.down_proj.group = group.pg


def _experts(experts: nn.Module, group: Group) -> None:
    count = experts.down_proj.shape[0] // group.world
    for name in ("gate_up_proj", "down_proj"):
        _slice(experts, EXPERTS, group.rank * count, (group.rank + 1) * count, name)
    experts.first, experts.group = group.rank * count, group.pg


def _vocabulary(module: nn.Module, group: Group) -> None:
    vocab = module.embed_tokens.weight.shape[0]
    width = vocab // group.world
    lo = group.rank * width
    _slice(module.embed_tokens, ROWS, lo, lo + width)
    module.lm_head.shard = VocabShard(lo, lo + width, vocab, group.pg)


def _slice(owner: nn.Module, dim: int, lo: int, hi: int, leaf: str = "weight") -> None:
    """Replace owner.<leaf> by its lo..hi along `dim`."""
    w = getattr(owner, leaf)
    if isinstance(w, QuantizedWeight):
        setattr(owner, leaf, _quantized(w, dim, lo, hi))
    else:
        owner._parameters[leaf] = nn.Parameter(w.detach().narrow(dim, lo, hi - lo).clone(), requires_grad=False)


def _quantized(w: QuantizedWeight, dim: int, lo: int, hi: int) -> QuantizedWeight:
    """The same format over part of its codes and scales: rows (or experts) of every buffer; columns only at group
    boundaries, each buffer cut in proportion to its width (codes, packed codes, scales; a per-row one kept)."""
    if getattr(w, "a8", None) is not None or (isinstance(w, CPUInt4Weight) and dim != EXPERTS):
        raise ConfigError(f"tensor parallelism with {w.format} weights in this packing is not supported yet: "
                          "shard before the CPU repacking and +a8")
    buffers = w.state_dict()
    if dim != COLUMNS:
        return w.rebuild({n: t.narrow(dim, lo, hi - lo).clone() for n, t in buffers.items()})
    k, g = w.shape[-1], w.group_size
    per_column = all(t.shape[-1] in (1, k) for t in buffers.values())  # one code a column, per-row scales
    if (lo % g or hi % g) and not per_column:
        raise ConfigError(f"tensor parallelism with {w.format} weights: the shard's columns {lo}..{hi} cut its "
                          f"groups of {g}; use a smaller group or another tensor parallel size")
    return w.rebuild({n: t.clone() if t.shape[-1] == 1 else
                      t.narrow(-1, lo * t.shape[-1] // k, (hi - lo) * t.shape[-1] // k).clone()
                      for n, t in buffers.items()})


def weight_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes of weights a module holds: the sharded parts (attention, MLPs, experts, the embedding), the replicated
    rest, and the embedding's share of the sharded bytes."""
    sharded = [m.self_attn for m in module.layers] + [m.mlp for m in module.layers] + \
        [m.experts for m in module.layers] + [module.self_conditioning, module.embed_tokens]
    mine = {id(t) for m in sharded for t in _tensors(m)}
    total = {id(t): t.numel() * t.element_size() for t in _tensors(module)}
    part = sum(b for i, b in total.items() if i in mine)
    return {"sharded": part, "replicated": sum(total.values()) - part,
            "embedding": sum(total[id(t)] for t in _tensors(module.embed_tokens))}


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters and persistent buffers (quantized codes and scales included)."""
    return [t for _, t in module.state_dict(keep_vars=True).items()]
