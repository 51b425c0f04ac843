"""The kernel-layout cache (dgemma/weights/kernel_cache.py): a second load memory-maps the int4 (or int8, two int4
halves) weights the first one repacked, with bit-equal products; a changed checkpoint, a corrupt or truncated file
and a read-only directory fall back to repacking."""

import logging

import pytest
import torch

from dgemma.api.checkpoint import open_checkpoint
from dgemma.quant import int4cpu, parse_quantize
from dgemma.quant.int4cpu import CPUInt4Weight
from dgemma.weights import compressed, kernel_cache
from dgemma.weights.hf import load_model

pytestmark = pytest.mark.skipif(int4cpu.layout() is None, reason="no torch CPU int4 kernel")


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized_ckpt(float_ckpt, tmp_path_factory, request):
    """A tiny compressed-tensors int4 / int8 checkpoint (the layout `dgemma quantize` writes)."""
    model = load_model(float_ckpt, torch.bfloat16, "cpu", parse_quantize(request.param))
    return compressed.save_compressed(model, float_ckpt, tmp_path_factory.mktemp("ct") / request.param)


@pytest.fixture
def ckpt(quantized_ckpt, tmp_path, monkeypatch):
    """A private copy of the quantized checkpoint, with the cache on whatever the model's size."""
    import shutil

    monkeypatch.setattr(kernel_cache, "MIN_BYTES", 0)
    monkeypatch.delenv(kernel_cache.ENV, raising=False)
    return shutil.copytree(quantized_ckpt, tmp_path / "ckpt")


class Repacks:
    """Counts the weights converted to torch's layout during a load (zero: everything came from the cache)."""

    def __init__(self, monkeypatch):
        self.n = 0
        original = int4cpu.converted

        def counted(w):
            self.n += 1
            return original(w)

        monkeypatch.setattr(int4cpu, "converted", counted)

    def load(self, path):
        self.n = 0
        return open_checkpoint(path, "auto", "cpu", False, None)[0]


def _weights(module) -> dict[str, CPUInt4Weight]:
    return {n: m for n, m in module.named_modules() if isinstance(m, CPUInt4Weight)}


def _cache_files(path):
    return sorted((path / kernel_cache.DIRNAME).glob("*.safetensors"))


def test_second_load_maps_the_cache_and_multiplies_bit_equal(ckpt, monkeypatch):
    repacks = Repacks(monkeypatch)
    first = repacks.load(ckpt)
    converted = repacks.n
    assert converted > 0 and len(_cache_files(ckpt)) == 1
    second = repacks.load(ckpt)
    assert repacks.n == 0  # nothing repacked: every int4 weight came from the cache
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys() and len(a) == converted
    gen = torch.Generator().manual_seed(0)
    for name, w in a.items():
        c = b[name]
        assert type(c) is type(w) and c.format == w.format
        assert torch.equal(w.packed, c.packed) and torch.equal(w.scales, c.scales)
        assert len(w.shape) == 2 or c.scales.transpose(-1, -2).is_contiguous()  # stacks keep them transposed
        dense = c.dequantize().float()
        assert torch.equal(dense, w.dequantize().float())
        for m in (1, 7, 16):
            x = torch.randn(m, w.shape[-1], generator=gen).bfloat16()
            if len(w.shape) == 2:
                got, ref = c.kernel_mm(x), w.kernel_mm(x)
                exact = x.float() @ dense.T
            else:  # the rows spread over the experts, some with none
                ends = torch.linspace(0, m, w.shape[0] + 1)[1:].long()
                got, ref = c.expert_matmul(x, ends), w.expert_matmul(x, ends)
                bounds = [0, *ends.tolist()]
                exact = torch.cat([x[bounds[e]:bounds[e + 1]].float() @ dense[e].T for e in range(w.shape[0])])
            assert torch.equal(got, ref), (name, m)
            assert (got.float() - exact).norm() <= 0.02 * exact.norm() + 1e-6, (name, m)  # bf16 in and out


def test_a_changed_checkpoint_invalidates_the_cache(ckpt, monkeypatch):
    import os

    repacks = Repacks(monkeypatch)
    repacks.load(ckpt)
    before = _cache_files(ckpt)[0].stat().st_mtime_ns
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # the file was rewritten
    repacks.load(ckpt)
    assert repacks.n > 0
    assert _cache_files(ckpt)[0].stat().st_mtime_ns != before  # written again for the new file
    repacks.load(ckpt)
    assert repacks.n == 0


def test_another_torch_or_cpu_gets_its_own_file(ckpt, monkeypatch):
    repacks = Repacks(monkeypatch)
    repacks.load(ckpt)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SOMETHING_ELSE")
    repacks.load(ckpt)
    assert repacks.n > 0 and len(_cache_files(ckpt)) == 2


@pytest.mark.parametrize("damage", ["truncate", "header", "data", "key"])
def test_a_corrupt_cache_is_ignored_and_rewritten(ckpt, monkeypatch, caplog, damage):
    repacks = Repacks(monkeypatch)
    reference = _weights(repacks.load(ckpt))
    path = _cache_files(ckpt)[0]
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    if damage == "truncate":
        raw = raw[:-100]
    elif damage == "header":
        raw[8:20] = b"not json at "
    elif damage == "data":
        raw[8 + n] ^= 0xFF  # the first byte of the first tensor
    else:
        raw[8:8 + n] = raw[8:8 + n].replace(b'quantize', b'quantizE')  # the key (same length)
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger=kernel_cache.__name__):
        loaded = _weights(repacks.load(ckpt))
    assert repacks.n == len(reference)
    assert "ignoring the kernel cache" in caplog.text
    assert all(torch.equal(loaded[k].packed, w.packed) for k, w in reference.items())
    repacks.load(ckpt)
    assert repacks.n == 0  # rewritten whole by the load that ignored it


def test_read_only_directory_uses_the_user_cache(ckpt, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(kernel_cache.os, "access", lambda path, mode: False)  # root may write anywhere
    repacks = Repacks(monkeypatch)
    repacks.load(ckpt)
    assert not (ckpt / kernel_cache.DIRNAME).exists()
    assert len(list((tmp_path / "xdg" / "dgemma" / "kernels").rglob("int4cpu-*.safetensors"))) == 1
    repacks.load(ckpt)
    assert repacks.n == 0


def test_off_and_small_models_write_nothing(ckpt, monkeypatch):
    repacks = Repacks(monkeypatch)
    monkeypatch.setenv(kernel_cache.ENV, "off")
    repacks.load(ckpt)
    assert not (ckpt / kernel_cache.DIRNAME).exists()
    monkeypatch.delenv(kernel_cache.ENV)
    monkeypatch.setattr(kernel_cache, "MIN_BYTES", 256 << 20)  # the default: a tiny model repacks in milliseconds
    repacks.load(ckpt)
    assert not (ckpt / kernel_cache.DIRNAME).exists()


def test_quantize_on_load_is_cached_per_scheme(float_ckpt, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(kernel_cache, "MIN_BYTES", 0)
    src = shutil.copytree(float_ckpt, tmp_path / "float")
    repacks = Repacks(monkeypatch)
    first = open_checkpoint(src, "auto", "cpu", False, "int4")[0]
    second = open_checkpoint(src, "auto", "cpu", False, "int4")[0]
    assert repacks.n == len(_weights(first)) > 0  # the first load only
    assert all(torch.equal(w.packed, _weights(second)[k].packed) for k, w in _weights(first).items())
    plain = open_checkpoint(src, "auto", "cpu", False, None)[0]  # float: nothing int4, nothing cached for it
    assert not _weights(plain) and len(_cache_files(src)) == 1


def test_one_writer_at_a_time(ckpt, monkeypatch, caplog):
    """While another process holds the lock (replicas started together), a load repacks and writes nothing."""
    import fcntl

    from dgemma.api.checkpoint import _resolve_dtype

    cache = kernel_cache.open_cache(ckpt, _resolve_dtype("auto", ckpt, torch.device("cpu")), None)
    cache.path.parent.mkdir(parents=True)
    with open(cache.path.with_name(f".{cache.path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with caplog.at_level(logging.WARNING, logger=kernel_cache.__name__):
            Repacks(monkeypatch).load(ckpt)
    assert not _cache_files(ckpt) and "not writing the kernel cache" in caplog.text


def test_hub_snapshots_keep_their_folder_clean(tmp_path, monkeypatch):
    """A checkpoint inside the Hugging Face cache gets its kernel cache in dgemma's own cache folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(kernel_cache.ENV, raising=False)
    snap = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    assert kernel_cache._location(snap).is_relative_to(tmp_path / "xdg" / "dgemma" / "kernels")
    assert kernel_cache._location(tmp_path) == tmp_path / kernel_cache.DIRNAME


@pytest.mark.parametrize("quant, form", [("Q4_0", "int4"), ("Q8_0", "int8")])
def test_gguf_files_are_cached_beside_them(tmp_path, monkeypatch, quant, form):
    """A Q4_0 / Q8_0 GGUF file (llama.cpp's formats; int4 / int8 weights bit for bit): the second load repacks nothing
    and its weights are the same; touching the file invalidates the cache."""
    import importlib.util
    import os
    from pathlib import Path

    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as Q
    from gguf_writer import write_gguf

    def script(name):
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    monkeypatch.setattr(kernel_cache, "MIN_BYTES", 0)
    monkeypatch.delenv(kernel_cache.ENV, raising=False)
    src = tmp_path / "ckpt"
    script("build_bench_checkpoint").build(src, hidden=64, layers=2, vocab=512, canvas=16, experts=4)
    path = write_gguf(script("gguf_checkpoint").prepare(src), tmp_path / "m.gguf", getattr(Q, quant))
    repacks = Repacks(monkeypatch)
    first = _weights(repacks.load(path))
    assert repacks.n == len(first) > 0
    assert len(list((tmp_path / kernel_cache.DIRNAME).glob("m.gguf.int4cpu-*.safetensors"))) == 1
    second = _weights(repacks.load(path))
    assert repacks.n == 0
    assert all(torch.equal(w.packed, second[k].packed) and torch.equal(w.scales, second[k].scales)
               for k, w in first.items())
    assert form in {w.format for w in first.values()}
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    repacks.load(path)
    assert repacks.n == len(first)
