"""Speculative decoding (engine/speculative.py): the decoder drafts, the encoder checks, and the ids are autoregressive
decoding's. Checked against transformers' own encoder argmax (tiny random checkpoints, many cycles, sliding rings
wrapped), against drafts that are right up to a planted wrong id (a cycle then caches exactly the ids before it,
and the rejected slots leave no trace), and on the bundled model: greedy, sampled, with a grammar, through the
CLI."""

import itertools
import json

import pytest
import torch

import dgemma
from dgemma import Grammar
from dgemma.cli import main
from dgemma.engine import SpeculativeEngine
from reference import reference_logits


@pytest.fixture(scope="module")
def demo():
    return dgemma.load(dtype="float32")


def _prompt(model, n=7, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.module.cfg.text.vocab_size, (n,), generator=g).tolist()


def test_greedy_ids_are_the_reference_encoders_argmax(reference_pair):
    """Past several canvases and the sliding windows: each id is transformers' next-token argmax after the ids
    before it (random weights: nearly every draft is wrong, so most cycles keep one id)."""
    ref, model = reference_pair
    prompt, n = _prompt(model), 3 * model.module.cfg.canvas_length + 2
    r = model.generate(prompt, mode="speculative", max_new_tokens=n, eos_token_ids=())
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(reference_logits(ref, torch.tensor([ids]), [])[0][0, -1].argmax()))
    assert r.token_ids == ids[len(prompt):]
    drafted = sum(d for _, _, d in r.stats["cycles"])
    assert r.stats["decoder_passes"] == 1 + len(r.stats["cycles"]) + drafted


def test_a_cycle_keeps_the_draft_up_to_its_first_wrong_id(reference_pair, monkeypatch):
    """Drafts copied from the autoregressive answer with one id changed at a planned position (or none): each
    cycle caches the given token and the drafted ids before the wrong one, so the cache grows by exactly that
    position (the whole checked span when nothing is wrong), and the answer stays the autoregressive one."""
    _, model = reference_pair
    c, vocab = model.module.cfg.canvas_length, model.module.cfg.text.vocab_size
    prompt, n = _prompt(model, seed=5), 6 * c
    expected = model.generate(prompt, mode="autoregressive", max_new_tokens=n, eos_token_ids=()).token_ids
    plan, used = itertools.cycle([c, 2, 1, c - 1, 3]), []

    def drafts(self, rows):
        (row,) = rows
        at = row.cache.length - len(prompt)  # the answer index of the row's token, committed but not cached yet
        assert expected[at] == row.token
        ids = (expected[at:at + c] + [0] * c)[:c]
        used.append(next(plan))
        if used[-1] < c:
            ids[used[-1]] = (ids[used[-1]] + 1) % vocab
        return [ids]

    monkeypatch.setattr(SpeculativeEngine, "_drafts", drafts)
    monkeypatch.setattr(SpeculativeEngine, "paced", False)
    r = model.generate(prompt, mode="speculative", max_new_tokens=n, eos_token_ids=())
    assert r.token_ids == expected
    assert all(drafted for _, _, drafted in r.stats["cycles"])
    cached = [start for start, _, _ in r.stats["cycles"]]
    assert cached[0] == len(prompt)
    grown = [b - a for a, b in zip(cached, cached[1:])]
    assert grown == [min(wrong, span) for wrong, (_, span, _) in zip(used, r.stats["cycles"])][:len(grown)]
    assert max(grown) == c  # whole canvases were kept too


@pytest.mark.parametrize("paced", [True, False])
def test_bundled_model_speculative_ids_are_autoregressive(demo, monkeypatch, paced):
    """Trained weights, float32: greedy and sampled (one draw per id from the request's generator, as the
    autoregressive engine draws); drafting at every step, several cycles keep more than one drafted id."""
    monkeypatch.setattr(SpeculativeEngine, "paced", paced)
    prompts = [[{"role": "user", "content": p}] for p in ("Write a short poem about the sea.", "Why is the sky blue?")]
    kept = 0
    for prompt, options in itertools.product(prompts, ({}, {"ar_temperature": 0.8, "seed": 11})):
        ar = demo.generate(prompt, mode="autoregressive", max_new_tokens=48, **options)
        spec = demo.generate(prompt, mode="speculative", max_new_tokens=48, **options)
        assert spec.token_ids == ar.token_ids and spec.finish_reason == ar.finish_reason
        cached = [start for start, _, _ in spec.stats["cycles"]]
        kept += sum(b - a > 1 for a, b in zip(cached, cached[1:]))
    assert kept >= 4 or paced


def test_drafts_that_never_hold_give_way_to_plain_steps(demo, monkeypatch):
    """Every draft wrong at its first position: after a few tries (1, 2, 4, ... plain steps between them) nearly
    every id comes from a plain step, and the ids are still the autoregressive ones."""
    monkeypatch.setattr(SpeculativeEngine, "_drafts", lambda self, rows: [[r.token] + [0] * 31 for r in rows])
    ar = demo.generate("Once upon a time", mode="autoregressive", max_new_tokens=64, eos_token_ids=())
    spec = demo.generate("Once upon a time", mode="speculative", max_new_tokens=64, eos_token_ids=())
    assert spec.token_ids == ar.token_ids
    drafted = sum(d for _, _, d in spec.stats["cycles"])
    assert 1 <= drafted <= 8 and len(spec.stats["cycles"]) == 63


def test_bundled_model_grammar_ids_are_autoregressive(demo):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    out = {mode: demo.generate("Describe a person as JSON:", mode=mode, max_new_tokens=40,
                               grammar=Grammar.json_schema(schema)) for mode in ("autoregressive", "speculative")}
    assert out["speculative"].token_ids == out["autoregressive"].token_ids
    assert out["speculative"].finish_reason == "stop" and set(json.loads(out["speculative"].text)) == {"name", "age"}


def test_cli_speculative_mode_prints_the_autoregressive_answer(capsys):
    def run(mode):
        assert main(["generate", "Hello", "--mode", mode, "--max-new-tokens", "12", "--json", "--dtype",
                     "float32"]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    assert run("speculative") == run("autoregressive")
    assert main(["generate", "Hello", "--mode", "speculative", "--steps", "4"]) == 2
    assert "--steps applies to diffusion decoding" in capsys.readouterr().err


def test_the_cache_forgets_only_what_its_rings_can_give_back(demo):
    cache = demo.module.new_cache(1, 64)
    demo.module.prefill(torch.tensor([[5] * 40]), cache)
    room = demo.module.cfg.canvas_length
    cache.truncate(40 - room)
    assert cache.length == 40 - room
    with pytest.raises(ValueError, match="newest"):
        cache.truncate(40 - 2 * room - 1)


@pytest.mark.parametrize("mode", ["autoregressive", "speculative"])
def test_rows_in_one_batch_get_the_ids_they_get_alone(demo, mode):
    """Five requests of different lengths and temperatures through one engine of 4 rows, two of them arriving
    after a few steps (one waits for room): each gets the ids it gets alone (float32, trained weights)."""
    texts = ("Write a short poem about the sea.", "Why is the sky blue?", "Tell me a story about a dragon.",
             "What is the capital of France?", "List three prime numbers.")
    prompts = [demo.encode_prompt([{"role": "user", "content": t}]) for t in texts]
    params = [demo.params(max_new_tokens=n, seed=i, ar_temperature=t)
              for i, (n, t) in enumerate(zip((40, 12, 33, 25, 18), (0.0, 0.8, 0.0, 1.0, 0.0)))]
    alone = [demo.runner(mode).generate([p], q)[0].output for p, q in zip(prompts, params)]
    engine = demo.runner(mode, max_batch=4)
    reqs = [engine.add_request(p, q) for p, q in zip(prompts[:3], params[:3])]
    running, steps = [], 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps == 4:
            reqs += [engine.add_request(p, q) for p, q in zip(prompts[3:], params[3:])]
        running.append(engine.num_running)
    assert [r.output for r in reqs] == alone
    assert max(running) == 4 and len(running) < sum(len(a) for a in alone)


def test_ids_past_the_budget_end_a_request_as_one_token_at_a_time_would():
    """A cycle can bring an end-of-sequence id just past the budget: the request ends with "length", as the
    autoregressive engine's one-token steps end it (the budget runs out before the EOS is seen); an EOS inside
    the budget ends it with "stop"."""
    from dgemma.engine.autoregressive import emit
    from dgemma.engine.request import Request
    from dgemma.sampling import SamplingParams

    def run(tokens, budget):
        req, events = Request("r", [5], SamplingParams(max_new_tokens=budget), eos=(1,)), []
        emit(req, tokens, events)
        return req.output, req.finish_reason

    assert run([7, 8, 1], 2) == ([7, 8], "length")
    assert run([7, 1, 9], 2) == ([7], "stop")
    assert run([7, 8, 9], 2) == ([7, 8], "length")
    assert run([7, 8], 3) == ([7, 8], None)
