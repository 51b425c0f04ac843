"""int4 weights, and 2D int8 weights as two int4 halves, on CPUs in torch's own int4 layout, multiplied by
`torch._weight_int4pack_mm_for_cpu`.

torch's int4 kernel unpacks the codes in registers and reads each weight byte once per call, where decoding to
float and running a float GEMM (quant/base.py) reads the codes, writes 4-8x their bytes of float and reads them
back. Below a few rows (an expert's ~16 rows of a canvas, one token of autoregressive decoding, the tied head of
that token) the matmul is bound by reading the weight, and the kernel wins by 4-20x (docs/kernels.md). The kernel
takes bfloat16 activations and scales and writes bfloat16: inputs, group scales and outputs are rounded to
bfloat16 (8-bit mantissa), the cost of the speed. Weights stay exact: the codes and float16 scales are kept, only
permuted into torch's layout, and `dequantize` gives the same floats as the `IntWeight` they came from.

torch's layout (probed, `layout()`; it follows the CPU's vector width): rows in blocks of `block` (64 on AVX-512,
32 on AVX2); a block of w rows is [K, w / 2] bytes, column-major over the block's rows; a byte holds rows j and
j + w/2 ("split") or 2j and 2j + 1 ("pairs"); a last block of fewer rows holds pairs. Both decode with byte
operations (a byte transpose, then the two nibbles), as fast as the group-local layout of quant/intq.py.

`convert(module)` replaces every int4 `IntWeight` whose shape the kernel takes, on CPUs that have it: 2D weights
(projections, the tied embedding) get `kernel_mm`, which `linear` runs for calls of few rows (quant/kernels.py),
and keep the kernel's bfloat16 scale-and-zero table (4 bytes per group); expert stacks
[E, N, K] get a grouped `expert_matmul` (model/moe.py prefers it). 2D int8 weights become `CPUInt8SplitWeight`:
each code split in a high and a low 4-bit half, two int4 rows a row in one kernel call (exact; 2x the int4
kernel's work, still 4-13x faster than decode + GEMM at M = 1-4); int8 expert stacks keep decode + GEMM.
"""

from __future__ import annotations

import math
import sys
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import Tensor

from dgemma.quant.base import QuantizedWeight, workspace
from dgemma.quant.intq import IntWeight, pack_int4, unpack_int4

GROUPS = (32, 64, 128, 256)  # the kernel's group sizes
TABLES_AT_ONCE = 16  # experts' scale tables built per batch (a token uses 8; 16 take 20 MB at the real width)


def available() -> bool:
    """torch has the kernel and its packer, and ints are little-endian (`scale_tables` writes bf16 pairs as int32)."""
    kernel = hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")
    return kernel and sys.byteorder == "little"


class Int4Packing(NamedTuple):
    block: int  # rows per full block
    split: bool  # a full block's byte j holds rows j and j + block / 2 (else 2j and 2j + 1)


def _order(n: int, k: int) -> Tensor:
    """For torch's packing of an [n, k] matrix: the flat source index (row * k + column) of each packed nibble, in
    packed order (byte-major, low nibble first). Found by packing probes that spell each index 4 bits at a time."""
    idx = torch.arange(n * k, dtype=torch.int64).view(n, k)
    order = torch.zeros(n * k, dtype=torch.int64)
    for d in range(math.ceil(math.log2(n * k) / 4)):
        packed = torch._convert_weight_to_int4pack_for_cpu(((idx >> 4 * d) & 15).int(), 2)
        order |= _nibbles(packed).reshape(-1).long() << 4 * d
    return order


def _nibbles(packed: Tensor) -> Tensor:
    """uint8 [..., b] -> the 2b nibble values (0..15), low nibble first."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


@lru_cache(maxsize=1)
def layout() -> Int4Packing | None:
    """This torch build's and CPU's int4 layout, or None when it is not one `_codes` reads (then nothing converts)."""
    if not available():
        return None
    block = int(_order(128, 2)[0:256].view(-1).tolist().index(1))  # nibble position of (row 0, column 1)
    for split in (True, False):
        guess = Int4Packing(block, split)
        if all(torch.equal(_order(n, 64), _predicted(n, 64, guess)) for n in (2 * block, block + 16)):
            return guess
    return None


def _predicted(n: int, k: int, lay: Int4Packing) -> Tensor:
    """The order `_order(n, k)` gives if torch packs as `lay` says (see the module docstring)."""
    order = []
    main = n - n % lay.block
    blocks = [(start, lay.block, lay.split) for start in range(0, main, lay.block)] + [(main, n - main, False)]
    for start, width, split in blocks:
        for col in range(k):
            for j in range(width // 2):
                pair = (j, j + width // 2) if split else (2 * j, 2 * j + 1)
                order += [(start + r) * k + col for r in pair]
    return torch.tensor(order)


def fits(w: QuantizedWeight) -> bool:
    """An `IntWeight` whose shape the kernel and the probed layout take: int4 (2D or an expert stack) or 2D int8."""
    dims = (2, 3) if getattr(w, "bits", 0) == 4 else (2,)
    return (isinstance(w, IntWeight) and len(w.shape) in dims and w.group_size in GROUPS and w.shape[-2] % 16 == 0
            and layout() is not None)


class CPUInt4Weight(QuantizedWeight):
    """An int4 weight [N, K] or expert stack [E, N, K] in torch's CPU int4 layout (`packed` [*, N, K // 2], blocks
    of rows as `layout()` says) with the float16 group scales [*, N, K // g] of the `IntWeight` it came from."""

    format, bits = "int4", 4
    kernel_name = "torch int4 kernel (bf16)"

    def __init__(self, packed: Tensor, scales: Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                 scale_zero: Tensor | None = None):
        super().__init__(shape, dtype)
        self.layout = layout()
        self.register_buffer("packed", packed)
        if len(shape) == 2:  # the kernel's bf16 [K // g, N, 2] scales and zeros, built once (or given: a cache's)
            self.register_buffer("scales", scales)
            table = self._table(scales) if scale_zero is None else scale_zero
            self.register_buffer("scale_zero", table, persistent=False)
        else:  # stored [E, K // g, N] (a transposed view): a call's tables are built from contiguous rows
            self.register_buffer("scales", scales.transpose(-1, -2).contiguous().transpose(-1, -2))

    @classmethod
    def from_int(cls, w: IntWeight) -> CPUInt4Weight:
        n, k = w.shape[-2:]
        slabs = w.qweight.view(-1, n, k // 2)
        packed = torch.empty(slabs.shape, dtype=torch.uint8)
        for i in range(slabs.shape[0]):  # unsigned codes, zero at 8
            _pack_into(packed[i], lambda lo, hi: unpack_int4(slabs[i, lo:hi], w.group_size).int() + 8)
        return cls(packed.view(*w.shape[:-1], k // 2), w.scales, tuple(w.shape), w.dtype)

    @staticmethod
    def _table(scales: Tensor) -> Tensor:
        """The kernel's bf16 scale-and-zero table [K // g, N, 2] of a 2D weight's group scales [N, K // g]."""
        return scale_tables([scales.T])[0]

    @property
    def group_size(self) -> int:
        return self.shape[-1] // self.scales.shape[-1]

    @property
    def block_rows(self) -> int:
        """Rows of the weight in one block of torch's layout."""
        return self.layout.block

    def chunk_rows(self) -> int:
        """The base chunk rounded up to whole blocks of rows (the fast decode)."""
        if len(self.shape) == 3:
            return super().chunk_rows()
        return -(-super().chunk_rows() // self.block_rows) * self.block_rows

    # ---- decoding ------------------------------------------------------------------------------------------------
    def _codes(self, sel, out: Tensor) -> Tensor:
        """The signed codes of rows (2D) or experts (3D) `sel` written into `out` [m, N, K] or [m, K]."""
        if len(self.shape) == 3:
            slabs = self.packed[sel]
            for e in range(slabs.shape[0]):
                out[e].copy_(self._block_codes(slabs[e], self.shape[1]))
            return out
        rows = range(*sel.indices(self.shape[0])) if isinstance(sel, slice) else None
        if rows is not None and rows.start % self.block_rows == 0 and (
                rows.stop % self.block_rows == 0 or rows.stop == self.shape[0]):
            row_bytes = self.packed.numel() // self.shape[0]  # K / 2; an int8 weight's K
            flat = self.packed.view(-1)[rows.start * row_bytes:rows.stop * row_bytes]
            out.copy_(self._block_codes(flat, len(rows)))
            return out
        ids = torch.arange(rows.start, rows.stop) if rows is not None else sel.reshape(-1)
        return out.copy_(self._row_codes(ids))

    def _block_codes(self, flat: Tensor, n: int) -> Tensor:
        """int8 codes [n, K] of n rows stored as whole blocks (the last one possibly short) in bytes `flat`."""
        k = self.shape[-1]
        return _unpacked_codes(flat.view(-1, k // 2), n, k, self.layout)

    def _row_codes(self, ids: Tensor) -> Tensor:
        """int8 codes [len(ids), K] of single rows (an embedding lookup): a strided byte gather per row."""
        n, k = self.shape
        lay = self.layout
        main = n - n % lay.block
        raw = torch.empty(ids.numel(), k, dtype=torch.uint8)
        high = torch.empty(ids.numel(), 1, dtype=torch.uint8)
        flat = self.packed.view(-1)
        for lo, hi, width, split in ((0, main, lay.block, lay.split), (main, n, n - main, False)):
            part = (ids >= lo) & (ids < hi)
            block, j = (ids[part] - lo).div(width, rounding_mode="floor"), (ids[part] - lo) % width
            if j.numel():
                byte, upper = (j % (width // 2), j >= width // 2) if split else (j // 2, j % 2 == 1)
                blocks = flat[lo * k // 2:hi * k // 2].view(-1, k, width // 2)  # [blocks, K, w/2]
                raw[part] = blocks[block, :, byte]
                high[part] = upper[:, None].to(torch.uint8) * 4
        return ((raw >> high) & 15).view(torch.int8) - 8

    def _decode(self, sel, out: Tensor) -> None:
        grouped = self._codes(sel, out).view(*out.shape[:-1], -1, self.group_size)
        grouped.mul_(self.scales[sel].to(out.dtype)[..., None])

    def to_int(self) -> IntWeight:
        """The `IntWeight` this weight came from (its layout, the same codes and scales)."""
        codes = self._codes(slice(None), torch.empty(self.shape, dtype=torch.int8))
        qweight = codes if self.bits == 8 else pack_int4(codes, self.group_size)
        return IntWeight(qweight, self.scales.contiguous(), self.bits, self.dtype)

    def rebuild(self, buffers: dict[str, Tensor]) -> CPUInt4Weight:
        """Over other experts (the leading dimension); rows of a block cannot be sliced."""
        return CPUInt4Weight(buffers["packed"], buffers["scales"], (*buffers["packed"].shape[:-1], self.shape[-1]),
                             self.dtype)

    # ---- matmuls -------------------------------------------------------------------------------------------------
    def kernel_mm(self, x: Tensor) -> Tensor:
        """x [M, K] @ W.T -> [M, N] in x's dtype through torch's int4 kernel (2D weights)."""
        y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group_size, self.scale_zero)
        return y.to(x.dtype)

    def expert_matmul(self, x: Tensor, ends: Tensor) -> Tensor:
        """x [R, K] sorted by expert (expert e owns rows ends[e-1]..ends[e]) times w[e].T -> [R, N] in x's dtype."""
        bounds = [0, *ends.tolist()]
        used = [e for e in range(self.shape[0]) if bounds[e + 1] > bounds[e]]
        xb = x.to(torch.bfloat16)
        parts = [xb.new_empty(0, self.shape[1])]  # the used experts' rows, in order, make up all of x's rows
        for c in range(0, len(used), TABLES_AT_ONCE):
            chunk = used[c:c + TABLES_AT_ONCE]
            tables = scale_tables([self.scales[e].T for e in chunk], reuse=True)
            parts += [torch._weight_int4pack_mm_for_cpu(xb[bounds[e]:bounds[e + 1]], self.packed[e], self.group_size,
                                                         tables[i]) for i, e in enumerate(chunk)]
        return torch.cat(parts).to(x.dtype)


class CPUInt8SplitWeight(CPUInt4Weight):
    """A 2D int8 weight [N, K] run exactly through torch's int4 kernel: a code q = 16 h + l (h in -8..7, l in 0..15)
    is two int4 codes, each int8 row r two rows of the int4 weight [2N, K] (`packed`: N x K bytes, torch's layout):
    l with group scale s and zero 8 s ((l - 8) s + 8 s = l s), and h + 8 with scale 16 s; the two output columns
    add up to row r's. The int4 rows are ordered (`_interleave`) so that each byte of the layout pairs the halves of
    one code, (h + 8) * 16 + l = q + 128: decoding is a byte transpose. `scales`: the int8 weight's [N, K // g]."""

    format, bits = "int8", 8
    kernel_name = "torch int4 kernel on int8 halves (bf16)"

    @classmethod
    def from_int(cls, w: IntWeight) -> CPUInt8SplitWeight:
        n, k = w.shape
        packed = torch.empty(2 * n, k // 2, dtype=torch.uint8)
        q = w.qweight
        _pack_into(packed, lambda lo, hi: _interleave(q[lo // 2:hi // 2] & 15, (q[lo // 2:hi // 2] >> 4) + 8).int())
        return cls(packed, w.scales, tuple(w.shape), w.dtype)

    @staticmethod
    def _table(scales: Tensor) -> Tensor:
        s = scales.float()
        scale, zero = _interleave(s, 16 * s), _interleave(8 * s, torch.zeros_like(s))  # [2N, K // g]
        return torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16)

    @property
    def block_rows(self) -> int:
        return self.layout.block // 2

    def _block_codes(self, flat: Tensor, n: int) -> Tensor:
        """Block b's bytes [K, w] (w rows; a short last block's fewer) hold rows b * w.. column by column."""
        k = self.shape[-1]
        out = torch.empty(n, k, dtype=torch.uint8)
        main = n - n % self.block_rows
        for lo, hi, width in ((0, main, self.block_rows), (main, n, n - main)):
            if hi > lo:
                out[lo:hi].view(-1, width, k).copy_(flat[lo * k:hi * k].view(-1, k, width).transpose(1, 2))
        return out.bitwise_xor_(128).view(torch.int8)

    def _row_codes(self, ids: Tensor) -> Tensor:
        """One strided byte gather per row."""
        n, k = self.shape
        main = n - n % self.block_rows
        out = torch.empty(ids.numel(), k, dtype=torch.uint8)
        for lo, hi, width in ((0, main, self.block_rows), (main, n, n - main)):
            part = (ids >= lo) & (ids < hi)
            if part.any():
                blocks = self.packed.view(-1)[lo * k:hi * k].view(-1, k, width)
                out[part] = blocks[(ids[part] - lo) // width, :, (ids[part] - lo) % width]
        return out.bitwise_xor_(128).view(torch.int8)

    def kernel_mm(self, x: Tensor) -> Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group_size, self.scale_zero)
        return _joined(y).to(x.dtype)


def _interleave(low: Tensor, high: Tensor) -> Tensor:
    """Rows [r, ...] of an int8 weight's two halves (from a block boundary) -> the int4 weight's rows [2r, ...] in the
    order whose bytes pair them: a full block of w rows holds w / 2 rows' halves, the low ones at j and the high ones
    at j + w / 2 ("split" layouts) or at 2j and 2j + 1 ("pairs", and a short last block)."""
    lay, r = layout(), low.shape[0]
    main = r - r % (lay.block // 2)
    parts = [torch.stack([low[main:], high[main:]], 1).flatten(0, 1)]
    if main:
        a, b = (t[:main].unflatten(0, (-1, lay.block // 2)) for t in (low, high))
        parts.insert(0, torch.stack([a, b], 1 if lay.split else 2).flatten(0, 2))
    return torch.cat(parts)


def _joined(y: Tensor) -> Tensor:
    """Kernel outputs [M, 2N] over `_interleave`'s rows -> each int8 row's two halves summed, float32 [M, N]."""
    lay, n = layout(), y.shape[-1] // 2
    main = n - n % (lay.block // 2)
    split = lay.split
    blocks = y[:, :2 * main].unflatten(1, (-1, 2, lay.block // 2) if split else (-1, lay.block // 2, 2))
    tail = y[:, 2 * main:].unflatten(1, (-1, 2)).sum(2, dtype=torch.float32)
    return torch.cat([blocks.sum(2 if split else 3, dtype=torch.float32).flatten(1), tail], dim=1)


def _pack_into(out: Tensor, codes) -> None:
    """Fill `out` [n, C // 2] with torch's int4 layout of the unsigned codes [n, C] (int32, 0..15) that `codes(lo, hi)`
    gives for rows lo..hi, packed whole blocks of rows at a time (int32 codes: 16 MB)."""
    n, half = out.shape
    step = max(64, (1 << 21) // half // 64 * 64)
    for lo in range(0, n, step):
        out[lo:lo + step] = torch._convert_weight_to_int4pack_for_cpu(codes(lo, lo + step), 2).view(-1, half)


def scale_tables(scales_t: list[Tensor], reuse: bool = False) -> Tensor:
    """Group scales [K // g, N] of m weights -> the kernel's bf16 scale-and-zero tables [m, K // g, N, 2] (zeros 0),
    in per-thread buffers when `reuse` (valid until the next call: fresh MBs a call cost page faults). Each (scale,
    0) pair is one little-endian int32 holding the bf16 bits, so nothing writes `table[..., 0]` with a stride (from
    float16 scales that took 10-30x longer: 20 ms a token at the real width). The scales read fastest contiguous."""
    shape = (len(scales_t), *scales_t[0].shape) if scales_t else (0, 0, 0)
    buf = {d: workspace(math.prod(shape), d, torch.device("cpu"), not reuse, "scale tables").view(shape)
           for d in (torch.float32, torch.bfloat16, torch.int32)}
    for out, s in zip(buf[torch.float32], scales_t):
        out.copy_(s)
    bits = buf[torch.int32].copy_(buf[torch.bfloat16].copy_(buf[torch.float32]).view(torch.uint16))  # zero-extends
    return bits.view(torch.bfloat16).view(*shape, 2)


def _unpacked_codes(packed: Tensor, n: int, k: int, lay: Int4Packing) -> Tensor:
    """Packed rows [n, K // 2] (whole blocks, torch's layout) -> int8 codes [n, K]."""
    out = torch.empty(n, k, dtype=torch.uint8)
    main = n - n % lay.block
    for rows, width, split in ((slice(0, main), lay.block, lay.split), (slice(main, n), n - main, False)):
        if rows.stop > rows.start:
            p = packed[rows].reshape(-1, k, width // 2).transpose(1, 2).contiguous()  # [nb, w/2, K]: byte rows
            o = out[rows].view(-1, 2, width // 2, k) if split else out[rows].view(-1, width // 2, 2, k)
            lo, hi = (o[:, 0], o[:, 1]) if split else (o[:, :, 0], o[:, :, 1])
            torch.bitwise_and(p, 15, out=lo)
            torch.bitwise_right_shift(p, 4, out=hi)
    return out.view(torch.int8).sub_(8)


def converted(w: IntWeight) -> CPUInt4Weight:
    """The weight in torch's int4 layout (`w` must fit)."""
    return (CPUInt4Weight if w.bits == 4 else CPUInt8SplitWeight).from_int(w)


def convert(module: torch.nn.Module) -> int:
    """Replace every `IntWeight` of `module` that `fits` with its `converted` weight, one at a time (only names are
    listed first: each old weight is freed as soon as it is replaced, so converting never holds a second copy of
    the model's experts); returns how many were converted."""
    targets = [(owner, name) for owner, parent in module.named_modules() for name, w in parent.named_children()
               if fits(w)]
    for owner, name in targets:
        parent = module.get_submodule(owner)
        setattr(parent, name, converted(getattr(parent, name)))
    return len(targets)
