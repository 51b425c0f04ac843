"""`early_first_token` (engine/features/early_first_token.py): the answer's first id is the encoder's next-token choice
after the prompt, committed by the step that prefills it, before any decoder pass, and held by the canvas, so the
text sent never changes. Checked against transformers' own next-token argmax (tiny random checkpoints), on the
bundled model alone, batched with joins, from the prefix cache and from a chunked prefill, with logprobs, a
one-token budget, an end-of-sequence choice, and where it is refused."""

import math

import pytest
import torch

import dgemma
from dgemma.api import DEMO_MODEL
from dgemma.cache import PrefixCache
from dgemma.engine import Engine
from dgemma.model.diffusion_gemma import PREFILL_CHUNK
from dgemma.sampling import Grammar, SamplingParams, SamplingParamsError
from reference import reference_logits

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model():
    """float32, trained weights: batching changes no draw and no argmax."""
    return dgemma.load(DEMO_MODEL, dtype="float32")


def _engine(model, **kw):
    return Engine(model.module, model.defaults.eos_token_ids or (), model.pad_id, **kw)


def _run(engine, prompts, params):
    """Each request and its commit events; the decoder passes each had run when its first commit came."""
    reqs = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    commits, passes = {r.id: [] for r in reqs}, {}
    while engine.has_work():
        for ev in engine.step():
            if ev.kind == "commit":
                commits[ev.request_id].append(ev)
                req = next(r for r in reqs if r.id == ev.request_id)
                passes.setdefault(req.id, req.stats.decoder_passes)
    return reqs, [commits[r.id] for r in reqs], [passes[r.id] for r in reqs]


def test_the_first_id_is_the_reference_encoders_argmax_and_leaves_before_any_pass(reference_pair):
    """The first id is transformers' next-token argmax after the prompt; it goes out alone, before the first
    decoder pass, and the canvas keeps it."""
    ref, model = reference_pair
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, model.module.cfg.text.vocab_size, (9,), generator=g).tolist()
    expected = int(reference_logits(ref, torch.tensor([prompt]), [])[0][0, -1].argmax())
    params = model.params(max_new_tokens=20, seed=1, eos_token_ids=(), early_first_token=True)
    (req,), (commits,), (passes,) = _run(_engine(model), [prompt], [params])
    assert commits[0].token_ids == [expected] and not commits[0].ends_canvas and passes == 0
    assert req.output[0] == expected and [t for e in commits for t in e.token_ids] == req.output


def test_committed_ids_are_never_taken_back_over_several_canvases(model):
    """The first id and the canvases' rests are exactly the output; only the first id goes out early."""
    ids = model.encode_prompt(PROMPT)
    params = model.params(max_new_tokens=300, seed=1, early_first_token=True)
    (req,), (commits,), (passes,) = _run(_engine(model), [ids], [params])
    assert passes == 0 and len(commits[0].token_ids) == 1
    assert [t for e in commits for t in e.token_ids] == req.output
    assert [e.ends_canvas for e in commits] == [False] + [True] * len(req.stats.steps_per_canvas)
    assert len(req.stats.steps_per_canvas) > 1 and req.stats.first_token_rows == 1


def test_batched_rows_with_joins_get_their_ids_alone_and_others_are_untouched(model):
    """Rows with and without the option, two joining mid-canvas: each gets the ids it gets alone, and a row
    without it gets the defaults' ids."""
    texts = ("Write a short poem about the sea.", "Why is the sky blue?", "Tell me a story about a dragon.",
             "What is the capital of France?")
    prompts = [model.encode_prompt([{"role": "user", "content": t}]) for t in texts]
    params = [model.params(max_new_tokens=n, seed=i, early_first_token=i != 1 or None)
              for i, n in enumerate((40, 70, 33, 25))]
    alone = [_run(_engine(model), [p], [q])[0][0].output for p, q in zip(prompts, params)]
    engine = _engine(model)
    reqs, steps = [engine.add_request(p, q) for p, q in zip(prompts[:2], params[:2])], 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps == 3:
            reqs += [engine.add_request(p, q) for p, q in zip(prompts[2:], params[2:])]
    assert [r.output for r in reqs] == alone
    assert alone[1] == model.generate(prompts[1], max_new_tokens=70, seed=1).token_ids


def test_a_prefix_cache_hit_and_a_chunked_prefill_give_the_same_first_id(model):
    """A whole prompt found in the prefix cache still has its last token encoded (the first id needs its hidden
    state), and a prompt longer than a prefill chunk gets its first id from its last chunk: both equal the id of
    a plain prefill's hidden state."""
    def direct(ids):
        cache = model.module.new_cache(1, len(ids) + 8)
        return int(model.module.head(model.module.prefill(torch.tensor([ids]), cache)).argmax())

    ids = model.encode_prompt(PROMPT)
    params = model.params(max_new_tokens=8, seed=1, t_min=0.0, early_first_token=True)
    engine = _engine(model, prefix_cache=PrefixCache(64 << 20))
    (first,), _, _ = _run(engine, [ids], [params])
    (again,), (commits,), _ = _run(engine, [ids], [params])
    assert engine.prefix_cache.hits == 1 and again.stats.cached_tokens == len(ids) - 1
    assert commits[0].token_ids == [direct(ids)] and again.output == first.output
    long = (ids * (PREFILL_CHUNK // len(ids) + 2))[:PREFILL_CHUNK + 40]
    (req,), (commits,), (passes,) = _run(_engine(model), [long], [params])
    assert commits[0].token_ids == [direct(long)] and passes == 0


def test_the_first_ids_logprob_is_the_encoders(model):
    """Its logprob is log softmax(logits / t_min) at the chosen id, from the prompt's last hidden state; the
    later ids' come from the canvas as usual."""
    ids = model.encode_prompt(PROMPT)
    params = model.params(max_new_tokens=16, seed=2, logprobs=2, early_first_token=True)
    (req,), (commits,), _ = _run(_engine(model), [ids], [params])
    cache = model.module.new_cache(1, len(ids) + 8)
    logits = model.module.head(model.module.prefill(torch.tensor([ids]), cache))[0]
    expected = torch.log_softmax(logits / params.t_min, -1)
    (token, lp, alts), = commits[0].logprobs
    assert token == req.output[0] and math.isclose(lp, float(expected[token]), rel_tol=1e-4, abs_tol=1e-5)
    assert [a for a, _ in alts] == expected.topk(2).indices.tolist()
    assert [t for e in commits for t, _, _ in e.logprobs] == req.output


def test_a_one_token_budget_is_the_first_id_and_an_eos_choice_is_left_to_the_canvas(model):
    """A budget of one token is filled by the first id (its canvas ends after a pass at most); an end-of-sequence
    choice is not committed early: the canvas commits first."""
    ids = model.encode_prompt(PROMPT)
    params = model.params(max_new_tokens=1, seed=1, t_min=0.0, early_first_token=True)
    (req,), (commits,), _ = _run(_engine(model), [ids], [params])
    assert len(req.output) == 1 and commits[0].token_ids == req.output and req.stats.decoder_passes <= 1
    assert req.finish_reason == "length"
    eos = params.replace(max_new_tokens=8, eos_token_ids=(req.output[0],))
    (req,), (commits,), (passes,) = _run(_engine(model), [ids], [eos])
    assert passes > 0 and commits[0].ends_canvas and req.stats.first_token_rows == 1  # the canvas decided


def test_refused_where_it_cannot_apply(model, capsys):
    from dgemma.cli import main

    for bad in ({"grammar": Grammar.regex("[a-z]+")}, {"early_first_token": 1}):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**{"early_first_token": True} | bad)
        assert e.value.param == "early_first_token"
    with pytest.raises(SamplingParamsError, match="early_first_token applies to diffusion decoding"):
        model.generate(PROMPT, mode="autoregressive", max_new_tokens=4, early_first_token=True)
    assert main(["generate", PROMPT, "--max-new-tokens", "6", "--seed", "1", "--early-first-token", "--json"]) == 0
    assert '"token_ids"' in capsys.readouterr().out
