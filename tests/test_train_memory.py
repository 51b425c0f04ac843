"""Training memory: the chunked head + cross-entropy equals the unchunked loss in value and gradients; LoRA holds
its frozen base in bfloat16 with float32 adapters and still exports a float32 merge."""

from __future__ import annotations

import torch

from dgemma.train import objective
from dgemma.train.data import Example, collate
from dgemma.train.objective import ObjectiveConfig, autoregressive_loss, compute_losses, diffusion_loss
from dgemma.train.trainer import Trainer
from test_train import _tiny_model, make_config, make_tokenizer, tiny_config, write_text


def _grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


def test_chunked_losses_equal_unchunked_in_value_and_gradient():
    model = _tiny_model()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 32, generator=g, requires_grad=True)
    ids = torch.randint(0, 32, (2, 7), generator=g)
    mask = torch.rand(2, 7, generator=g) < 0.7
    weight = model.embed_tokens.weight
    for loss in (lambda **k: autoregressive_loss(hidden if k else model.head(hidden), ids, mask, **k),
                 lambda **k: diffusion_loss(hidden if k else model.head(hidden), ids, **k)):
        full = loss()
        expected = _grads(full, [hidden, weight])
        for chunk in (1, 3, 100):
            chunked = loss(head=model.head, chunk=chunk)
            assert torch.allclose(chunked, full, atol=1e-6, rtol=0)
            for a, b in zip(_grads(chunked, [hidden, weight]), expected):
                assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_compute_losses_is_the_same_for_any_chunk_size(monkeypatch):
    """The whole objective (AR loss, self-conditioning pass, diffusion loss) with one position per chunk equals
    one chunk for everything: same loss, same gradient on every weight."""
    batch = collate([Example([2, 9, 10, 11], list(range(16, 27))), Example([2, 7], [20, 21, 22])], 4, eos=1)
    results = []
    for budget in (1, 2**30):  # rows_per_chunk: 1 position, or all of them
        monkeypatch.setattr(objective, "LOGIT_BUDGET", budget)
        model = _tiny_model()
        losses = compute_losses(model, batch, ObjectiveConfig(self_cond_prob=1.0), torch.Generator().manual_seed(1))
        losses.total.backward()
        results.append((losses.total.detach(), [p.grad for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.allclose(loss_a, loss_b, atol=1e-5, rtol=0)
    # float32 summation order differs with the chunking (and by CPU kernel): 1e-4 of each gradient's scale
    assert all(torch.allclose(a, b, atol=1e-4 * b.abs().max().item(), rtol=1e-4)
               for a, b in zip(grads_a, grads_b) if a is not None)


def test_lora_base_in_bfloat16_adapters_in_float32(tmp_path):
    from dgemma.weights import load_model

    workdir = tmp_path
    make_tokenizer(workdir / "tok")
    write_text(workdir / "train.txt")
    write_text(workdir / "valid.txt", docs=2, seed=1)
    base = tmp_path / "base"
    Trainer(tiny_config(workdir, tmp_path / "scratch", steps=1), progress=False).run()
    (tmp_path / "scratch" / "final").rename(base)
    cfg = make_config(dict(model=str(base), train_data=str(workdir / "train.txt"), out=str(tmp_path / "lora"),
                           lora=True, lora_r=4, lora_targets=["attention", "mlp", "experts"], steps=1,
                           batch_size=2, warmup=1, eval_every=0, save_minutes=1e9, precision="bfloat16",
                           canvases=2, max_prompt=6))
    trainer = Trainer(cfg, progress=False)
    params = dict(trainer.model.named_parameters())
    assert all(p.dtype == torch.float32 for n, p in params.items() if p.requires_grad)
    assert all(p.dtype == torch.bfloat16 for n, p in params.items() if not p.requires_grad)
    final = trainer.run()
    assert load_model(final).embed_tokens.weight.dtype == torch.float32  # merged into the float32 base
