"""What the playground needs from the server, without a browser: the page and its files (same origin, strict
CSP), the checkpoint's defaults on the model card, the `dgemma_sampling` options, and drafts that carry each
position's text and acceptance, one per step a row really takes."""

import json

import httpx
import pytest

import dgemma
from server_fixtures import served_checkpoint, start_server


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return served_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(checkpoint):
    s = start_server(checkpoint, max_concurrency=4, max_queue=4, api_keys=("k",))
    yield s
    s.stop()


AUTH = {"authorization": "Bearer k"}


def _drafts(server, **body) -> list[dict]:
    body = {"prompt": "Hello world", "stream": True, "dgemma_drafts": True, **body}
    out = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if "dgemma_draft" in choice:
                    out.append(choice["dgemma_draft"])
    return out


def test_page_and_files_are_public_and_same_origin(server):
    page = httpx.get(server.url + "/")  # no key: the page asks for it
    assert httpx.head(server.url + "/").status_code == 200
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert '"/playground/app.js"' in page.text and '"/playground/style.css"' in page.text
    for src in ("/playground/app.js", "/playground/api.js", "/playground/canvas.js", "/playground/style.css"):
        r = httpx.get(server.url + src)
        assert r.status_code == 200 and r.headers["content-type"].split(";")[0] in ("text/javascript", "text/css")
        assert "http://" not in r.text and "https://" not in r.text  # nothing fetched from elsewhere
        assert r.headers["content-security-policy"] == policy and r.headers["x-content-type-options"] == "nosniff"
    missing = httpx.get(server.url + "/playground/nope.js")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/v1/models").status_code == 401  # the API itself stays protected
    assert httpx.get(server.url + "/openapi.json").status_code == 401  # the schema too
    assert "/" not in httpx.get(server.url + "/openapi.json", headers=AUTH).json()["paths"]
    for path in ("/v1/models", "/health", "/nope"):  # every answer: no sniffing, no framing
        r = httpx.get(server.url + path, headers=AUTH)
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"


def test_model_card_carries_the_checkpoint_defaults(server, checkpoint):
    card = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    defaults = dgemma.load(checkpoint).defaults
    assert card["dgemma_defaults"] == {
        "max_tokens": generation["max_new_tokens"], "max_denoising_steps": generation["max_denoising_steps"],
        "entropy_bound": defaults.entropy_bound, "t_min": defaults.t_min, "t_max": defaults.t_max,
        "canvas_length": 8}


def test_dgemma_sampling_reaches_the_sampler(server):
    # an entropy bound that admits every position, then one that admits only the surest position per step
    every = _drafts(server, max_tokens=8, seed=1, dgemma_sampling={"entropy_bound": 1e9, "max_denoising_steps": 3})
    assert [d["step"] for d in every] == [1, 2, 3] and all(all(d["accepted"]) for d in every)
    one = _drafts(server, max_tokens=8, seed=1, dgemma_sampling={"entropy_bound": 1e-9, "max_denoising_steps": 5})
    assert len(one) == 5 and all(sum(d["accepted"]) == 1 for d in one)
    # `temperature` T is the schedule T -> T/2: the same schedule sent as t_max / t_min gives the same text
    texts = [httpx.post(server.url + "/v1/completions", headers=AUTH, json={
        "prompt": "Hi", "max_tokens": 16, "seed": 4, **extra}).json()["choices"][0]["text"]
        for extra in ({"temperature": 1.2}, {"dgemma_sampling": {"t_max": 1.2, "t_min": 0.6}})]
    assert texts[0] == texts[1]
    # temperatures near zero are near-greedy, as `temperature=0` is, not an overflow into padding
    greedy = [httpx.post(server.url + "/v1/completions", headers=AUTH, json={
        "prompt": "Hi", "max_tokens": 8, "seed": 4, **extra}).json()["choices"][0]["text"]
        for extra in ({"temperature": 0}, {"dgemma_sampling": {"t_max": 1e-300, "t_min": 0.0}})]
    assert greedy[0] == greedy[1] and greedy[0]


@pytest.mark.parametrize("body, param", [
    ({"dgemma_sampling": {"max_denoising_steps": 0}}, "dgemma_sampling.max_denoising_steps"),
    ({"dgemma_sampling": {"entropy_bound": -1.0}}, "dgemma_sampling.entropy_bound"),
    ({"dgemma_sampling": {"t_max": -0.5}}, "dgemma_sampling.t_max"),
    ({"dgemma_sampling": {"t_min": 0.9, "t_max": 0.2}}, "dgemma_sampling.t_max"),
    ({"dgemma_sampling": {"max_denoising_steps": 2.5}}, "dgemma_sampling.max_denoising_steps"),
    ({"temperature": 0.5, "dgemma_sampling": {"t_min": 0.1}}, "dgemma_sampling"),
])
def test_dgemma_sampling_errors_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"prompt": "Hi", "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_drafts_carry_each_positions_text(server, checkpoint):
    tokenizer = dgemma.load(checkpoint).tokenizer
    drafts = _drafts(server, max_tokens=16, seed=2)
    assert {d["canvas"] for d in drafts} == {0, 1}
    for d in drafts:
        assert len(d["tokens"]) == len(d["accepted"]) == len(d["token_ids"]) == 8
        assert d["tokens"] == [tokenizer.tok.decode([i], skip_special_tokens=False) for i in d["token_ids"]]
        assert any(d["accepted"])  # the sampler keeps at least one position per step


def test_a_batch_row_sends_one_draft_per_step_it_takes(checkpoint):
    """Rows of one batch stop denoising at different steps; a stopped row sends no more drafts, so the drafts a
    row sends per canvas are exactly the steps it took."""
    model = dgemma.load(checkpoint)
    engine = model.runner("diffusion", "fast", 4)
    # near-greedy and stopped on the first unchanged draft: the random model's rows stop after 3 to 12 steps
    params = model.params(max_new_tokens=16, t_max=0.05, t_min=0.05, stability_threshold=1, confidence_threshold=1e9)
    reqs = [engine.add_request([5, 6, 7, 8 + i], params.replace(seed=i), drafts=True) for i in range(4)]
    drafts: dict[str, list[int]] = {r.id: [0, 0] for r in reqs}
    canvas = {r.id: 0 for r in reqs}
    for event in engine.stream():
        if event.kind == "draft":
            drafts[event.request_id][canvas[event.request_id]] += 1
        elif event.kind == "commit":
            canvas[event.request_id] += 1
    steps = [r.stats.steps_per_canvas for r in reqs]
    assert len({tuple(s) for s in steps}) > 1  # the rows did stop at different steps
    assert [drafts[r.id] for r in reqs] == steps
