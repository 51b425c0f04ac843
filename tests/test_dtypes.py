"""The dtype policy under both CPU kinds, forced with DGEMMA_NATIVE_BF16 so that every machine checks both:
`auto` keeps a small bf16 checkpoint in bf16 only where bf16 matmuls are native, and bf16 GEMMs run in float32
elsewhere (exact bf16 inputs, float32 accumulation)."""

import pytest
import torch

import dgemma
from dgemma.dtypes import POLICY_ENV, native_bf16
from dgemma.model.layers import Linear, gemm_dtype


@pytest.fixture(params=["0", "1"], ids=["avx2", "native-bf16"])
def native(request, monkeypatch):
    monkeypatch.setenv(POLICY_ENV, request.param)
    return request.param == "1"


def test_the_override_is_the_policy(native):
    assert native_bf16("cpu") is native


def test_auto_dtype_of_the_bundled_bf16_checkpoint(native):
    model = dgemma.load()
    want = torch.bfloat16 if native else torch.float32
    assert model.module.embed_tokens.weight.dtype == want
    assert len(model.generate("Once", max_new_tokens=4, seed=0, max_denoising_steps=2).token_ids) == 4


def test_bf16_gemms_without_native_units_run_in_float32(native):
    g = torch.Generator().manual_seed(0)
    layer = Linear(64, 32, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    assert gemm_dtype(layer.weight) == (torch.bfloat16 if native else torch.float32)
    if not native:  # float32 GEMM of the exact bf16 values, rounded once to bf16
        want = (x.double() @ layer.weight.double().T).to(torch.bfloat16)
        torch.testing.assert_close(layer(x), want, rtol=2**-8, atol=0)  # one bf16 rounding at most


def test_a_bad_override_falls_back_to_the_cpu(monkeypatch):
    monkeypatch.setenv(POLICY_ENV, "yes")
    assert native_bf16("cpu") == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
