"""Small building blocks: RMSNorm, gated MLP, rotary embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgemma.config import RopeConfig
from dgemma.quant import QuantizedWeight, compute_dtype


def gemm_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM with this weight runs in: the quantized weights' rule (`quant.compute_dtype`: float32 for
    bf16 on a CPU without native bf16, exact inputs with float32 accumulation, else its own dtype)."""
    return compute_dtype(weight.dtype, weight.device)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in `gemm_dtype(b)`, rounded back to a's dtype."""
    dtype = gemm_dtype(b)
    if dtype != b.dtype:
        return (a.to(dtype) @ b.to(dtype)).to(a.dtype)
    return a @ b


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of x over a tensor-parallel process group, in place (x itself without one): the collective of a
    pass, after a row-parallel Linear, after the experts a rank holds and after a vocabulary shard's rows
    (dgemma/parallel shards them)."""
    if group is not None:
        torch.distributed.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """x of every rank of a tensor-parallel process group, stacked in rank order [world, *x.shape]."""
    parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


class Linear(nn.Linear):
    """nn.Linear whose weight may be a `QuantizedWeight` (assigned over the parameter by the loader). `group`: set on
    a row-parallel shard (this rank holds some input columns), whose partial products are summed over the group."""

    group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self._product(x), self.group)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            return self.weight.linear(x)
        dtype = gemm_dtype(self.weight)
        if dtype != self.weight.dtype:
            return F.linear(x.to(dtype), self.weight.to(dtype)).to(x.dtype)
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-0.5 * weight, computed in float32; `with_scale=False` has no weight."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = None if self.weight is None else self.weight.float()
        if not torch.is_grad_enabled():  # one fused op for ~6 (12 norms a layer), bit for bit the same on CPUs
            return F.rms_norm(x.float(), x.shape[-1:], scale, self.eps).type_as(x)
        h = x.float()  # under autograd the ops whose backward training measured
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (h if scale is None else h * scale).type_as(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2]; proportional RoPE rotates a leading fraction and leaves the rest at 0."""
    if rope.rope_type == "proportional":
        angles = int(rope.partial_rotary_factor * head_dim // 2)
        rotated = 1.0 / rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float) / head_dim)
        return torch.cat([rotated, torch.zeros(head_dim // 2 - angles)])
    return 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """positions [B, L] -> cos, sin [B, L, 1, head_dim] in `dtype` (computed in float32)."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
