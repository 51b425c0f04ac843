"""Logprob values against an independent computation: with one denoising step, the distribution a canvas is read
from is the decoder's logits for the starting canvas, so the reported values must be transformers' logits for that
canvas, divided by the step's temperature, through a full log-softmax (the chosen token's and the top ones)."""

import pytest
import torch

import dgemma
from reference import build_reference, reference_logits


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("logprobs")
    return build_reference("a", d), dgemma.load(d, dtype="float32")


@pytest.mark.parametrize("t_max", [1.0, 1.7])
@torch.no_grad()
def test_logprobs_are_the_references_log_softmax(pair, monkeypatch, t_max):
    ref, model = pair
    canvases = []
    denoise = model.module.denoise
    monkeypatch.setattr(model.module, "denoise", lambda canvas, *a, **k: canvases.append(canvas.clone()) or
                        denoise(canvas, *a, **k))
    prompt, c = [5, 17, 42, 9, 77, 3], model.module.cfg.canvas_length
    r = model.generate(prompt, max_new_tokens=c, max_denoising_steps=1, t_min=0.5, t_max=t_max, seed=3,
                       eos_token_ids=(), logprobs=5)
    assert len(canvases) == 1 and len(r.logprobs) == c  # one step: the temperature is t_max (steps left / steps)
    logits = reference_logits(ref, torch.tensor([prompt]), canvases)[1][0].float()  # [C, V]
    want = torch.log_softmax(logits / t_max, dim=-1)
    assert [t for t, _, _ in r.logprobs] == r.token_ids
    for pos, (token, lp, alternatives) in enumerate(r.logprobs):
        assert lp == pytest.approx(want[pos, token].item(), abs=1e-4)
        top = want[pos].topk(5)
        assert [a for a, _ in alternatives] == top.indices.tolist()
        assert [v for _, v in alternatives] == pytest.approx(top.values.tolist(), abs=1e-4)
