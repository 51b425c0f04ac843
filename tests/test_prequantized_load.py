"""Loading pre-quantized checkpoints without waste: compressed-tensors int4 repacked by byte operations (against the
library's own packing), each shard's header parsed once, unfused experts re-stacked in place, with one-line errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import dgemma
from dgemma.errors import CheckpointError
from dgemma.quant import IntWeight, NVFP4Weight, parse_quantize, unpack_int4
from dgemma.weights import compressed, hf
from dgemma.weights.prequantized import _pack_quantized, read_linear

helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")



@pytest.mark.parametrize("k,group", [(64, 32), (256, 128), (40, 8), (36, 4), (36, 6)])
def test_int4_repack_keeps_the_library_codes(k, group):
    """Codes packed by compressed-tensors' pack_to_int32 come out of IntWeight as the same codes (the byte path for
    groups divisible by 4, padded rows included, and the general path for other even groups)."""
    gen = torch.Generator().manual_seed(k * 1000 + group)
    codes = torch.randint(-8, 8, (5, k), dtype=torch.int8, generator=gen)
    scale = (torch.rand(5, k // group, generator=gen) + 0.5).to(torch.float16)
    packed = helpers.pack_to_int32(codes, 4)
    w = _pack_quantized("p", packed, scale, torch.tensor([5, k]), torch.float32)
    assert torch.equal(unpack_int4(w.qweight, group), codes)
    dense = codes.float().unflatten(-1, (-1, group)) * scale.float()[..., None]
    assert torch.equal(w.dequantize(), dense.flatten(-2))


@pytest.fixture(scope="module")
def int4_model(float_ckpt):
    """A tiny random float checkpoint and its int4 quantize-on-load model."""
    return float_ckpt, dgemma.load(float_ckpt, quantize=parse_quantize("int4")).module


def _buffers(module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in module.state_dict().items()}


def test_each_shard_header_is_parsed_once(int4_model, tmp_path, monkeypatch):
    src, model = int4_model
    monkeypatch.setattr(compressed, "SHARD_BYTES", 1 << 15)
    out = compressed.save_compressed(model, src, tmp_path / "ct")
    shards = {p.name for p in out.glob("*.safetensors")}
    assert len(shards) > 3
    opened = []

    class Counting(hf.DirectReader):
        def __init__(self, path):
            opened.append(path.name)
            super().__init__(path)

    monkeypatch.setattr(hf, "DirectReader", Counting)
    reloaded = dgemma.load(out).module
    assert sorted(opened) == sorted(shards)
    ours, theirs = _buffers(reloaded), _buffers(model)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)


@pytest.mark.parametrize("case,message", [
    ("rows", r"^model\.decoder\.layers\.1\.experts\.gate_up_proj: cannot re-stack its experts \(expert 2's "),
    ("float", r"^model\.decoder\.layers\.1\.experts\.gate_up_proj: its unfused experts mix quantized and float"),
])
def test_experts_that_do_not_stack_are_one_line_errors(int4_model, tmp_path, case, message):
    src, model = int4_model
    out = compressed.save_compressed(model, src, tmp_path / "ct")
    (shard,) = out.glob("*.safetensors")
    tensors = load_file(str(shard))
    p = "model.decoder.layers.1.experts.2.up_proj"
    if case == "rows":  # expert 2's up projection one row short, consistently in every part
        tensors[f"{p}.weight_packed"] = tensors[f"{p}.weight_packed"][:-1].contiguous()
        tensors[f"{p}.weight_scale"] = tensors[f"{p}.weight_scale"][:-1].contiguous()
        tensors[f"{p}.weight_shape"] = tensors[f"{p}.weight_shape"] - torch.tensor([1, 0])
    else:
        shape = tensors.pop(f"{p}.weight_shape").tolist()
        del tensors[f"{p}.weight_packed"], tensors[f"{p}.weight_scale"]
        tensors[f"{p}.weight"] = torch.zeros(shape, dtype=torch.bfloat16)
    save_file(tensors, str(shard))
    index = out / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: shard.name for n in tensors}}))
    with pytest.raises(CheckpointError, match=message):
        dgemma.load(out)


@pytest.mark.parametrize("fmt,cls,rms", [("int4", IntWeight, 4.64), ("int8", IntWeight, 4.64),
                                         ("nvfp4", NVFP4Weight, 1.0)])
def test_real_shape_writer_pieces_load(fmt, cls, rms):
    """The real-shape benchmark's writer (too large for a test file) writes pieces the loader reads as `fmt`, at the
    spread its docstring states (root mean square rms / (4 sqrt(fan_in)))."""
    import real_shape

    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32, generator=gen)
    prefix = "model.decoder.layers.0.mlp.up_proj"
    parts = real_shape.tensors_for(prefix, (64, 256), True, fmt, 32, gen, pool)
    w = read_linear(prefix, parts.__getitem__, parts.__contains__, torch.float32)
    assert isinstance(w, cls) and tuple(w.shape) == (64, 256)
    got = w.dequantize().square().mean().sqrt().item() * 4 * 256**0.5
    assert abs(got / rms - 1) < 0.1
