"""Checkpoint loading: layouts (single file, shards, HF cache, alias) and every error case."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dgemma.errors import CheckpointError, ConfigError
from dgemma.weights import load_model, resolve_checkpoint, save_model
from reference import build_reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    build_reference("c", d)
    return d


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _logits(model):
    ids = torch.arange(6)[None] % model.cfg.text.vocab_size
    with torch.no_grad():
        return model.head(model.encode(ids, model.new_cache(1, 8)))


def test_sharded_equals_single_file(ckpt, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(ckpt)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert _same_weights(load_model(tmp_path), load_model(ckpt))


def test_hf_cache_snapshot_and_repo_id(ckpt, tmp_path, monkeypatch):
    snap = _copy(ckpt, tmp_path / "hub" / "models--acme--tiny-dgemma" / "snapshots" / "abc123")
    (tmp_path / "hub" / "models--acme--tiny-dgemma" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-dgemma" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    attempts = _no_network(monkeypatch)
    assert resolve_checkpoint("acme/tiny-dgemma") == snap
    assert _same_weights(load_model("acme/tiny-dgemma"), load_model(snap))
    assert attempts == []  # a cached repo never reaches for the network, even with the hub's offline switch off
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache, and .* cannot be reached"):
        resolve_checkpoint("acme/absent-model")  # downloads (tests/test_hub_download.py): here the network is off
    assert attempts


def _no_network(monkeypatch) -> list:
    """Offline mode off, and every name lookup or connection recorded and refused (a fetch would show here)."""
    import socket

    import huggingface_hub.constants as c

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("network access in a test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def test_model_type_alias_and_dtype(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "alias")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "diffusion_gemma4"
    (d / "config.json").write_text(json.dumps(cfg))
    model = load_model(d, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(p.is_meta for p in model.parameters())


def test_save_round_trip_through_reference(ckpt, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    ours = load_model(ckpt)
    save_model(ours, tmp_path)
    assert _same_weights(load_model(tmp_path), ours)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path).eval()
    from reference import reference_logits

    ids = torch.arange(6)[None] % ours.cfg.text.vocab_size
    assert (reference_logits(ref, ids, [])[0] - _logits(ours)).abs().max() < 1e-4


def _edit_tensors(d: Path, fn) -> None:
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, d / "model.safetensors")


@pytest.mark.parametrize("case, error, message", [
    ("no_dir", CheckpointError, "checkpoint directory not found"),
    ("a_file", CheckpointError, "nor a GGUF file"),
    ("no_config", CheckpointError, "missing config.json"),
    ("bad_json", CheckpointError, "invalid JSON"),
    ("no_weights", CheckpointError, "missing model.safetensors"),
    ("model_type", ConfigError, "unsupported model_type 'llama'"),
    ("missing", CheckpointError, "missing tensor model.decoder.norm.weight"),
    ("unexpected", CheckpointError, "unexpected tensor model.decoder.extra.weight"),
    ("shape", CheckpointError, r"model.decoder.norm.weight has shape \[7\], expected \[32\]"),
    ("truncated", CheckpointError, "corrupt or truncated"),
    ("corrupt", CheckpointError, "corrupt or truncated"),
    ("range", ConfigError, "hidden_size=-4"),
    ("top_k", ConfigError, "top_k_experts=9 exceeds num_experts=3"),
    ("canvas", ConfigError, "canvas_length=0"),
    ("missing_shard", CheckpointError, "missing shard"),
])
def test_errors(ckpt, tmp_path, case, error, message):
    d = _copy(ckpt, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    weights = d / "model.safetensors"
    if case == "no_dir":
        d = tmp_path / "nope"
    elif case == "a_file":
        d = tmp_path / "model.gguf"
        d.write_bytes(b"not gguf")
    elif case == "no_config":
        (d / "config.json").unlink()
    elif case == "bad_json":
        (d / "config.json").write_text("{not json")
    elif case == "no_weights":
        weights.unlink()
    elif case == "model_type":
        cfg["model_type"] = "llama"
    elif case == "missing":
        _edit_tensors(d, lambda t: t.pop("model.decoder.norm.weight"))
    elif case == "unexpected":
        _edit_tensors(d, lambda t: t.update({"model.decoder.extra.weight": torch.zeros(2)}))
    elif case == "shape":
        _edit_tensors(d, lambda t: t.update({"model.decoder.norm.weight": torch.zeros(7)}))
    elif case == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif case == "corrupt":
        weights.write_bytes(b"\xff" * 64)
    elif case == "range":
        cfg["text_config"]["hidden_size"] = -4
    elif case == "top_k":
        cfg["text_config"]["top_k_experts"] = 9
    elif case == "canvas":
        cfg["canvas_length"] = 0
    elif case == "missing_shard":
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    if case in ("model_type", "range", "top_k", "canvas"):
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(error, match=message):
        load_model(d)


def test_vision_weights_load_and_are_optional(ckpt, tmp_path):
    """The checkpoint's vision tower loads into `vision.*` as stored; without its tensors the model has none."""
    stored = load_file(ckpt / "model.safetensors")
    model = load_model(ckpt)
    table = "model.encoder.vision_tower.patch_embedder.position_embedding_table"
    assert torch.equal(model.vision.tower.patch_embedder.position_embedding_table, stored[table])
    embed = next(v for k, v in stored.items() if k.endswith("embed_tokens.weight") and "vision" not in k)
    assert torch.equal(model.embed_tokens.weight, embed)
    d = _copy(ckpt, tmp_path / "text_only")
    save_file({k: v for k, v in stored.items() if ".vision_tower." not in k and ".embed_vision." not in k},
              str(d / "model.safetensors"))
    text_only = load_model(d)
    assert text_only.vision is None and text_only.cfg.vision is None
    assert not any("vision" in n for n, _ in text_only.named_parameters())


def test_image_tokens_are_refused(ckpt, tmp_path):
    """An image token inside the vocabulary (the tiny config's default id lies outside it) is refused as such."""
    import dgemma
    from dgemma.sampling import SamplingParamsError

    d = _copy(ckpt, tmp_path / "img")
    cfg = json.loads((d / "config.json").read_text())
    cfg["image_token_id"] = 7
    (d / "config.json").write_text(json.dumps(cfg))
    model = dgemma.load(d)
    assert model.generate([5, 6], max_new_tokens=2).token_ids
    with pytest.raises(SamplingParamsError, match="image token") as err:
        model.generate([5, 7, 6], max_new_tokens=2)
    assert err.value.param == "prompt"


def test_cli_error_is_one_line_and_nonzero(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dgemma", "info", "--model", str(tmp_path / "nope")],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "checkpoint directory not found" in r.stderr and "Traceback" not in r.stderr


def test_cli_info(ckpt):
    r = subprocess.run([sys.executable, "-m", "dgemma", "info", "--model", str(ckpt), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["canvas_length"] == 5 and info["parameters"] > 0


def test_bundled_model_first_run_is_clean():
    """`dgemma generate` prints text and one stats line, no third-party warnings; the bundled checkpoint loads in
    transformers with nothing missing and no warning (its vision tower lives in a second shard)."""
    r = subprocess.run([sys.executable, "-m", "dgemma", "generate", "Once", "--max-new-tokens", "4", "--seed", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip()
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("[4 tokens"), r.stderr
    code = ("import transformers\n"
            "from dgemma.api import DEMO_MODEL\n"
            "from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion as M\n"
            "_, info = M.from_pretrained(DEMO_MODEL, output_loading_info=True)\n"
            "assert not any(info.values()), info\n")
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "MISSING" not in r.stderr and "arn" not in r.stderr.replace("Loading weights", ""), r.stderr


def test_loading_does_not_import_dynamo():
    """The skeleton is built on the meta device without arithmetic there (torch's Python meta kernels import
    torch._dynamo: ~1.3 s of every load, more than the rest of a load from the kernel cache)."""
    import subprocess
    import sys

    code = ("import sys, dgemma; dgemma.load(None, quantize='int4'); "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
