"""One request's failure is that request's (issue 39): a row whose own work fails (here its grammar, made to raise
mid-canvas) ends with "error" and leaves the batch, the rows beside it finish as they would have without it, and a
server keeps its engine and serves on; an image prompt holds its features from preparation to prefill, so an
image cache that other clients fill cannot take them away."""

import concurrent.futures
import gc
import json
import threading

import openai
import pytest

import dgemma
from dgemma import Grammar
from dgemma.api import DEMO_MODEL
from dgemma.errors import DgemmaError
from dgemma.engine.features.grammar import GrammarFeature
from server_fixtures import openai_server

POISON_SEED = 13


@pytest.fixture(scope="module")
def demo():
    return dgemma.load()


def _poison(req, after: int = 3) -> None:
    """The request's grammar raises from its `after`-th extension on."""
    calls, extend = [0], req.grammar.extend

    def broken(tokens):
        calls[0] += 1
        if calls[0] >= after:
            raise RuntimeError("injected grammar failure")
        return extend(tokens)

    req.grammar.extend = broken


def _run(model, seeds, poisoned=()):
    runner = model.runner("diffusion", "fast", max_batch=len(seeds))
    ids = model.encode_prompt("The weather report, as JSON:")
    reqs = []
    for seed in seeds:
        req = runner.add_request(ids, model.params(grammar=Grammar.json_object(), seed=seed, max_new_tokens=48,
                                                   t_max=0.01, t_min=0.005))
        if seed in poisoned:
            _poison(req)
        reqs.append(req)
    finishes = [e for e in runner.stream() if e.kind == "finish"]
    return reqs, finishes


def test_a_failing_row_ends_alone_and_the_others_finish_as_without_it(demo):
    seeds = [1, 2, POISON_SEED, 4]
    clean, _ = _run(demo, seeds)
    reqs, finishes = _run(demo, seeds, poisoned={POISON_SEED})
    assert [r.finish_reason for r in reqs][2] == "error"
    assert [(e.request_id, e.finish_reason) for e in finishes].count((reqs[2].id, "error")) == 1
    for got, want in zip(reqs, clean):
        if got.params.seed != POISON_SEED:
            assert got.finish_reason == want.finish_reason and got.output == want.output


def _chat(client, seed: int):
    return client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "A JSON object"}],
                                          max_tokens=48, seed=seed, temperature=0.5,
                                          response_format={"type": "json_object"})


def test_the_server_fails_only_that_request_and_keeps_its_engine(monkeypatch):
    attach = GrammarFeature.attach

    def poisoning(self, req, runner):
        attach(self, req, runner)
        if req.params.seed == POISON_SEED:
            _poison(req)

    monkeypatch.setattr(GrammarFeature, "attach", poisoning)
    with openai_server(DEMO_MODEL, model_name="demo", max_concurrency=4) as (server, client):
        engine = server.service.worker.engine
        start = threading.Barrier(4)

        def one(seed):
            start.wait()
            return _chat(client, seed)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = {seed: pool.submit(one, seed) for seed in (1, 2, POISON_SEED, 4)}
        with pytest.raises(openai.InternalServerError, match="engine"):
            futures[POISON_SEED].result()
        for seed in (1, 2, 4):
            json.loads(futures[seed].result().choices[0].message.content)  # valid JSON: the grammar held
        assert server.service.worker.engine is engine  # no fresh engine: nobody else's request was cut
        json.loads(_chat(client, 5).choices[0].message.content)


def _image_chat(seed: int, text: str = "What is this?"):
    import base64
    import io

    import torch
    from PIL import Image

    pixels = torch.randint(0, 256, (30, 40, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text",
                                                                                              "text": text}]}]


def test_a_prompt_holds_its_image_features_whatever_the_cache_evicts(demo, monkeypatch):
    soft = demo.module.soft_tokens
    params = demo.params(seed=0, max_new_tokens=8)
    runner = demo.runner("diffusion", "fast")
    held = demo.encode_prompt(_image_chat(101))
    want = runner.generate([held], params)[0].output
    monkeypatch.setattr(soft, "budget", 1)  # every new image evicts all the others
    for seed in (102, 103):
        demo.encode_prompt(_image_chat(seed))  # other clients' images: 101's entry leaves the cache
    assert len(soft.entries) == 1
    assert runner.generate([held], params)[0].output == want  # placed from the features the prompt holds
    bare = list(held)
    del held
    gc.collect()
    with pytest.raises(DgemmaError, match="send the image again"):
        runner.add_request(bare, params)  # once nothing holds them, the ids are refused before the request runs
    again = demo.encode_prompt(_image_chat(101))
    assert again != bare and runner.generate([again], params)[0].output == want  # a new range, same features


def test_images_are_cached_per_partition(demo):
    a1 = demo.encode_prompt(_image_chat(200), partition="key-1")
    a2 = demo.encode_prompt(_image_chat(200), partition="key-1")
    b = demo.encode_prompt(_image_chat(200), partition="key-2")
    vocab = demo.module.soft_tokens.vocab
    soft = [[t for t in ids if t >= vocab] for ids in (a1, a2, b)]
    assert soft[0] == soft[1] and soft[0] and not set(soft[0]) & set(soft[2])
