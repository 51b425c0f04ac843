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


def test_a_certain_tokens_logprob_is_zero_never_negative_zero(monkeypatch):
    """Some log_softmax kernels give a certain token -0.0 (x - (max + log 1) with x = -0.0): entries, alternatives
    and the JSON of a Result carry 0.0."""
    import json
    import math

    from dgemma.engine.output import Result
    from dgemma.sampling.logprobs import canvas_logprobs

    class Head:
        def logits(self, hidden):
            return hidden

    real = torch.log_softmax
    monkeypatch.setattr(torch, "log_softmax", lambda x, dim: real(x, dim=dim) * 0 - 0.0)  # every value -0.0
    entries = canvas_logprobs(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), [0, 1], Head(), 1.0, 2)
    values = [v for _, lp, alts in entries for v in (lp, *(a for _, a in alts))]
    assert values == [0.0] * 6 and all(math.copysign(1.0, v) == 1.0 for v in values)
    result = Result([0, 1], "", "length", logprobs=entries)
    assert "-0.0" not in json.dumps(result.to_dict())
