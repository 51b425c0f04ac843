"""The server with the official `openai` client on 127.0.0.1: completions and chat, streaming and not, n, stop,
seeds, usage, drafts; concurrency (batching, joins, batch independence), disconnects, overload, health, metrics."""

import asyncio
import threading
import time

import httpx
import pytest

import dgemma
from server_fixtures import load_with_eos, served_checkpoint, start_server, wait_until

openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": "Hello there, who are you?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return served_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(checkpoint):
    s = start_server(checkpoint, max_concurrency=8, max_queue=16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return dgemma.load(checkpoint).tokenizer


def _metric(server, name: str) -> dict[str, float]:
    """{labels-or-empty: value} for one metric family in /metrics."""
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key[len(name):]] = float(value)
    return out


def _idle(server) -> bool:
    return server.service.in_use == 0 and server.service.worker.running == 0


# ---- the OpenAI client, unchanged ----------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion_usage_and_exact_max_tokens(client, tokenizer):
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=11, seed=3)
    (choice,) = r.choices
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 11
    assert r.usage.prompt_tokens == len(tokenizer.encode("Hello world"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 11
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, seed=3)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 3


def test_chat_streamed_equals_non_streamed(client, tokenizer):
    kw = dict(model="tiny", messages=CHAT, max_tokens=13, seed=7)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 13
    assert full.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason == "length" and not last.delta.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 13
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_without_usage(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=9, seed=1)
    chunks = list(client.completions.create(**kw, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks)
    assert text == client.completions.create(**kw).choices[0].text


def test_seeds_n_and_determinism(client):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=10)
    a = client.completions.create(**kw, seed=42)
    assert client.completions.create(**kw, seed=42).choices[0].text == a.choices[0].text
    assert client.completions.create(**kw, seed=43).choices[0].text != a.choices[0].text
    many = client.completions.create(**kw, seed=42, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == a.choices[0].text  # choice i uses seed + i
    assert many.choices[1].text == client.completions.create(**kw, seed=43).choices[0].text
    assert many.usage.completion_tokens == 30
    greedy = [client.completions.create(**kw, temperature=0).choices[0].text for _ in range(2)]
    assert greedy[0] == greedy[1]  # temperature 0 without a seed is reproducible too


def test_chat_n_streaming(client):
    kw = dict(model="tiny", messages=CHAT, max_tokens=9, seed=5, n=2)
    full = client.chat.completions.create(**kw)
    texts = ["", ""]
    reasons = [None, None]
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.message.content for c in full.choices] and reasons == ["length", "length"]


def test_stop_strings(client):
    kw = dict(model="tiny", prompt="Hello world", max_tokens=16, seed=9)
    text = client.completions.create(**kw).choices[0].text
    k = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[k:k + 2]
    expected = text[:text.index(stop)]
    r = client.completions.create(**kw, stop=[stop, "never-seen"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    assert r.usage.completion_tokens <= 16
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_eos_finishes_with_stop(checkpoint):
    """A third of the vocabulary as EOS ids: every request ends early on an EOS, never by length."""
    s = start_server(checkpoint, loader=lambda: load_with_eos(checkpoint, eos=tuple(range(1, 128))))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny", prompt="Hello", max_tokens=40, seed=5)
        r = client.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 40
        streamed = list(client.completions.create(**kw, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
        assert streamed[-1].choices[0].finish_reason == "stop"
    finally:
        s.stop()


def test_drafts_are_ignored_by_the_client(client):
    """dgemma_drafts adds chunks with an empty delta and a `dgemma_draft` field: the client's text is unchanged."""
    kw = dict(model="tiny", messages=CHAT, max_tokens=16, seed=4, stream=True)
    plain = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw))
    chunks = list(client.chat.completions.create(**kw, extra_body={"dgemma_drafts": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    drafts = [c.choices[0].model_extra["dgemma_draft"] for c in chunks if "dgemma_draft" in c.choices[0].model_extra]
    assert len(drafts) >= 2 and {d["canvas"] for d in drafts} == {0, 1}
    assert all(len(d["token_ids"]) <= 8 and isinstance(d["text"], str) for d in drafts)
    assert [d["step"] for d in drafts if d["canvas"] == 0] == list(range(1, 1 + sum(d["canvas"] == 0 for d in drafts)))


@pytest.mark.parametrize("mode", ["autoregressive", "speculative"])
def test_autoregressive_modes_serve_the_apis_tokens(checkpoint, mode):
    """`dgemma serve --mode autoregressive` (or speculative): the same engine interface and output path as the
    Python API, so the served text equals `generate(mode=...)`, streamed or not, with stop strings applied."""
    s = start_server(checkpoint, mode=mode)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny", prompt="Hello world", max_tokens=12, temperature=0)
        r = client.completions.create(**kw)
        expected = dgemma.load(checkpoint).generate("Hello world", mode=mode, max_new_tokens=12)
        assert (r.choices[0].text, r.usage.completion_tokens) == (expected.text, 12)
        streamed = list(client.completions.create(**kw, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == expected.text
        stop = expected.text[4:6]
        stopped = client.completions.create(**kw, stop=stop)
        cut = expected.text[:expected.text.index(stop)]
        assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (cut, "stop")
        # temperature, seed and n are honoured: choice i samples with seed + i at that temperature
        hot = dict(model="tiny", prompt="Hello world", max_tokens=12, temperature=1.5, seed=7)
        texts = [c.text for c in client.completions.create(**hot, n=3).choices]
        model = dgemma.load(checkpoint)
        assert texts == [model.generate("Hello world", mode=mode, max_new_tokens=12, ar_temperature=1.5,
                                        seed=7 + i).text for i in range(3)]
        assert len(set(texts)) > 1 and expected.text not in texts
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw, extra_body={"dgemma_drafts": True}, stream=True)
        assert e.value.body["param"] == "dgemma_drafts" and e.value.body["code"] == "unsupported_parameter"
        with pytest.raises(openai.BadRequestError) as e:  # refused, not ignored: options.check_modes
            client.completions.create(**kw, extra_body={"dgemma_sampling": {"max_denoising_steps": 3}})
        assert e.value.body["param"] == "dgemma_sampling.max_denoising_steps"
        assert "applies to diffusion decoding" in e.value.body["message"]
        assert client.completions.create(**kw, top_p=0.5).choices[0].text  # a knob of every mode
    finally:
        s.stop()


# ---- concurrency -----------------------------------------------------------------------------------------------
def test_outputs_do_not_depend_on_the_batch(server):
    """Low temperature keeps samples away from float ties (padding changes logits by rounding only)."""
    kw = dict(model="tiny", max_tokens=17, temperature=0.1)

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            async def one(prompt, seed):
                return (await client.completions.create(prompt=prompt, seed=seed, **kw)).choices[0].text

            alone = await one("Hello world", 11)
            before = _metric(server, "dgemma_batch_size_bucket")
            results = await asyncio.gather(one("Hello world", 11), one("A much longer prompt than the other", 2),
                                           one("Hi", 3), one("Paris is the capital", 4))
            return alone, before, results

    alone, before, results = asyncio.run(run())
    assert results[0] == alone
    after = _metric(server, "dgemma_batch_size_bucket")
    single = after['{le="1.0"}'] - before['{le="1.0"}']
    total = after['{le="+Inf"}'] - before['{le="+Inf"}']
    assert total > single  # some steps denoised several requests together


def test_new_requests_join_without_waiting(server, client):
    """A short request sent while a long one streams finishes first: it joined at a canvas boundary."""
    done = {}

    def long_stream():
        for _ in client.completions.create(model="tiny", prompt="Hello", max_tokens=96, seed=1, stream=True,
                                           extra_body={"dgemma_drafts": True}):
            done.setdefault("long_started", time.monotonic())
        done["long"] = time.monotonic()

    t = threading.Thread(target=long_stream)
    t.start()
    assert wait_until(lambda: "long_started" in done, 30)
    client.completions.create(model="tiny", prompt="Hi", max_tokens=4, seed=1)
    done["short"] = time.monotonic()
    t.join(60)
    assert done["short"] < done["long"]


def test_stream_disconnect_frees_the_slot(server):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # keep it: a dropped line iterator closes the connection
        next(lines)
        assert server.service.in_use == 1
    t0 = time.monotonic()
    assert wait_until(lambda: _idle(server), 1.0), "the slot was not freed within a second"
    assert time.monotonic() - t0 < 1.0


def test_non_stream_disconnect_frees_the_slot(server):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    assert wait_until(lambda: _idle(server), 1.0)


def test_abandoned_burst_does_not_delay_a_fresh_request(server, client):
    def abandon():
        try:
            httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 5000, "n": 2},
                       timeout=httpx.Timeout(30, read=0.3))
        except httpx.ReadTimeout:
            pass

    threads = [threading.Thread(target=abandon) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t0 = time.monotonic()
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=8, seed=1)
    assert r.choices[0].finish_reason == "length" and time.monotonic() - t0 < 5
    assert wait_until(lambda: _idle(server), 1.0)


def test_overload_is_refused_at_once(checkpoint):
    s = start_server(checkpoint, max_concurrency=1, max_queue=1, max_n=2)
    try:
        body = {"prompt": "Hello", "max_tokens": 5000, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body | {"n": 2}, timeout=30) as held:
            lines = held.iter_lines()
            next(lines)
            assert s.service.in_use == 2
            t0 = time.monotonic()
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
            assert r.status_code == 429 and time.monotonic() - t0 < 0.5
            assert r.json()["error"]["type"] == "rate_limit_error" and r.headers["retry-after"]
            assert s.service.in_use == 2  # nothing of the refused request was admitted
        assert wait_until(lambda: s.service.in_use == 0, 1.0)
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
        assert _metric(s, "dgemma_requests_rejected_total") == {'{reason="overloaded"}': 1.0}
    finally:
        s.stop()


# ---- health and metrics ----------------------------------------------------------------------------------------
def test_health_is_503_while_loading(checkpoint):
    release = threading.Event()

    def slow_loader():
        release.wait(30)
        return dgemma.load(checkpoint)

    s = start_server(checkpoint, loader=slow_loader, ready=False)
    try:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        release.set()
        assert wait_until(lambda: httpx.get(s.url + "/health").status_code == 200, 30)
    finally:
        release.set()
        s.stop()


def test_metrics(server, client):
    client.completions.create(model="tiny", prompt="Hello", max_tokens=12, seed=2)
    text = httpx.get(server.url + "/metrics").text
    for family, kind in [("dgemma_requests_running", "gauge"), ("dgemma_requests_waiting", "gauge"),
                         ("dgemma_time_to_first_token_seconds", "histogram"),
                         ("dgemma_time_per_output_token_seconds", "histogram"),
                         ("dgemma_e2e_request_latency_seconds", "histogram"),
                         ("dgemma_request_queue_time_seconds", "histogram"),
                         ("dgemma_requests_finished_total", "counter"),
                         ("dgemma_denoising_steps_per_canvas", "histogram"),
                         ("dgemma_tokens_per_forward", "histogram")]:
        assert f"# TYPE {family} {kind}" in text
    assert _metric(server, "dgemma_requests_finished_total")['{reason="length"}'] >= 1
    assert _metric(server, "dgemma_tokens_per_forward_count")[""] >= 1
    steps = _metric(server, "dgemma_denoising_steps_per_canvas_bucket")
    assert steps['{le="+Inf"}'] >= 2 and steps['{le="12.0"}'] == steps['{le="+Inf"}']  # at most 12 steps
