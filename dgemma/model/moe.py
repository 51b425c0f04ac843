"""Mixture of experts: a normalised, scaled router and stacked expert weights."""

from __future__ import annotations

import torch
from torch import nn

from dgemma.config import TextConfig
from dgemma.model.layers import Linear, RMSNorm, gelu_tanh, matmul


class Router(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.root = cfg.hidden_size**-0.5
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.proj = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> weights [T, k] (float32), expert ids [T, k]."""
        scores = self.proj(self.norm(x) * self.scale * self.root)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Experts(nn.Module):
    """gate_up_proj [E, 2I, H], down_proj [E, H, I]; tokens are grouped by expert, one matmul pair per expert."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> [T, H]. Outputs are gathered back by inverse permutation and summed
        over the k choices (index_add_ is very slow on CPU)."""
        t, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        tokens = x[order // k]
        outs = []
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            gate, up = matmul(tokens[start:start + n], self.gate_up_proj[expert].T).chunk(2, dim=-1)
            outs.append(matmul(gelu_tanh(gate) * up, self.down_proj[expert].T))
            start += n
        y = torch.cat(outs) * weights.flatten()[order, None]
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        return unsorted.view(t, k, -1).sum(1).to(x.dtype)
