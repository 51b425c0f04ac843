"""int4 expert stacks in torch's CPU int4 layout (dgemma/quant/int4cpu.py): exact weights, the kernel's products
against float arithmetic on the same weights, conversion at load."""

import pytest
import torch

import dgemma
from dgemma.quant import IntWeight, int4cpu, quantize_tensor
from dgemma.quant.int4cpu import CPUInt4Weight

pytestmark = pytest.mark.skipif(not int4cpu.available(), reason="no torch CPU int4 kernel")


def _stack(e=5, n=96, k=128, seed=0):
    w = torch.randn(e, n, k, generator=torch.Generator().manual_seed(seed))
    return quantize_tensor(w, 4)


def test_layout_keeps_the_exact_weights():
    w = _stack()
    c = CPUInt4Weight.from_int(w)
    assert c.packed.shape == (5, 96, 64) and c.nbytes == w.nbytes  # a permutation: no extra bytes
    assert torch.equal(c.dequantize(), w.dequantize())
    assert torch.equal(c.dequantize(torch.tensor([3, 1])), w.dequantize(torch.tensor([3, 1])))
    back = c.to_int()
    assert torch.equal(back.qweight, w.qweight) and torch.equal(back.scales, w.scales)
    assert back.scales.is_contiguous()  # what a checkpoint writer saves (the stack keeps them transposed)


def test_scale_tables_are_the_kernels_scale_and_zero_layout():
    """bf16 (scale, 0) pairs [K // g, N, 2], written as int32 bit patterns: the same table as the straightforward
    construction, for negative, zero, tiny and large float16 scales, from fresh or reused buffers."""
    s = torch.randn(3, 40, 6, generator=torch.Generator().manual_seed(3)).half()
    s[0, 0, 0], s[1, 2, 3], s[2, 5, 1], s[2, 7, 2] = 0, -65504, 6e-8, 1e-3
    for reuse in (False, True, True):
        tables = int4cpu.scale_tables([x.T for x in s], reuse=reuse)
        for e in range(3):
            ref = torch.zeros(6, 40, 2, dtype=torch.bfloat16)
            ref[..., 0] = s[e].T.float()
            assert torch.equal(tables[e].view(torch.int16), ref.view(torch.int16))


def test_order_probe_matches_torch_packing():
    codes = torch.randint(0, 16, (64, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    nibbles = torch.stack([packed & 15, packed >> 4], -1).reshape(-1).int()
    assert torch.equal(nibbles, codes.reshape(-1)[int4cpu._order(64, 96)])


@pytest.mark.parametrize("ends", [[4, 4, 11, 20, 23], [1, 2, 2, 3, 4], [0, 0, 1, 1, 1], [90, 200, 200, 301, 320]])
def test_expert_products_follow_the_dequantized_weights(ends, monkeypatch):
    """Experts without rows, one row each (autoregressive decoding: M = 1), a few, and many; scale tables built
    two experts at a time (so batches of tables and their reused buffers are crossed)."""
    monkeypatch.setattr(int4cpu, "TABLES_AT_ONCE", 2)
    w = _stack()
    c = CPUInt4Weight.from_int(w)
    ends = torch.tensor(ends)
    x = torch.randn(int(ends[-1]), 128, generator=torch.Generator().manual_seed(2))
    dense = w.dequantize()
    bounds = [0, *ends.tolist()]
    ref = torch.cat([x[bounds[e]:bounds[e + 1]] @ dense[e].T for e in range(5)])
    got = c.expert_matmul(x, ends)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).norm() / ref.norm() < 0.01  # bfloat16 inputs, scales and outputs


def test_cpu_loads_convert_int4_expert_stacks():
    model = dgemma.load(None, quantize="int4")
    experts = model.module.layers[0].experts
    assert isinstance(experts.gate_up_proj, CPUInt4Weight) and isinstance(experts.down_proj, CPUInt4Weight)
    assert isinstance(model.module.layers[0].self_attn.q_proj.weight, CPUInt4Weight)
    assert len(model.generate("The king", max_new_tokens=8, seed=0, max_denoising_steps=4).token_ids) == 8


def test_convert_frees_each_stack_before_the_next(monkeypatch):
    """Converting a model must not hold two copies of its experts: each replaced stack is gone (no reference left)
    before the next one is converted (the 26B real-shape load ran out of memory when convert kept them all)."""
    import gc
    import weakref

    layer = lambda i: torch.nn.ModuleDict({"gate_up": _stack(seed=i), "down": _stack(seed=9 + i)})  # noqa: E731
    model = torch.nn.ModuleDict({f"layer{i}": layer(i) for i in range(3)})
    old = [weakref.ref(m) for m in model.modules() if isinstance(m, IntWeight)]
    alive_at_each_call = []
    real = CPUInt4Weight.from_int.__func__

    def watched(cls, w):
        gc.collect()
        alive_at_each_call.append(sum(r() is not None for r in old))
        return real(cls, w)

    monkeypatch.setattr(CPUInt4Weight, "from_int", classmethod(watched))
    assert int4cpu.convert(model) == 6
    assert alive_at_each_call == [6, 5, 4, 3, 2, 1]
    assert all(isinstance(m, CPUInt4Weight) for layer in model.values() for m in layer.values())
