"""GGUF files of llama.cpp's diffusion-gemma layout: weights bit for bit against `gguf`'s own dequantisation, logits
against the original checkpoint, config / sampler defaults / tokenizer from the metadata, one-line errors."""

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, dequantize
from gguf_writer import write_gguf

import dgemma
from dgemma.errors import CheckpointError
from dgemma.weights import load_model
from dgemma.quant import IntWeight, QuantizedWeight, quantize_tensor
from dgemma.weights.gguf import GGUFFile, gguf_sources
from dgemma.weights.gguf_load import load_gguf

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random checkpoint (3 layers, the last full, 4 experts) with a Gemma-style tokenizer."""
    directory = tmp_path_factory.mktemp("gguf") / "ckpt"
    _script("build_bench_checkpoint").build(directory, hidden=256, layers=3, vocab=512, canvas=16, experts=4)
    return _script("gguf_checkpoint").prepare(directory)


def test_bench_checkpoint_vocabulary_from_the_command_line(tmp_path, capsys):
    """`--vocab` (the body-heavy comparison's small vocabulary) reaches the saved config and the embedding."""
    script = _script("build_bench_checkpoint")
    assert script.main(["--out", str(tmp_path), "--hidden", "64", "--layers", "1", "--experts", "2",
                        "--vocab", "1000"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["path"] == str(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["vocab_size"] == 1000
    assert load_model(tmp_path).embed_tokens.weight.shape == (1000, 64)


def _logits(model, seed=0):
    """Encoder over a prompt, then one decoder step over a canvas: the head's float32 logits."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.cfg.text.vocab_size
    prompt, canvas = torch.randint(0, vocab, (1, 12), generator=g), torch.randint(0, vocab, (1, 16), generator=g)
    with torch.no_grad():
        cache = model.new_cache(1, 64)
        model.encode(prompt, cache)
        return model.head(model.denoise(canvas, cache))


def _reference_weights(path: Path) -> dict[str, np.ndarray]:
    return {t.name: dequantize(t.data, t.tensor_type) for t in GGUFReader(path).tensors}


def _dense(model) -> dict[str, torch.Tensor]:
    """Every weight as a float32 tensor: float parameters / buffers, and quantized weights dequantised."""
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedWeight)}
    out = {n: m.dequantize(slice(None), torch.float32) for n, m in quantized.items()}
    for name, value in model.state_dict().items():
        if not any(name.startswith(q + ".") for q in quantized):
            out[name] = value.float()
    return out


def _check_bitwise(model, path: Path, skip: tuple[str, ...] = ()) -> int:
    """Every dgemma weight equals `gguf`'s dequantisation of its tensor(s); returns how many were compared."""
    ref, names = _reference_weights(path), set(GGUFFile(path).tensors)
    compared = 0
    for param, value in _dense(model).items():
        srcs = gguf_sources(param, names)
        if any(s in skip for s in srcs):
            continue
        want = np.concatenate([ref[s] for s in srcs], axis=1) if len(srcs) > 1 else ref[srcs[0]]
        assert torch.equal(value, torch.from_numpy(np.array(want)).reshape(value.shape)), param
        compared += 1
    return compared


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16])
def test_float_types_load_exactly(checkpoint, tmp_path, qtype):
    path = write_gguf(checkpoint, tmp_path / "m.gguf", qtype)
    model, _ = load_gguf(path)
    assert _check_bitwise(model, path) > 50
    original = load_model(checkpoint)
    if qtype == Q.F32:  # lossless: the very same model
        for name, value in original.state_dict().items():
            assert torch.equal(model.state_dict()[name], value), name
        assert torch.equal(_logits(model), _logits(original))


@pytest.mark.parametrize("qtype,levels", [(Q.Q8_0, 127), (Q.Q4_0, 8)])
def test_q8_0_q4_0_weights_exact_logits_within_quantisation_error(checkpoint, tmp_path, qtype, levels):
    """Weights: bit for bit `gguf`'s dequantisation. Logits against the float checkpoint: the bound is what the
    format's rounding does to this (chaotic, random) model: the mean |logit difference| is at most 2x the median
    over 3 draws of the same model with every quantized weight moved by uniform noise of half a step (step = the
    group-of-32's largest magnitude / 127 for Q8_0, / 8 for Q4_0). (A small random model is chaotic: this ~1e-3
    relative weight noise moves its logits by ~1, a tenth of what unrelated weights do.)"""
    path = write_gguf(checkpoint, tmp_path / "m.gguf", qtype)
    model, _ = load_gguf(path)
    assert _check_bitwise(model, path) > 50
    q = model.layers[0].experts.gate_up_proj
    assert isinstance(q, IntWeight) and q.bits == {Q.Q8_0: 8, Q.Q4_0: 4}[qtype] and q.group_size == 32
    assert isinstance(model.embed_tokens.weight, IntWeight)  # the tied embedding / head stays compact too
    want = _logits(load_model(checkpoint))
    error = (_logits(model) - want).abs().mean()
    def rounding(w, g):
        return (torch.rand(w.shape, generator=g) - 0.5) * _step(w, levels)

    noise = [(_logits(_perturbed(checkpoint, rounding, seed)) - want).abs().mean() for seed in range(3)]
    assert error <= 2 * sorted(noise)[1], (error, noise)


def _step(w: torch.Tensor, levels: int) -> torch.Tensor:
    groups = w.reshape(*w.shape[:-1], -1, 32)
    return (groups.abs().amax(-1, keepdim=True) / levels).expand_as(groups).reshape(w.shape)


def _perturbed(checkpoint, delta, seed):
    """The checkpoint's model with `delta(w, generator)` added to every matrix the GGUF writer quantizes."""
    model, g = load_model(checkpoint), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.endswith("router.proj.weight"):
                p.add_(delta(p, g))
    return model


def test_k_quants_requantised_from_the_exact_values(checkpoint, tmp_path):
    """Q4_K / Q5_K / Q6_K tensors (the Q4_K_M mix): the reader's float values are `gguf`'s dequantisation bit for
    bit, and the IntWeight each becomes (Q4_K int4, Q5_K / Q6_K int8, group 32) is exactly dgemma's quantisation
    of those values; untouched Q8_0 tensors stay exact; the model computes with these weights."""
    kinds = {"blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q5_K, "blk.0.attn_v.weight": Q.Q6_K,
             "blk.1.ffn_gate.weight": Q.Q4_K, "blk.1.ffn_up.weight": Q.Q6_K, "blk.2.ffn_gate_up_exps.weight": Q.Q4_K,
             "token_embd.weight": Q.Q6_K, "self_cond_gate.weight": Q.Q5_K}
    path = write_gguf(checkpoint, tmp_path / "m.gguf", Q.Q8_0, types=kinds)
    assert {t.name: t.tensor_type for t in GGUFReader(path).tensors if t.name in kinds} == kinds
    model, f = load_gguf(path)
    assert _check_bitwise(model, path, skip=tuple(kinds)) > 40
    ref = _reference_weights(path)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedWeight)}
    for name, kind in kinds.items():
        assert torch.equal(f.read(name, torch.float32, torch.device("cpu")), torch.from_numpy(np.array(ref[name])))
        param = next(p for p in quantized if gguf_sources(p, set(f.tensors)) == [name])
        bits = 4 if kind == Q.Q4_K else 8
        want = quantize_tensor(torch.from_numpy(np.array(ref[name])), bits, 32)
        got = quantized[param]
        assert got.bits == bits and torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales)
    same = load_model(checkpoint)
    same.load_state_dict(_dense(model))
    torch.testing.assert_close(_logits(model), _logits(same), rtol=1e-4, atol=1e-3)


def test_quantize_option_on_gguf(checkpoint, tmp_path):
    """--quantize on a GGUF file: Q4_0 into int8 is exact, Q8_0 into int4 is re-quantised from the exact values."""
    q4 = write_gguf(checkpoint, tmp_path / "q4.gguf", Q.Q4_0)
    model = dgemma.load(q4, quantize="int8", dtype="float32").module  # the float32 GGUF's values, exactly
    assert model.layers[0].self_attn.q_proj.weight.bits == 8
    assert _check_bitwise(model, q4) > 50
    q8 = write_gguf(checkpoint, tmp_path / "q8.gguf", Q.Q8_0)
    model = dgemma.load(q8, quantize="int4", dtype="float32").module
    w = model.layers[1].mlp.down_proj.weight
    w = w.to_int() if hasattr(w, "to_int") else w  # CPUs keep int4 in torch's kernel layout: back to IntWeight
    want = quantize_tensor(torch.from_numpy(np.array(_reference_weights(q8)["blk.1.ffn_down.weight"])), 4, 32)
    assert w.bits == 4 and torch.equal(w.qweight, want.qweight)


def test_split_expert_stacks(checkpoint, tmp_path):
    path = write_gguf(checkpoint, tmp_path / "m.gguf", Q.F32)
    split = tmp_path / "split.gguf"
    _rewrite(path, split, _split_experts)
    model, _ = load_gguf(split)
    assert torch.equal(model.layers[1].experts.gate_up_proj, load_model(checkpoint).layers[1].experts.gate_up_proj)
    q8 = _rewrite(write_gguf(checkpoint, tmp_path / "q8.gguf", Q.Q8_0), tmp_path / "q8split.gguf", _split_experts)
    model, _ = load_gguf(q8)
    assert isinstance(model.layers[1].experts.gate_up_proj, IntWeight) and _check_bitwise(model, q8) > 50


def _split_experts(name, data, qtype):
    if name.endswith("ffn_gate_up_exps.weight"):
        gate, up = np.split(data, 2, axis=1)
        return [(name.replace("gate_up", "gate"), gate, qtype), (name.replace("gate_up", "up"), up, qtype)]
    return [(name, data, qtype)]


def _rewrite(src: Path, dst: Path, tensor_fn=None, arch=None, drop_key=None):
    """Copy a GGUF file, changing tensors (tensor_fn -> list of (name, raw data, type)), arch or dropping a key."""
    from gguf import GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(dst, arch or r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop_key):
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(key, value, kind, sub_type=sub)
    for t in r.tensors:
        for name, data, qtype in (tensor_fn or (lambda *a: [a]))(t.name, np.array(t.data), t.tensor_type):
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_config_sampler_defaults_and_tokenizer(checkpoint, tmp_path):
    path = write_gguf(checkpoint, tmp_path / "m.gguf", Q.Q8_0)
    model = dgemma.load(path)  # detected from the file: no flag
    original = dgemma.load(checkpoint)
    want = original.module.cfg
    assert model.module.cfg == replace(want, text=replace(want.text, eos_token_id=model.module.cfg.text.eos_token_id))
    gen = json.loads((checkpoint / "generation_config.json").read_text())
    d = model.defaults
    assert (d.max_denoising_steps, d.t_min, d.t_max, d.entropy_bound, d.stability_threshold,
            d.confidence_threshold) == (gen["max_denoising_steps"], gen["t_min"], gen["t_max"],
                                        gen["sampler_config"]["entropy_bound"], gen["stability_threshold"],
                                        gen["confidence_threshold"])
    end = model.tokenizer.token_id("<end_of_turn>")
    assert set(d.eos_token_ids) == {1, end}
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    texts = ["Hello world! the quick brown fox", "x\n\ny  z\n", "café 日本 🙂 <start_of_turn>user\nhi<end_of_turn>",
             "  leading spaces", "unseen wörds ∑ and <mask> tokens"]
    for text in texts:
        ids = model.tokenizer.encode(text, add_bos=False)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert model.tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "hi"}]
    assert model.tokenizer.apply_chat_template(messages) == original.tokenizer.apply_chat_template(messages)
    assert model.tokenizer.encode("hi")[0] == 2  # bos added
    result = model.generate("Hello", max_new_tokens=16, max_denoising_steps=2, seed=0)
    assert result.token_ids and result.finish_reason in ("length", "stop")


@pytest.mark.parametrize("case,message", [
    ("type", "tensor blk.0.attn_q.weight has type Q4_1; dgemma reads F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K"),
    ("arch", "GGUF architecture 'llama' is not 'diffusion-gemma'"),
    ("missing", "missing tensor blk.1.ffn_up.weight"),
    ("key", "missing GGUF key diffusion.canvas_length"),
    ("truncated", "runs past the end of the file (truncated?)"),
])
def test_bad_files_one_line(checkpoint, tmp_path, case, message):
    path = write_gguf(checkpoint, tmp_path / "m.gguf", Q.F32, types={"blk.0.attn_q.weight": Q.Q4_1}
                      if case == "type" else None)
    if case == "arch":
        path = _rewrite(path, tmp_path / "bad.gguf", arch="llama")
    elif case == "missing":
        path = _rewrite(path, tmp_path / "bad.gguf", lambda n, d, q: [] if n == "blk.1.ffn_up.weight" else [(n, d, q)])
    elif case == "key":
        path = _rewrite(path, tmp_path / "bad.gguf", drop_key="diffusion.canvas_length")
    elif case == "truncated":
        path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError) as info:
        load_gguf(path)
    assert message in str(info.value) and "\n" not in str(info.value)
    if case == "arch":  # the CLI prints the one line, no traceback
        proc = subprocess.run([sys.executable, "-m", "dgemma", "generate", "--model", str(path), "hi"],
                              capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("error:") and message in proc.stderr


# ---- a file written by llama.cpp's own converter ---------------------------------------------------------------
CONVERTED = Path(__file__).parent / "fixtures" / "llama_cpp"


def _hf_state_from_gguf(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors under their Hugging Face names: the converter's name map inverted, values as stored
    (dequantised by `gguf`), nothing else done to them; `rope_freqs` (derived from the config) left out."""
    from gguf_writer import GLOBAL_MAP, LAYER_MAP

    by_gguf = {v: k for k, v in LAYER_MAP.items()}
    out = {}
    for t in GGUFReader(path).tensors:
        value = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        block, _, rest = t.name.partition(".")[2].partition(".") if t.name.startswith("blk.") else ("", "", t.name)
        if t.name == "rope_freqs.weight":
            continue
        if rest == "enc_layer_output_scale.weight":
            out[f"model.encoder.language_model.layers.{block}.layer_scalar"] = value
        elif block:
            out[f"model.decoder.layers.{block}.{by_gguf[rest]}"] = value
        else:
            out["model.decoder." + {v: k for k, v in GLOBAL_MAP.items()}[t.name]] = value
    return out


@torch.no_grad()
def test_a_file_written_by_llama_cpps_converter():
    """tests/fixtures/llama_cpp (README there): dgemma loads what llama.cpp's convert_hf_to_gguf.py writes (its
    key set, its scalar or per-layer head counts, its Gemma 4 vocabulary), and its logits equal transformers' on
    the same tensors read back under their Hugging Face names."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from reference import reference_logits

    path = CONVERTED / "diffusion-gemma-f16.gguf"
    ref = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig.from_json_file(CONVERTED / "config.json")).float()
    state = _hf_state_from_gguf(path)
    missing, unexpected = ref.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.replace("encoder.language_model.", "decoder.") in state}  # the shared backbone
    assert not unexpected and all("vision" in k or k == "lm_head.weight" for k in set(missing) - tied)
    ref.tie_weights()
    assert all(torch.equal(ref.get_parameter(k), state[k.replace("encoder.language_model.", "decoder.")])
               for k in tied)
    model = dgemma.load(path, dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompt, canvas = torch.randint(0, 384, (1, 12), generator=g), torch.randint(0, 384, (1, 8), generator=g)
    want = reference_logits(ref.eval(), prompt, [canvas])[1]
    cache = model.module.new_cache(1, 64)
    model.module.encode(prompt, cache)
    got = model.module.head(model.module.denoise(canvas, cache))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    tok = model.tokenizer
    assert tok.decode(tok.encode("Hello é world!", add_bos=False)) == "Hello é world!"
    assert model.defaults.max_denoising_steps == 12 and model.module.cfg.canvas_length == 8


def test_serve_accepts_a_gguf_file_before_binding(tmp_path):
    """`dgemma serve --model x.gguf` checks its model before it binds: a GGUF file is one (it was refused as
    "neither a checkpoint directory nor a GGUF file"), and --revision with it is a one-line error."""
    from dgemma.errors import DgemmaError
    from dgemma.server.command import _check_model

    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    _check_model(str(path))
    with pytest.raises(DgemmaError, match="--revision applies to a Hugging Face repo id"):
        _check_model(str(path), "main")
