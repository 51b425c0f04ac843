"""Quantized weights (dgemma/quant): codes and scales, the chunked matmuls, grouped experts, quantize on load."""

import json
import subprocess
import sys

import pytest
import torch

import dgemma
from dgemma.errors import CheckpointError, ConfigError, DgemmaError
from dgemma.quant import IntWeight, base, pack_int4, parse_quantize, quantize_tensor, unpack_int4
from test_moe import loop_oracle, make, routing


def _w(n=48, k=64, seed=0, lead=()):
    return torch.randn(*lead, n, k, generator=torch.Generator().manual_seed(seed))


def test_int4_packing_round_trips_every_code():
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 4)  # [3, 64]
    packed = pack_int4(codes, 32)
    assert packed.shape == (3, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, 32), codes)
    # group-local order: byte j of a group holds columns j (low nibble) and j + 16 (high nibble)
    assert packed[0, 0].item() == (codes[0, 0].item() & 15) | ((codes[0, 16].item() & 15) << 4)


@pytest.mark.parametrize("bits", [8, 4])
def test_codes_times_scales_rebuild_the_weight(bits):
    w = _w()
    q = quantize_tensor(w, bits, 32)
    codes = q.qweight.view(torch.int8) if bits == 8 else unpack_int4(q.qweight, 32)
    rebuilt = (codes.view(48, 2, 32).float() * q.scales.float()[..., None]).view(48, 64)
    assert torch.equal(q.dequantize(), rebuilt)
    assert int(codes.min()) >= -(2 ** (bits - 1)) and int(codes.max()) < 2 ** (bits - 1)
    step = q.scales.float().abs().repeat_interleave(32, dim=-1)
    err = (q.dequantize() - w).abs()
    if bits == 8:  # round to nearest: half a step at most (fp16 scale rounding aside)
        assert (err <= step * 0.5 + 1e-6).all()
    else:  # a clipped extreme costs up to the scale reduction; the relative error stays that of 4 bits
        assert (err.norm() / w.norm()) < 0.12
    assert q.nbytes == w.numel() * bits // 8 + w.numel() // 32 * 2


@pytest.mark.parametrize("bits", [8, 4])
def test_chunked_linear_transpose_and_embedding_match_dense(bits, monkeypatch):
    w = _w(n=100, k=64)
    q = quantize_tensor(w, bits, 32)
    dense = q.dequantize()
    x = torch.randn(2, 5, 64)
    xt = torch.randn(7, 100)
    ids = torch.tensor([[3, 99, 0], [50, 50, 7]])
    full = (q.linear(x), q.linear_t(xt), q.embedding(ids))
    monkeypatch.setattr(base, "CPU_CHUNK_ELEMENTS", 64 * 7)  # 7 rows per chunk: 15 chunks, a ragged last one
    assert q.chunk_rows() == 7
    chunked = (q.linear(x), q.linear_t(xt), q.embedding(ids))
    torch.testing.assert_close(full[0], x @ dense.T)
    torch.testing.assert_close(full[1], xt @ dense)
    assert torch.equal(full[2], dense[ids])
    for a, b in zip(full, chunked):
        torch.testing.assert_close(a, b)


def _quantized_experts(bits, e=6):
    experts = make(e=e)
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(experts, name).detach()
        del experts._parameters[name]
        setattr(experts, name, quantize_tensor(w, bits, 16))
    return experts


@pytest.mark.parametrize("chunk", [None, 1, 2])
@pytest.mark.parametrize("bits", [8, 4])
@torch.no_grad()
def test_quantized_experts_match_loop_over_dequantized(bits, chunk, monkeypatch):
    """Grouped quantized experts == the per-expert loop over the dequantized stacks, whole or a few experts at a
    time (experts without rows skipped)."""
    experts = _quantized_experts(bits)
    dense = make()
    with torch.no_grad():
        dense.gate_up_proj.copy_(experts.gate_up_proj.dequantize())
        dense.down_proj.copy_(experts.down_proj.dequantize())
    if chunk:
        monkeypatch.setattr(base, "CPU_CHUNK_ELEMENTS", chunk * 32 * 32)
    x = torch.randn(9, 32)
    weights, ids = routing(9, 6, 3, only=4)  # experts 4 and 5 get no rows
    torch.testing.assert_close(experts(x, weights, ids), loop_oracle(dense, x, weights, ids))


def test_quantized_experts_backward_reaches_the_input(monkeypatch):
    """Under autograd the decoded weights are fresh tensors (the workspace is overwritten by later layers)."""
    monkeypatch.setattr(base, "CPU_CHUNK_ELEMENTS", 32 * 32)
    experts = _quantized_experts(4)
    x = torch.randn(5, 32, requires_grad=True)
    weights, ids = routing(5, 6, 3)
    experts(x, weights, ids).sum().backward()
    xd = x.detach().clone().requires_grad_()
    dense = make()
    with torch.no_grad():
        dense.gate_up_proj.copy_(experts.gate_up_proj.dequantize())
        dense.down_proj.copy_(experts.down_proj.dequantize())
    dense(xd, weights, ids).sum().backward()
    torch.testing.assert_close(x.grad, xd.grad)


def _logits(model, canvas_seed=1):
    mod = model.module
    cache = mod.new_cache(1, 64)
    ids = torch.tensor([[2, 651, 1024, 300, 17, 9]])
    enc = mod.head(mod.encode(ids, cache))
    canvas = torch.randint(0, mod.cfg.text.vocab_size, (1, mod.cfg.canvas_length),
                           generator=torch.Generator().manual_seed(canvas_seed))
    return torch.cat([enc, mod.head(mod.denoise(canvas, cache))], dim=1).float()


def _kl(a, b):
    return torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                      reduction="none").sum(-1).mean().item()


@pytest.fixture(scope="module")
def bundled():
    return dgemma.load(None)


@pytest.mark.parametrize("scheme,bound", [("int8", 0.005), ("int4+emb8", 0.3)])
def test_load_quantized_bundled_model(bundled, scheme, bound):
    """Every projection, expert stack and the embedding are quantized; routers and norms stay float; the
    logits' KL to the float model stays within the scheme's error (measured 0.0008 / 0.1)."""
    model = dgemma.load(None, quantize=scheme)
    mod = model.module
    block = mod.layers[0]
    for w in (block.self_attn.q_proj.weight, block.mlp.down_proj.weight, block.experts.gate_up_proj,
              mod.self_conditioning.up_proj.weight, mod.embed_tokens.weight):
        assert isinstance(w, base.QuantizedWeight) and w.format.startswith("int")  # int4 stacks: quant/int4cpu.py
    assert mod.embed_tokens.weight.bits == 8 and block.experts.down_proj.bits == int(scheme[3])
    assert isinstance(block.router.proj.weight, torch.nn.Parameter)
    float_names = [n for n, p in mod.named_parameters() if p.dim() >= 2 and not n.startswith("vision.")]
    assert float_names == [n for n in float_names if n.endswith("router.proj.weight")]
    assert mod.vision.tower.patch_embedder.input_proj.weight.dtype == torch.bfloat16  # the tower stays as stored
    assert _kl(_logits(bundled), _logits(model)) < bound
    assert model.describe()["quantization"].startswith("int")
    assert model.describe()["parameters"] == bundled.describe()["parameters"]
    result = model.generate("The king", max_new_tokens=8, seed=0, max_denoising_steps=4)
    assert len(result.token_ids) == 8


def test_quantize_spec_grammar():
    assert parse_quantize("int4") == parse_quantize("INT4:32")
    spec = parse_quantize("int8:128+embfp")
    assert (spec.bits, spec.group_size, spec.embedding_bits, spec.name) == (8, 128, None, "int8:128+embfp")
    assert parse_quantize("int4+emb8").embedding_bits == 8
    nv = parse_quantize("nvfp4")
    assert (nv.nvfp4, nv.group_size, nv.embedding_bits, nv.name) == (True, 16, None, "nvfp4")
    for bad in ("int3", "int4:7", "fp8", "int4+emb2", ""):
        with pytest.raises(ConfigError, match="expected int8, int4 or nvfp4"):
            parse_quantize(bad)


def test_bad_quantize_requests_are_one_line_errors():
    with pytest.raises(DgemmaError, match="runs on cpu or cuda, not on device meta"):
        dgemma.load(None, quantize="int8", device="meta")
    with pytest.raises(CheckpointError, match=r"^model\.decoder\.embed_tokens\.weight: 256 columns are not a multiple of the group size 96"):
        dgemma.load(None, quantize="int8:96")
    with pytest.raises(CheckpointError, match="w.b: scales of shape"):
        IntWeight(torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4, 3), 8, torch.float32, name="w.b")
    with pytest.raises(CheckpointError, match="w.c: int4 codes must be torch.uint8"):
        IntWeight(torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4, 1), 4, torch.float32, name="w.c")


def test_cli_quantize_flag_and_error():
    run = [sys.executable, "-m", "dgemma", "info", "--json", "--quantize"]
    ok = subprocess.run(run + ["int8"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    tensors = 4 * 4 + 2 * 3 + 6 * 3 + 6 * 2 + 3 + 1  # q/k/v/o (full layers: no v), MLPs, experts, self-cond, embed
    assert json.loads(ok.stdout)["quantization"] == f"int8 g32: {tensors} tensors"
    bad = subprocess.run(run + ["int5"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "int5" in bad.stderr


def test_quantized_model_is_not_saved_as_float(tmp_path):
    from dgemma.weights import save_model

    with pytest.raises(CheckpointError, match="holds quantized weights"):
        save_model(dgemma.load(None, quantize="int8").module, tmp_path / "x")
    assert not (tmp_path / "x").exists()
