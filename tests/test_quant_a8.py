"""int8 activations (`--quantize ...+a8`, dgemma/quant/a8.py): activation codes, the oneDNN integer GEMM against
float arithmetic on the same codes, the fused vocabulary step and loading."""

import pytest
import torch

import dgemma
from dgemma.errors import ConfigError, DgemmaError
from dgemma.quant import a8, parse_quantize, quantize_tensor
from dgemma.sampling.fused import num_uniforms, vocab_step
from test_quant import _kl, _logits

pytestmark = pytest.mark.skipif(not a8.available(torch.device("cpu")), reason="no oneDNN int8 linear in this torch")


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("nonnegative", [False, True])
def test_row_codes_stay_within_half_a_step_and_seven_bits(nonnegative):
    x = _rand(16, 300) * torch.logspace(-3, 2, 16)[:, None]
    x = x.abs() if nonnegative else x
    rows = a8.quantize_rows(x, nonnegative=nonnegative)
    assert rows.codes.dtype == torch.uint8 and int(rows.codes.max()) <= 127  # no vpmaddubsw saturation
    back = (rows.codes.float() - rows.zero) * rows.scale
    assert ((back - x).abs() <= rows.scale * 0.5 * (1 + 1e-5)).all()


def test_packed_gemm_is_the_integer_product_of_the_codes():
    w, x = _rand(40, 64, seed=1), _rand(7, 64, seed=2)
    block, rows = a8.PackedBlock(w), a8.quantize_rows(x)
    codes = (w / block.scales[:, None]).round().clamp(-127, 127)
    assert (codes.abs() <= 127).all() and codes.abs().amax(1).eq(127).all()
    exact = ((rows.codes.double() - rows.zero) @ codes.double().T) * rows.scale.double() * block.scales.double()
    torch.testing.assert_close(block.mm(rows).double(), exact, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_linear_and_transpose_follow_the_weight_only_result(bits):
    q = quantize_tensor(_rand(96, 64, seed=3), bits)
    x, p = _rand(5, 64, seed=4), torch.softmax(_rand(5, 96, seed=5), -1)
    ref, ref_t = q.linear(x), q.linear_t(p)
    q.a8 = a8.Int8Activations(q, 32, transposed=True)
    got, got_t = q.linear(x), q.linear_t(p)
    assert not torch.equal(got, ref)  # the int8 path ran
    assert (got - ref).norm() / ref.norm() < 0.03 and (got_t - ref_t).norm() / ref_t.norm() < 0.03
    with torch.enable_grad():  # autograd (QLoRA) falls back to the weight-only path: it has a backward
        xg = x.clone().requires_grad_()
        assert torch.equal(q.linear(xg), ref)


def test_vocab_step_on_packed_blocks_matches_the_float_step():
    hidden, emb = _rand(48, 64, seed=6), _rand(3000, 64, seed=7) * 0.4
    q = quantize_tensor(emb, 8)
    inv_t = torch.full((48,), 1.25)
    u = torch.rand(48, num_uniforms(3000, 256), generator=torch.Generator().manual_seed(8))
    ref = vocab_step(hidden, q, 30.0, 8.0, inv_t, u, chunk=256)
    q.a8 = a8.Int8Activations(q, 256, transposed=True)
    got = vocab_step(hidden, q, 30.0, 8.0, inv_t, u, chunk=256)
    assert not torch.equal(got.entropy, ref.entropy)
    assert (got.argmax == ref.argmax).float().mean() > 0.9
    assert (got.entropy - ref.entropy).abs().max() < 0.05 * ref.entropy.abs().max()
    assert (got.signal - ref.signal).norm() / ref.signal.norm() < 0.03


def test_load_with_int8_activations():
    base = dgemma.load(None, quantize="int8")
    model = dgemma.load(None, quantize="int8+a8")
    mod = model.module
    emb = mod.embed_tokens.weight  # one more byte per element and direction (+ a float32 scale per channel)
    assert 2 * emb.numel() < emb.a8.nbytes < 2.2 * emb.numel() and emb.nbytes > emb.a8.nbytes
    assert "a8." not in "".join(mod.state_dict())  # never saved
    assert mod.embed_tokens.weight.a8.blocks_t and mod.layers[0].self_attn.q_proj.weight.a8 is not None
    assert not hasattr(mod.layers[0].experts.gate_up_proj, "a8")  # expert stacks stay weight-only
    assert _kl(_logits(base), _logits(model)) < 0.01  # measured ~0.001
    assert len(model.generate("The king", max_new_tokens=8, seed=0, max_denoising_steps=4).token_ids) == 8


def test_int8_activation_requests_that_cannot_run_are_one_line_errors(monkeypatch):
    assert parse_quantize("int4:64+emb8+a8").name == "int4:64+emb8+a8" and parse_quantize("a8").name == "a8"
    with pytest.raises(DgemmaError, match="no quantized 2D weights"):
        dgemma.load(None, quantize="a8")
    with monkeypatch.context() as m:  # a torch without oneDNN's int8 linear (or an accelerator)
        m.setattr(a8, "available", lambda device: False)
        with pytest.raises(DgemmaError, match="need an x86 CPU build"):
            dgemma.load(None, quantize="int8+a8")
    from dgemma.train.config import TrainConfig

    with pytest.raises(ConfigError, match="for inference"):
        TrainConfig(train_data="t.txt", model="m", lora=True, quantize="int4+a8")


def test_quantize_command_refuses_to_store_int8_activations(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "dgemma", "quantize", "--to", "int4+a8", "--out", str(tmp_path / "q")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and run.stderr.count("\n") == 1 and "use --to int4" in run.stderr
    assert not (tmp_path / "q").exists()
