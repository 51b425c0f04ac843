"""Kernel choice by shape for 2D quantized weights (dgemma/quant/kernels.py, quant/int4cpu.py): torch's int4 layout
probed against torch's own packer, every path (int4, and int8 as two int4 halves) against the dequantized weight
for M = 1, small and large, the choice made once per weight, and a model's logits through the dispatch."""

import pytest
import torch

import dgemma
from dgemma.quant import IntWeight, int4cpu, kernels, quantize_tensor
from dgemma.quant.int4cpu import CPUInt4Weight, CPUInt8SplitWeight

pytestmark = pytest.mark.skipif(int4cpu.layout() is None, reason="no torch CPU int4 kernel")
BF16_STEP = 2.0**-8  # bfloat16's relative rounding step: the kernel rounds activations, scales and outputs


def _quantized(n, k=128, seed=0, bits=4):
    w = quantize_tensor(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), bits)
    if bits == 8:  # the extreme codes (GGUF Q8_0 holds -128)
        w.qweight[0, :3] = torch.tensor([-128, 127, -127], dtype=torch.int8)
    return w


@pytest.mark.parametrize("n", [16, 96, 208, 128])  # tails of 16 / 32 / 16 rows after whole blocks, none
def test_layout_probe_predicts_torch_packing(n):
    lay = int4cpu.layout()
    assert torch.equal(int4cpu._order(n, 64), int4cpu._predicted(n, 64, lay))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [96, 208])
def test_2d_decode_from_torch_layout_is_exact(n, bits):
    w = _quantized(n, bits=bits)
    c = int4cpu.converted(w)
    assert isinstance(c, CPUInt8SplitWeight if bits == 8 else CPUInt4Weight)
    assert c.nbytes == w.nbytes + c.scale_zero.nbytes  # codes permuted; plus the kernel's bf16 scale table
    for sel in (slice(None), slice(0, 64), slice(64, n), slice(3, 40), torch.tensor([n - 1, 0, 70, 70])):
        assert torch.equal(c.dequantize(sel), w.dequantize(sel)), sel
    assert torch.equal(c.embedding(torch.tensor([[5, n - 2]])), w.embedding(torch.tensor([[5, n - 2]])))
    back = c.to_int()
    assert back.bits == bits and torch.equal(back.qweight, w.qweight) and torch.equal(back.scales, w.scales)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 7, 16, 300])
@pytest.mark.parametrize("path", [kernels.KERNEL, kernels.DECODE])
def test_each_path_follows_the_dequantized_weight(m, path, bits):
    w = _quantized(208, bits=bits)
    c = int4cpu.converted(w)
    c._choice = kernels.Choice(path, kernels.ALL_ROWS, path, c.kernel_name)
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ w.dequantize().double().T
    got = c.linear(x)
    assert got.dtype == torch.float32 and got.shape == (m, 208)
    if path == kernels.DECODE:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    else:  # bf16 inputs and scales (a relative step each per product) and a rounded output
        assert ((got.double() - ref).norm() / ref.norm()).item() < 2 * BF16_STEP
        assert ((got.double() - ref).abs() <= 3 * BF16_STEP * (x.abs().double() @ w.dequantize().abs().double().T)
                ).all()


def test_choice_is_made_once_and_follows_the_rows(monkeypatch):
    c = CPUInt4Weight.from_int(_quantized(96))
    c._choice = kernels.Choice(kernels.KERNEL, 4, kernels.DECODE, c.kernel_name)
    calls = []
    real = torch._weight_int4pack_mm_for_cpu
    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (1, 4, 5, 64):
        c.linear(torch.randn(m, 128))
    assert calls == [1, 4]
    assert c.choice.describe() == "M<=4: torch int4 kernel (bf16); larger: decode + GEMM"
    with torch.enable_grad():  # autograd (QLoRA) decodes: the kernel has no backward
        x = torch.randn(1, 128, requires_grad=True)
        c.linear(x).sum().backward()
    assert calls == [1, 4] and x.grad is not None


@pytest.mark.parametrize("bits", [4, 8])
def test_choice_by_device_and_dtype(monkeypatch, bits):
    c = int4cpu.converted(_quantized(96, bits=bits))
    monkeypatch.setattr(kernels, "native_bf16", lambda device: False)
    assert kernels.choose(c).rows == kernels.KERNEL_ROWS[(f"int{bits}", "cpu", False, torch.float32)]
    assert kernels.choose(IntWeight(c.to_int().qweight, c.scales, bits, torch.float32)).path(1) == kernels.DECODE


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_model_logits_unchanged_by_the_dispatch(scheme):
    """The bundled model in int4 / int8, its 2D weights through the kernel choice against the same weights decoded
    for every call (what ran before): encoder tokens one at a time (M = 1, autoregressive decoding and its head) and
    a denoising pass; the difference is the kernel's bf16 rounding, far below int4's own error."""
    after = dgemma.load(None, dtype="float32", quantize=scheme).module
    before = dgemma.load(None, dtype="float32", quantize=scheme).module
    for name, w in list(before.named_modules()):
        if isinstance(w, CPUInt4Weight) and len(w.shape) == 2:
            owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
            setattr(before.get_submodule(owner), leaf, w.to_int())
    assert isinstance(after.embed_tokens.weight, CPUInt4Weight) and isinstance(before.embed_tokens.weight, IntWeight)
    logits = {}
    with torch.inference_mode():
        for key, mod in (("before", before), ("after", after)):
            cache = mod.new_cache(1, 64)
            rows = [mod.head(mod.encode(torch.tensor([[t]]), cache)) for t in (2, 651, 1024, 300, 17)]
            canvas = torch.randint(0, 4096, (1, mod.cfg.canvas_length), generator=torch.Generator().manual_seed(1))
            logits[key] = torch.cat([*rows, mod.head(mod.denoise(canvas, cache))], dim=1)
    diff = (logits["after"] - logits["before"]).abs()
    assert 0 < diff.max() < 0.02 * logits["before"].abs().max()  # measured 0.0055 (int4), 0.0053 (int8)
    assert (logits["after"].argmax(-1) == logits["before"].argmax(-1)).float().mean() > 0.95


def test_info_names_the_kernels():
    info = dgemma.load(None, quantize="int4").describe()
    assert "int4 2D: M<=" in info["kernels"] or "int4 2D: torch int4 kernel" in info["kernels"]
    assert "int4 experts: torch int4 kernel (bf16) per expert" in info["kernels"]
    info = dgemma.load(None, quantize="int8").describe()["kernels"]
    assert "int8 2D: M<=" in info and "torch int4 kernel on int8 halves (bf16)" in info
    assert "int8 experts: decode + grouped GEMM" in info
