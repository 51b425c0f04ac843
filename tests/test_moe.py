"""Grouped-GEMM experts against the per-expert loop they replaced, and without host reads."""

import importlib.util
import threading
from pathlib import Path

import pytest
import torch

from dgemma.config import TextConfig
from dgemma.instruments import Recorder
from dgemma.model import moe
from dgemma.model.moe import Experts
from dgemma.quant import base as quant_base


def _benchmark():
    """benchmarks/moe.py keeps the replaced per-expert loop (counts read on the host): the oracle here."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe.py"
    spec = importlib.util.spec_from_file_location("moe_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


loop_oracle = _benchmark().old_forward


def make(e=6, k=3, h=32, i=16, dtype=torch.float32, device="cpu"):
    cfg = TextConfig(hidden_size=h, num_experts=e, top_k_experts=k, moe_intermediate_size=i)
    experts = Experts(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.2)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.2)
    return experts.to(dtype)


def routing(t, e, k, seed=0, only=None):
    """Random top-k ids (distinct per row) over `only` experts (default all: some may still get no token)."""
    g = torch.Generator().manual_seed(seed)
    pool = only if only is not None else e
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("t,only", [(1, None), (5, None), (40, None), (12, 4)])
@torch.no_grad()
def test_grouped_matches_loop_fp32(t, only):
    experts = make()
    weights, ids = routing(t, 6, 3, seed=t, only=only)
    x = torch.randn(t, 32)
    if only is not None:
        assert torch.bincount(ids.flatten(), minlength=6)[4:].sum() == 0  # experts with zero tokens
    assert (experts(x, weights, ids) - loop_oracle(experts, x, weights, ids)).abs().max() <= 1e-5


@torch.no_grad()
def test_grouped_matches_loop_bf16_and_converted(monkeypatch):
    experts = make(dtype=torch.bfloat16)
    weights, ids = routing(20, 6, 3, seed=3)
    x = torch.randn(20, 32).bfloat16()
    want = loop_oracle(experts, x, weights, ids).float()
    assert (experts(x, weights, ids).float() - want).abs().max() <= 2e-2
    monkeypatch.setattr(moe, "gemm_dtype", lambda w: torch.float32)  # force the converted path
    monkeypatch.setattr(quant_base, "_local", threading.local())
    buffers = set()
    for inference in (True, False, False):  # first made in inference mode, then reused outside it (training)
        with torch.inference_mode(inference):
            assert (experts(x, weights, ids).float() - want).abs().max() <= 2e-2
        buffers.add(quant_base._local.buffers[torch.float32, x.device].data_ptr())
    assert len(buffers) == 1  # one workspace, shared with the quantized formats' decoding, reused


@torch.no_grad()
def test_padded_fallback_matches_loop(monkeypatch):
    experts = make()
    weights, ids = routing(9, 6, 3, seed=4, only=5)
    x = torch.randn(9, 32)
    monkeypatch.setattr(moe, "_grouped_ok", lambda x, w: False)
    assert (experts(x, weights, ids) - loop_oracle(experts, x, weights, ids)).abs().max() <= 1e-5


def test_gradients_match_loop():
    experts = make()
    weights, ids = routing(7, 6, 3, seed=5)
    x = torch.randn(7, 32, requires_grad=True)
    experts(x, weights, ids).square().sum().backward()
    grads = [x.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    x.grad = experts.gate_up_proj.grad = experts.down_proj.grad = None
    loop_oracle(experts, x, weights, ids).square().sum().backward()
    for a, b in zip(grads, [x.grad, experts.gate_up_proj.grad, experts.down_proj.grad]):
        assert (a - b).abs().max() <= 1e-4


@torch.no_grad()
def test_no_host_read_on_cpu():
    experts = make()
    weights, ids = routing(10, 6, 3)
    with Recorder(roots=("dgemma/", "benchmarks/moe.py")) as rec:
        experts(torch.randn(10, 32), weights, ids)
    assert rec.reads == []
    with Recorder(roots=("dgemma/", "benchmarks/moe.py")) as rec:
        loop_oracle(experts, torch.randn(10, 32), weights, ids)
    assert rec.reads  # the instrument does catch the old code


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # grouped, padded (as on CUDA) paths
@torch.no_grad()
def test_runs_on_meta(dtype):
    """On `meta` any data-dependent host read raises: the forward must not need one."""
    experts = make(dtype=dtype, device="meta")
    ids = torch.randint(0, 6, (10, 3), device="meta")
    out = experts(torch.randn(10, 32, device="meta", dtype=dtype), torch.rand(10, 3, device="meta"), ids)
    assert out.shape == (10, 32) and out.device.type == "meta"
