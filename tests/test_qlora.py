"""QLoRA: LoRA adapters trained over a base quantized on load; only the adapters change and the loss falls."""

import pytest
import torch

from dgemma.api import DEMO_MODEL
from dgemma.errors import ConfigError, DgemmaError
from dgemma.quant import IntWeight
from dgemma.train.config import make_config
from dgemma.train.trainer import Trainer

TEXT = "\n\n\n".join(["The quick brown fox jumps over the lazy dog. " * 3,
                      "A stitch in time saves nine, and nine saves more. " * 3] * 4)


def _config(tmp_path, **over):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    values = dict(model=str(DEMO_MODEL), train_data=str(data), valid_data=str(data), out=str(tmp_path / "run"),
                  lora=True, lora_r=8, lora_alpha=16, quantize="int4", steps=12, batch_size=2, canvases=1,
                  max_prompt=8, lr=1e-2, warmup=1, eval_every=0, save_minutes=1e9, precision="float32",
                  eval_batches=2, threads=1)
    values.update(over)
    return make_config(values)


@pytest.mark.slow
def test_qlora_trains_only_adapters_over_a_frozen_int4_base(tmp_path):
    trainer = Trainer(_config(tmp_path), progress=False)
    model = trainer.model
    q_proj = model.layers[0].self_attn.q_proj  # peft wrapped the layers in place
    assert isinstance(q_proj.base_layer.weight, IntWeight)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: b.clone() for n, b in model.named_buffers() if n.endswith((".qweight", ".scales"))}
    before_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = trainer.evaluate()
    for _ in range(trainer.cfg.steps):
        trainer.train_step()
    end = trainer.evaluate()
    assert all(torch.equal(b, dict(model.named_buffers())[n]) for n, b in frozen.items())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before_params[n])}
    assert changed and changed <= trainable
    assert end["eval_diffusion"] < start["eval_diffusion"] - 0.05
    assert end["eval_ar"] < start["eval_ar"] - 0.05


@pytest.mark.parametrize("over,message", [
    (dict(lora=False), "quantize needs lora"),
    (dict(lora_targets=["attention", "experts"]), "LoRA on experts needs float expert weights"),
    (dict(quantize="int5"), "expected int8, int4 or nvfp4"),
])
def test_qlora_config_errors(tmp_path, over, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, **over)


def _encoder_logits(model, ids):
    with torch.no_grad():
        return model.head(model.encode(ids, model.new_cache(1, 32)))


@pytest.mark.slow
def test_lora_on_a_prequantized_base_merges_in_full_precision_or_requantized(tmp_path):
    """A LoRA run on a checkpoint stored in int4 exports the merge in full precision (the base dequantized, the
    adapter folded in: what the training model computes), and --merge-adapter --quantize writes it in int4."""
    import argparse
    import json

    from dgemma.convert import run as quantize_run
    from dgemma.train.command import add_arguments, run
    from dgemma.weights import load_model

    base = tmp_path / "q4"
    quantize_run(argparse.Namespace(model=str(DEMO_MODEL), to="int4", out=str(base)))
    trainer = Trainer(_config(tmp_path, model=str(base), quantize=None, steps=3), progress=False)
    final = trainer.run()
    ids = torch.tensor([[2, 40, 41, 300, 17]])
    adapted = _encoder_logits(trainer.model, ids)
    assert not torch.allclose(adapted, _encoder_logits(load_model(base), ids), atol=1e-4)
    merged = load_model(final)
    assert not any(isinstance(m, IntWeight) for m in merged.modules())
    assert torch.allclose(_encoder_logits(merged, ids), adapted, atol=1e-4)

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "merged-int4"
    assert run(parser.parse_args(["--merge-adapter", str(tmp_path / "run" / "adapter"), "--model", str(base),
                                  "--quantize", "int4", "--out", str(out)])) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "compressed-tensors"
    requantized = load_model(out)
    assert any(isinstance(m, IntWeight) for m in requantized.modules())
    got = _encoder_logits(requantized, ids)
    assert (got - adapted).norm() / adapted.norm() < 0.1  # int4 rounding of the merged weights, nothing more
    for scheme, message in (("int4", "not empty"), ("int4+a8", "written as int8, int4 or nvfp4")):
        with pytest.raises(DgemmaError, match=message):
            run(parser.parse_args(["--merge-adapter", str(tmp_path / "run" / "adapter"), "--model", str(base),
                                   "--quantize", scheme, "--out", str(out)]))
