"""The quantized-weight contract and the matmuls every format shares: chunked dequantisation into a reused workspace.

A `QuantizedWeight` is an `nn.Module` standing where a float weight would be (`Linear.weight`, `Experts.gate_up_proj`,
`embed_tokens.weight`). It has the float weight's logical `shape` ([N, K], or [E, N, K] for stacked experts), a
`dtype` (the float dtype the model computes in) and a `device`; its packed codes and scales are buffers. A format
only says how to decode rows: `_decode(sel, out)` writes the float rows `sel` (a slice or index tensor over dim 0)
into `out`. Everything else is here:

- `linear(x)` = x @ W.T and `linear_t(x)` = x @ W for 2D weights (the LM head and the self-conditioning soft
  embedding), decoding at most `chunk_elements()` weight elements at a time into a per-thread workspace: the full
  float weight never exists, and the workspace stays in cache-sized pieces on the CPU;
- `embedding(ids)` decodes only the looked-up rows;
- `dequantize(sel, dtype)` gives float rows for the grouped expert GEMMs (`model/moe.py`).

`linear` runs the path `choice` (quant/kernels.py) gives the call's number of rows: a format's weight-only kernel
(`kernel_mm` and `kernel_name`, e.g. torch's int4 CPU kernel in quant/int4cpu.py) for few rows, `+a8`'s int8 GEMM,
or decode + the float GEMM in `x`'s compute dtype. A device's fused kernel plugs in as a format class with
`kernel_mm` and a row limit in kernels.KERNEL_ROWS.
Under autograd (QLoRA) a decoded chunk is a fresh tensor, since backward keeps it.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import nn

from dgemma.quant.kernels import KERNEL, Choice, choose, compute_dtype

CPU_CHUNK_ELEMENTS = 1 << 18  # 1 MB of float32: decode + GEMM stay in L2 / L3
DEVICE_CHUNK_ELEMENTS = 1 << 26

_local = threading.local()


def workspace(numel: int, dtype: torch.dtype, device: torch.device, fresh: bool, use: str = "") -> torch.Tensor:
    """A flat buffer reused across calls on this thread (allocating per call costs page faults); `use` names a
    buffer of its own for callers whose data must survive the decode workspace's next use."""
    if fresh:
        return torch.empty(numel, dtype=dtype, device=device)
    ws = getattr(_local, "buffers", {})
    _local.buffers = ws
    key = (dtype, device, use) if use else (dtype, device)
    buf = ws.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: usable in and outside inference mode
            buf = ws[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


class QuantizedWeight(nn.Module):
    """A frozen weight of logical `shape` stored compactly; see the module docstring for the contract."""

    format = "?"

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        super().__init__()
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._choice: Choice | None = None

    # ---- what a format implements --------------------------------------------------------------------------------
    def _decode(self, sel: slice | torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def group_size(self) -> int:
        raise NotImplementedError

    def rebuild(self, buffers: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The same format over other buffers (every persistent buffer has the rows N at dim -2)."""
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    @property
    def nbytes(self) -> int:
        """Bytes held, the `+a8` copy included."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def numel(self) -> int:
        return math.prod(self.shape)

    def extra_repr(self) -> str:
        return f"{self.format}, shape={list(self.shape)}, group_size={self.group_size}, dtype={self.dtype}"

    def dequantize(self, sel: slice | torch.Tensor = slice(None), dtype: torch.dtype | None = None,
                   fresh: bool = True) -> torch.Tensor:
        """Float rows `sel` of dim 0 in `dtype` (default: self.dtype); `fresh=False` decodes into the workspace."""
        n = len(range(*sel.indices(self.shape[0]))) if isinstance(sel, slice) else sel.numel()
        shape = (n, *self.shape[1:])
        out = workspace(math.prod(shape), dtype or self.dtype, self.device, fresh).view(shape)
        self._decode(sel, out)
        return out

    def chunk_rows(self) -> int:
        """Rows of dim 0 decoded at a time (at least one)."""
        per_row = math.prod(self.shape[1:])
        budget = CPU_CHUNK_ELEMENTS if self.device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
        return max(1, budget // per_row)

    def _chunks(self, x: torch.Tensor):
        """(lo, hi, float rows lo:hi in x's compute dtype); fresh memory when autograd will keep them."""
        dtype = compute_dtype(x.dtype, x.device)
        fresh = torch.is_grad_enabled() and x.requires_grad
        step = self.chunk_rows()
        for lo in range(0, self.shape[0], step):
            hi = min(lo + step, self.shape[0])
            yield lo, hi, self.dequantize(slice(lo, hi), dtype, fresh)

    def _int8_activations(self, x: torch.Tensor, transposed: bool):
        """The `+a8` copy (quant/a8.py: submodule `a8`) when it serves this call (not under autograd: no backward)."""
        a8 = getattr(self, "a8", None)
        usable = a8 is not None and (a8.blocks_t or not transposed)
        return a8 if usable and not (torch.is_grad_enabled() and x.requires_grad) else None

    @property
    def choice(self) -> Choice:
        """The path each shape class of `linear` takes (quant/kernels.py), chosen on first use and kept."""
        if self._choice is None:
            self._choice = choose(self)
        return self._choice

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W.T -> [..., N] (2D weights): the `+a8` copy when there is one, else the path `choice` gives
        this many rows (decode + GEMM under autograd: the other paths have no backward)."""
        flat = x.reshape(-1, x.shape[-1]).to(compute_dtype(x.dtype, x.device))
        grad = torch.is_grad_enabled() and x.requires_grad
        if a8 := self._int8_activations(x, transposed=False):
            y = a8.linear(flat)
        elif self.choice.path(flat.shape[0]) == KERNEL and not grad:
            y = self.kernel_mm(flat)
        else:
            parts = [flat @ w.T for _, _, w in self._chunks(x)]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y.to(x.dtype).view(*x.shape[:-1], self.shape[0])

    def kernel_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ W.T -> [M, N] through the format's weight-only kernel (formats with `kernel_name`)."""
        raise NotImplementedError

    def linear_t(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., N] @ W -> [..., K] (2D weights): the soft embedding through the tied embedding."""
        flat = x.reshape(-1, x.shape[-1]).to(compute_dtype(x.dtype, x.device))
        if a8 := self._int8_activations(x, transposed=True):
            return a8.linear_t(flat).to(x.dtype).view(*x.shape[:-1], self.shape[1])
        y = None
        for lo, hi, w in self._chunks(x):
            part = flat[:, lo:hi] @ w
            y = part if y is None else y + part
        return y.to(x.dtype).view(*x.shape[:-1], self.shape[1])

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) in self.dtype, decoding only those rows."""
        flat = ids.reshape(-1)
        return self.dequantize(flat).view(*ids.shape, self.shape[-1])


def summary(model: nn.Module) -> str | None:
    """'int4 g32: 38 tensors, int8 g32: 1 tensor' for a model's quantized weights, None when there are none."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantizedWeight):
            key = f"{m.format} g{m.group_size}"
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None
    return ", ".join(f"{k}: {n} tensor{'s' * (n > 1)}" for k, n in sorted(counts.items()))


def kernel_summary(model: nn.Module) -> str | None:
    """Each kind of quantized weight, the matmul it runs and how many there are (`dgemma info`); None without any."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantizedWeight):
            if len(m.shape) == 2:
                a8 = getattr(m, "a8", None) is not None
                key = f"{m.format} 2D: {'oneDNN int8 x int8 (+a8)' if a8 else m.choice.describe()}"
            else:
                grouped = f"{m.kernel_name} per expert" if hasattr(m, "expert_matmul") else "decode + grouped GEMM"
                key = f"{m.format} experts: {grouped}"
            counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{key} ({n})" for key, n in sorted(counts.items())) or None
