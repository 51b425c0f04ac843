"""RMSNorm's fused inference op (`F.rms_norm` on float32) is the reference's float32 ops, bit for bit, in every
dtype and shape the model norms (hidden rows, heads, odd widths), with and without a weight."""

import pytest
import torch

from dgemma.model.layers import RMSNorm


def _reference(x, weight, eps):
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (h if weight is None else h * weight.float()).type_as(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 2816), (2, 3, 4, 256), (5, 33), (300, 512)])
def test_inference_op_is_the_reference(dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    for scale in (1e-3, 1.0, 40.0):
        x = (torch.randn(shape, generator=g) * scale).to(dtype)
        for with_scale in (True, False):
            norm = RMSNorm(shape[-1], 1e-6, with_scale)
            if with_scale:
                norm.weight.data.normal_(generator=g)
            norm.to(dtype)
            with torch.inference_mode():
                assert torch.equal(norm(x), _reference(x, norm.weight, 1e-6))
            assert torch.equal(norm(x), _reference(x, norm.weight, 1e-6))  # autograd keeps the reference's ops
