"""Mixture of experts: a normalised, scaled router and stacked expert weights run as grouped matmuls.

Routed rows are sorted by expert on the device; each projection is one grouped GEMM over all experts
(`torch._grouped_mm`, or a padded batched matmul where that is missing). Nothing is read back to the host,
so the layer launches the same few kernels whatever the routing.
"""

from __future__ import annotations


import torch
from torch import nn

from dgemma.config import TextConfig
from dgemma.model.layers import Linear, RMSNorm, all_reduce, gelu_tanh, gemm_dtype
from dgemma.quant import QuantizedWeight, compute_dtype
from dgemma.quant.base import workspace

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


def _grouped_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm exists, takes this dtype (CUDA kernels: bf16 only; the CPU's any float, but not under
    torch.compile, whose shape function follows CUDA's), and the strides meet its 16-byte alignment (needed by its
    backward)."""
    align = 16 // x.element_size()
    cpu_any = x.device.type == "cpu" and not torch.compiler.is_compiling()
    dtype_ok = cpu_any or x.dtype == torch.bfloat16
    return hasattr(torch, "_grouped_mm") and dtype_ok and w.shape[1] % align == 0 and w.shape[2] % align == 0


def _padded_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Fallback without grouped GEMM: row r goes to slot r - start[e] of expert e's block of R rows (no expert
    gets more than R), one batched matmul [E, R, K] @ [E, K, N]; E/k times the FLOPs, no host read."""
    e, r = w.shape[0], x.shape[0]
    rows = torch.arange(r, device=x.device)
    expert = torch.searchsorted(ends, rows, right=True)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    slot = expert * r + rows - starts[expert]
    blocks = x.new_zeros(e * r, x.shape[1]).index_copy_(0, slot, x).view(e, r, x.shape[1])  # r may be 0 (a rank
    return torch.bmm(blocks, w.transpose(1, 2)).view(e * r, w.shape[1])[slot]  # whose experts got no rows)


def _grouped(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    if _grouped_ok(x, w):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends.to(torch.int32))
    return _padded_mm(x, w, ends)


def _converted(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w in `dtype`, written into a per-thread workspace that every layer reuses: a fresh allocation of a whole
    stack costs several times the conversion in page faults (docs/kernels.md). Autograd gets its own copy."""
    if torch.is_grad_enabled() and w.requires_grad:
        return w.to(dtype)
    return workspace(w.numel(), dtype, w.device, fresh=False).view(w.shape).copy_(w)


def expert_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [R, K] sorted by expert (expert e owns rows ends[e-1]..ends[e]) times w[e].T, w [E, N, K] -> [R, N].

    The one place that touches stacked expert weights. bf16 weights on a CPU without native bf16 run a float32 GEMM
    on a converted copy (exact inputs, float32 accumulation); quantized stacks are decoded a few experts at a time.
    """
    if isinstance(w, QuantizedWeight):
        if hasattr(w, "expert_matmul") and not (torch.is_grad_enabled() and x.requires_grad):
            return w.expert_matmul(x, ends)  # a format with its own grouped kernel (quant/int4cpu.py)
        return _quantized_matmul(x, w, ends)
    dtype = gemm_dtype(w)
    if dtype != w.dtype:
        w = _converted(w, dtype)
    return _grouped(x.to(dtype), w, ends).to(x.dtype)


def _quantized_matmul(x: torch.Tensor, w: QuantizedWeight, ends: torch.Tensor) -> torch.Tensor:
    """Decode the stack into the workspace and run the grouped GEMM: whole when it fits one chunk (no host read,
    the accelerator case), else expert chunks over the rows they own, skipping experts without rows (a host read
    of the offsets: free on a CPU, and it keeps autoregressive decoding from decoding all E experts per token)."""
    dtype = compute_dtype(x.dtype, x.device)
    fresh = torch.is_grad_enabled() and x.requires_grad
    xc, e = x.to(dtype), w.shape[0]
    if w.chunk_rows() >= e:
        return _grouped(xc, w.dequantize(slice(None), dtype, fresh), ends).to(x.dtype)
    bounds = [0, *ends.tolist()]
    used = [i for i in range(e) if bounds[i + 1] > bounds[i]]
    out = xc.new_empty(x.shape[0], w.shape[1])
    step = w.chunk_rows()
    for c in range(0, len(used), step):
        ids = used[c:c + step]
        lo, hi = bounds[ids[0]], bounds[ids[-1] + 1]
        offs = torch.tensor([bounds[i + 1] - lo for i in ids], device=x.device)
        sel = torch.tensor(ids, device=x.device)
        out[lo:hi] = _grouped(xc[lo:hi], w.dequantize(sel, dtype, fresh), offs)
    return out.to(x.dtype)


class Experts(nn.Module):
    """gate_up_proj [E, 2I, H], down_proj [E, H, I]; all routed rows go through one grouped GEMM per projection.

    Expert parallel (dgemma/parallel): a rank holds experts first..first+E of the router's and `group` is set; it
    runs only the rows routed to them and the ranks' partial outputs are summed by one all-reduce."""

    first = 0
    group = None

    def __init__(self, cfg: TextConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> [T, H]. Rows are sorted by expert, run through the grouped GEMMs,
        scattered back by inverse permutation and summed over the k choices (index_add_ is slow on CPU)."""
        t, k = ids.shape
        experts, order = torch.sort(ids.flatten(), stable=True)
        owned = torch.arange(self.first, self.first + self.down_proj.shape[0], device=ids.device)
        ends = torch.searchsorted(experts, owned, right=True)
        if self.group is not None:  # only the sorted rows of this rank's experts (one host read)
            lo, hi = torch.cat([torch.searchsorted(experts, owned[:1]), ends[-1:]]).tolist()
            order, ends = order[lo:hi], ends - lo
        gate, up = expert_matmul(x[order // k], self.gate_up_proj, ends).chunk(2, dim=-1)
        y = expert_matmul(gelu_tanh(gate) * up, self.down_proj, ends) * weights.flatten()[order, None]
        out = y.new_zeros(t * k, y.shape[1]) if self.group is not None else torch.empty_like(y)
        unsorted = out.index_copy_(0, order, y)
        return all_reduce(unsorted.view(t, k, -1).sum(1).to(x.dtype), self.group)
