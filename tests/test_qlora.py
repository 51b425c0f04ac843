"""QLoRA: LoRA adapters trained over a base quantized on load; only the adapters change and the loss falls."""

import pytest
import torch

from dgemma.api import DEMO_MODEL
from dgemma.errors import ConfigError
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
