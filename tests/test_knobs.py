"""The sampling knobs clients send (dgemma/knobs/): each rule against an independent implementation on the same
logits (transformers' TopK / TopP / MinP warpers and RepetitionPenaltyLogitsProcessor, OpenAI's published penalty
formula written out here), their order (vLLM's), and their behaviour in every mode on the bundled (trained)
model: logit_bias -100 bans a token, top_k 1 at any temperature is the argmax, and the same knobs give the same
text through the Python API, the CLI and the server."""

import pytest
import torch

import dgemma
from dgemma.api import DEMO_MODEL
from dgemma.errors import SamplingParamsError
from dgemma.knobs import KNOBS
from dgemma.sampling import SamplingParams
from dgemma.sampling.processing import History, Processor
from server_fixtures import openai_server

V = 64
PROMPT, OUTPUT = [3, 5, 5, 9, 70, 63], [9, 9, 12, 5, 40]  # 70: an image soft token, not a token


def logits(seed=0, rows=3):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 4


def process(**knobs):
    return Processor.of(SamplingParams(**knobs), PROMPT, OUTPUT, V)


def test_truncations_match_transformers_warpers():
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x, ids = logits(), torch.zeros(3, 1, dtype=torch.long)
    for knob, warper in ((dict(top_k=5), TopKLogitsWarper(5)), (dict(top_p=0.7), TopPLogitsWarper(0.7)),
                         (dict(min_p=0.1), MinPLogitsWarper(0.1)), (dict(top_k=1), TopKLogitsWarper(1))):
        for t in (0.5, 1.0, 1.7):
            got, want = process(**knob)(x, 1 / t), warper(ids, x / t)
            assert torch.equal(got.isinf(), want.isinf()), knob
            assert torch.allclose(got[~got.isinf()], want[~want.isinf()])


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    from transformers import RepetitionPenaltyLogitsProcessor

    x = logits(1)
    seen = torch.tensor([[t for t in PROMPT + OUTPUT if t < V]] * 3)
    want = RepetitionPenaltyLogitsProcessor(1.3)(seen, x.clone())
    assert torch.allclose(process(repetition_penalty=1.3)(x, None), want)
    assert not torch.equal(want, x)


def test_presence_and_frequency_follow_openai_formula_over_the_output():
    x = logits(2)
    counts = [OUTPUT.count(j) for j in range(V)]  # mu[j] - c[j] * a_freq - (c[j] > 0) * a_pres
    want = torch.tensor([[x[r, j] - counts[j] * 0.6 - (counts[j] > 0) * -0.4 for j in range(V)] for r in range(3)])
    assert torch.allclose(process(frequency_penalty=0.6, presence_penalty=-0.4)(x, None), want)
    assert process(presence_penalty=0.5)(x, None)[:, 3].equal(x[:, 3])  # 3 is in the prompt only: not penalised


def test_logit_bias_adds_and_the_order_is_vllms():
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

    x, t = logits(3), 0.8
    bias = torch.zeros(V)
    bias[[4, 9]] = torch.tensor([2.5, -100.0])
    y = x + bias  # bias, repetition, frequency, temperature, min_p, top_k, top_p
    y = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([[t for t in PROMPT + OUTPUT if t < V]] * 3), y)
    y = y - 0.3 * torch.tensor([OUTPUT.count(j) for j in range(V)])
    ids = torch.zeros(3, 1, dtype=torch.long)
    y = TopPLogitsWarper(0.9)(ids, TopKLogitsWarper(20)(ids, MinPLogitsWarper(0.02)(ids, y / t)))
    got = process(logit_bias={4: 2.5, "9": -100}, repetition_penalty=1.2, frequency_penalty=0.3, min_p=0.02, top_k=20,
                  top_p=0.9)(x, 1 / t)
    assert torch.equal(got.isinf(), y.isinf()) and torch.allclose(got[~got.isinf()], y[~y.isinf()], atol=1e-5)
    assert [k.option.name for k in KNOBS] == ["logit_bias", "repetition_penalty", "frequency_penalty",
                                              "presence_penalty", "min_p", "top_k", "top_p"]


def test_off_values_change_nothing_and_leave_the_fused_step():
    for off in (dict(top_k=0), dict(top_k=-1), dict(top_p=1.0), dict(min_p=0), dict(repetition_penalty=1.0),
                dict(presence_penalty=0), dict(frequency_penalty=0.0), dict(logit_bias={})):
        assert process(**off) is None and SamplingParams(**off).asked() == []


@pytest.mark.parametrize("bad,param", [(dict(top_k=1.5), "top_k"), (dict(top_k=-2), "top_k"), (dict(top_p=0), "top_p"),
                                       (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
                                       (dict(presence_penalty=2.5), "presence_penalty"),
                                       (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                                       (dict(logit_bias={1: 101}), "logit_bias"),
                                       (dict(logit_bias={"a": 1}), "logit_bias"), (dict(logit_bias=[1]), "logit_bias")])
def test_bad_values_name_their_field(bad, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**bad)
    assert e.value.param == param


@pytest.fixture(scope="module")
def demo():
    return dgemma.load(dtype="float32")  # speculative == autoregressive holds in float32 (bf16 rounds per batch shape)


MODES = [("diffusion", {}), ("autoregressive", {"ar_temperature": 1.0}), ("speculative", {"ar_temperature": 1.0})]


@pytest.mark.parametrize("mode,hot", MODES)
def test_a_token_biased_by_minus_100_never_appears(demo, mode, hot):
    kw = dict(mode=mode, max_new_tokens=48, **hot)
    plain = [demo.generate("Once upon a time", seed=s, **kw).token_ids for s in range(3)]
    common = max(set(sum(plain, [])), key=lambda t: sum(p.count(t) for p in plain))
    banned = [demo.generate("Once upon a time", seed=s, logit_bias={common: -100}, **kw).token_ids for s in range(3)]
    assert all(common not in ids for ids in banned) and sum(p.count(common) for p in plain) >= 3


@pytest.mark.parametrize("mode", ["diffusion", "autoregressive", "speculative"])
def test_top_k_1_is_the_argmax_at_any_temperature(demo, mode):
    def run(t, **knobs):
        hot = {"t_max": t, "t_min": t} if mode == "diffusion" else {"ar_temperature": t}
        return demo.generate("Once upon a time", mode=mode, max_new_tokens=24, seed=5, **hot, **knobs).token_ids

    assert run(1.8, top_k=1) == run(0.3, top_k=1) != run(1.8)
    if mode != "diffusion":
        assert run(1.8, top_k=1) == demo.generate("Once upon a time", mode=mode, max_new_tokens=24).token_ids


def test_speculative_gives_autoregressive_ids_with_penalties(demo):
    kw = dict(max_new_tokens=40, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, seed=2)
    assert demo.generate("The king said", mode="speculative", **kw).token_ids == \
        demo.generate("The king said", mode="autoregressive", **kw).token_ids


def test_a_field_of_another_mode_is_refused_not_ignored(demo):
    for mode, field in (("autoregressive", {"t_min": 0.2}), ("speculative", {"max_denoising_steps": 4}),
                        ("diffusion", {"ar_temperature": 0.5}), ("autoregressive", {"early_stop": 0.1})):
        with pytest.raises(SamplingParamsError) as e:
            demo.generate("Hi", mode=mode, max_new_tokens=2, **field)
        assert e.value.param == next(iter(field))
    with pytest.raises(SamplingParamsError, match="needs the fast sampler"):
        demo.generate("Hi", sampling="reference", max_new_tokens=2, top_p=0.5)


def test_the_same_knobs_through_the_server_the_cli_and_the_api(capsys):
    from dgemma.cli import main

    demo = dgemma.load()  # the dtype the server and the CLI choose

    knobs = dict(top_p=0.8, top_k=30, min_p=0.02, repetition_penalty=1.1, presence_penalty=0.2,
                 frequency_penalty=0.1, logit_bias={7: -5.0})
    want = demo.generate("Once upon a time", max_new_tokens=16, seed=4, **knobs).text
    with openai_server(DEMO_MODEL, model_name="demo") as (_, client):
        raw = client.completions.with_raw_response.create(
            model="demo", prompt="Once upon a time", max_tokens=16, seed=4, top_p=0.8, presence_penalty=0.2,
            frequency_penalty=0.1, logit_bias={"7": -5}, extra_body={"top_k": 30, "min_p": 0.02,
                                                                     "repetition_penalty": 1.1})
        assert raw.parse().choices[0].text == want
        assert "x-dgemma-ignored-fields" not in raw.headers  # vLLM's extra parameters are read, not ignored
    argv = ["generate", "Once upon a time", "--max-new-tokens", "16", "--seed", "4", "--json", "--top-p", "0.8",
            "--top-k", "30", "--min-p", "0.02", "--repetition-penalty", "1.1", "--presence-penalty", "0.2",
            "--frequency-penalty", "0.1", "--logit-bias", "7=-5"]
    assert main(argv) == 0
    import json

    assert json.loads(capsys.readouterr().out)["text"] == want
