"""Quantized weights and their matmuls (weight-only unless `+a8` asks for int8 activations).

API (what other packages use):
- `QuantizedWeight` (quant/base.py): an nn.Module standing in for a float weight of logical `shape` [N, K] or
  [E, N, K] (stacked experts); `dtype` (the float compute dtype), `device`, `format`, `group_size`, `nbytes`;
  `linear(x)` = x @ W.T, `linear_t(x)` = x @ W, `embedding(ids)`, `dequantize(sel, dtype, fresh)` (float rows of
  dim 0: the expert GEMMs in model/moe.py decode a few experts at a time through it).
  A new format subclasses it and implements `_decode(sel, out)` and `group_size`.
- `IntWeight` (quant/intq.py): int8 / int4 symmetric group-wise (`qweight`, `scales`; layout in that module),
  built by `int_weight(rows, shape, bits, group_size, dtype, device)` from a row reader (memory-mapped
  checkpoints quantize a chunk at a time) or `quantize_tensor(w, bits, group_size)`.
- `FP8Weight`, `NVFP4Weight` (quant/fp.py): the formats pre-quantized checkpoints bring (decoded on the fly).
- `QuantSpec` / `parse_quantize` (quant/spec.py): the `--quantize` vocabulary.
- `a8` (quant/a8.py): `+a8`, int8 activations for 2D quantized weights on x86 CPUs (`a8.enable(module, ...)`).
- `int4cpu` (quant/int4cpu.py): int4 weights (and 2D int8 ones, as two int4 halves) in torch's CPU int4 layout,
  converted at load on CPUs (once: later loads memory-map them from weights/kernel_cache.py): 2D weights with
  `kernel_mm` (the weight-only kernel `linear` runs for few rows), expert stacks with their own grouped kernel
  (`expert_matmul(x, ends)`, which model/moe.py prefers when a format has it).
- `kernels` (quant/kernels.py): which path `linear` takes for a call's number of rows, chosen once per weight
  (`QuantizedWeight.choice`); `kernel_summary(model)` is what `dgemma info` shows.
"""

from dgemma.quant.base import QuantizedWeight, kernel_summary, summary
from dgemma.quant.fp import FP8Weight, NVFP4Weight
from dgemma.quant.kernels import compute_dtype
from dgemma.quant.intq import DEFAULT_GROUP, IntWeight, int_weight, pack_int4, quantize_tensor, unpack_int4
from dgemma.quant.spec import SCHEMES, QuantSpec, parse_quantize

__all__ = ["DEFAULT_GROUP", "FP8Weight", "IntWeight", "NVFP4Weight", "QuantSpec", "QuantizedWeight", "SCHEMES",
           "compute_dtype", "int_weight", "kernel_summary",
           "pack_int4", "parse_quantize", "quantize_tensor", "summary", "unpack_int4"]
