"""NVFP4 decoding (quant/fp.py) against a reference written here from the format's definition: E2M1 codes from their
sign / exponent / mantissa bits, E4M3 scales likewise, then float32 `e2m1 * (scale / global)` or `* (scale * global)`
rounded once into the output dtype. The fast path's pair and scale tables must give the same bits."""

import pytest
import torch

from dgemma.quant.fp import NVFP4Weight, _e4m3


def e2m1(code: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> float32: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    c = code.long()
    e, m = (c >> 1) & 3, (c & 1).double()
    mag = torch.where(e == 0, m / 2, (1 + m / 2) * torch.pow(2.0, (e - 1).double()))
    return torch.where((c & 8) > 0, -mag, mag).float()


def e4m3(byte: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) bytes -> float32: bias 7, exponent 0 subnormal, S.1111.111 NaN, no infinities."""
    b = byte.long()
    e, m = (b >> 3) & 15, (b & 7).double()
    mag = torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(2.0, (e - 7).double()))
    mag = torch.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return torch.where((b & 0x80) > 0, -mag, mag).float()


def reference(packed: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor, divide: bool, dtype) -> torch.Tensor:
    """[*, N, K] from the codes (even column in the low nibble), one float32 step per 16 columns."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)
    s = e4m3(scales.view(torch.uint8))
    step = s / glob if divide else s * glob
    return (e2m1(codes) * step.repeat_interleave(16, dim=-1)).to(dtype)


def random_weight(shape, divide: bool, seed: int = 0):
    """Random codes (all 256 bytes), finite scales (zero and subnormals included), a global scale per row."""
    g = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=g, dtype=torch.uint8)
    byte = torch.randint(0, 0x7F, (*lead, n, k // 16), generator=g, dtype=torch.uint8)  # 0x7F is NaN
    byte |= torch.randint(0, 2, byte.shape, generator=g, dtype=torch.uint8) << 7
    glob = torch.rand(*lead, n, 1, generator=g) * 1e3 + 1e-3
    w = NVFP4Weight(packed, byte.view(torch.float8_e4m3fn), glob, torch.float32, divide)
    return w, reference(packed, byte.view(torch.float8_e4m3fn), glob, divide, torch.float32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def test_reference_tables():
    """The reference formulas agree with torch's float8 and the E2M1 list (the definitions, checked once)."""
    byte = torch.arange(256, dtype=torch.uint8)
    torch.testing.assert_close(e4m3(byte), byte.view(torch.float8_e4m3fn).float(), equal_nan=True, rtol=0, atol=0)
    assert e2m1(torch.arange(16)).tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]


def test_e4m3_table_is_torch_conversion():
    """All 256 scale bytes, NaNs and subnormals included, give the bits of torch's own float8 -> float32."""
    byte = torch.arange(256, dtype=torch.uint8)
    assert same_bits(_e4m3("cpu"), byte.view(torch.float8_e4m3fn).float())
    assert torch.isnan(_e4m3("cpu")[[0x7F, 0xFF]]).all() and _e4m3("cpu")[1].item() == 2.0 ** -9


@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_2d(divide, dtype):
    w, ref = random_weight((48, 96), divide)
    assert same_bits(w.dequantize(dtype=dtype), ref.to(dtype))
    assert same_bits(w.dequantize(slice(5, 17), dtype, fresh=False), ref[5:17].to(dtype))
    rows = torch.tensor([40, 3, 3, 0])
    assert same_bits(w.dequantize(rows, dtype), ref[rows].to(dtype))


@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_expert_stack(divide, dtype):
    """[E, N, K] stacks: every expert, a slice, and an index selection (moe.py decodes chosen experts)."""
    w, ref = random_weight((5, 24, 64), divide, seed=1)
    assert same_bits(w.dequantize(dtype=dtype), ref.to(dtype))
    assert same_bits(w.dequantize(slice(1, 3), dtype, fresh=False), ref[1:3].to(dtype))
    experts = torch.tensor([4, 0, 2])
    assert same_bits(w.dequantize(experts, dtype, fresh=False), ref[experts].to(dtype))


def test_bf16_staging_is_not_the_output():
    """Decoding bf16 twice in a row through the workspace gives both results intact (the float32 staging buffer is
    separate from the bf16 workspace the caller holds)."""
    w, ref = random_weight((2, 16, 32), True, seed=2)
    a = w.dequantize(torch.tensor([0]), torch.bfloat16, fresh=True)
    b = w.dequantize(torch.tensor([1]), torch.bfloat16, fresh=False)
    assert same_bits(a, ref[:1].bfloat16()) and same_bits(b, ref[1:].bfloat16())


def test_linear_matches_reference():
    """The chunked matmul over the decode: x @ W.T with W the reference weight."""
    w, ref = random_weight((40, 64), False, seed=3)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(w.linear(x), x @ ref.T, rtol=1e-5, atol=1e-4)
