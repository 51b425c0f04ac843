"""Prefix caching: later turns and shared prefixes continue from a copy of an earlier request's cache; outputs
are the ids the engine gives without it (bundled model, fixed seeds, float32); hits, misses, eviction, sharing.
In bf16 a continued cache rounds differently from a fresh prefill: the reuse holds, logits agree within bf16
rounding, ids may differ."""

import pytest
import torch

import dgemma
from dgemma.cache import KVCache, PrefixCache
from dgemma.cache.prefix import common_prefix
from dgemma.engine import AutoregressiveEngine, Engine, SpeculativeEngine
from dgemma.sampling import SamplingParams


@pytest.fixture(scope="module")
def demo():
    return dgemma.load(dtype="float32")  # the exactness claims hold in float32, on every CPU


@pytest.fixture(scope="module")
def demo_bf16():
    return dgemma.load(dtype="bfloat16")


@pytest.fixture(params=["float32", "bfloat16"])
def either(request):
    """(model, exact): the demo in float32 (ids equal with and without the cache) and in bf16."""
    return request.getfixturevalue("demo" if request.param == "float32" else "demo_bf16"), request.param == "float32"


def _engine(demo, budget=None):
    prefix = None if budget is None else PrefixCache(budget)
    return Engine(demo.module, demo.defaults.eos_token_ids or (), demo.pad_id, 4, prefix_cache=prefix)


def _run(engine, prompts, seeds, n=40):
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, seed=s, max_denoising_steps=8))
            for p, s in zip(prompts, seeds)]
    for _ in engine.stream():
        pass
    return reqs


def _ids(demo, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, demo.module.cfg.text.vocab_size, (n,), generator=g).tolist()


def test_multi_turn_reuses_prompt_and_answer_with_identical_outputs(either):
    """Three turns, each prompt the previous prompt + answer + a new message, the history crossing the sliding
    window: with the cache each turn starts from the previous turn's prompt and answer, and (float32) every
    answer equals the answer without it."""
    demo, exact = either
    cached, plain = _engine(demo, 64 << 20), _engine(demo)
    history, reusable = _ids(demo, 150, 0), 0
    for turn in range(3):
        (a,), (b,) = _run(cached, [history], [turn]), _run(plain, [history], [turn])
        assert a.output and (a.output == b.output or not exact)
        assert a.stats.cached_tokens == reusable  # the previous turn's prompt and answer
        reusable = len(history) + len(a.output)
        history = history + a.output + _ids(demo, 20, turn + 1)
    p = cached.prefix_cache
    assert p.hits == 2 and p.lookups == 3 and p.tokens_reused > len(history) // 2


def _steps(engine, prompt, seed, n=40):
    """One request stepped to its end without `stream` (which tidies at the end, as an idle engine does)."""
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=n, seed=seed, max_denoising_steps=8))
    while engine.has_work():
        engine.step()
    return req


def _held(demo, req):
    """What a finished request's cache holds: its prompt and every canvas of its answer but the last."""
    return len(req.prompt) + demo.module.cfg.canvas_length * (len(req.stats.steps_per_canvas) - 1)


def test_a_finished_answer_s_last_canvas_is_encoded_once_the_engine_is_idle(demo):
    """When a request ends, the prefix cache keeps its prompt and answer as far as its cache holds them, without
    model work; the next request starts at once. A next turn that comes before `tidy` continues from that and
    encodes the rest with its own prompt (the ids it gets without the cache); `tidy` encodes the others' last
    canvases."""
    cached, plain = _engine(demo, 64 << 20), _engine(demo)
    p = cached.prefix_cache
    first, other = _ids(demo, 60, 1), _ids(demo, 60, 2)
    a = _steps(cached, first, 0, n=48)
    b = _steps(cached, other, 1)
    whole_a, whole_b = tuple(first + a.output), tuple(other + b.output)
    assert len(a.stats.steps_per_canvas) == 2 and _held(demo, a) < len(whole_a)
    assert {k[1] for k in p.entries} == {whole_a[:_held(demo, a)], whole_b[:_held(demo, b)]}
    nxt = first + a.output + _ids(demo, 10, 3)
    c = _steps(cached, nxt, 2)
    assert c.stats.cached_tokens == _held(demo, a) and c.output == _steps(plain, nxt, 2).output
    while cached.tidy():
        pass
    assert {whole_b, tuple(nxt + c.output)} <= {k[1] for k in p.entries}


def test_only_the_newest_max_batch_last_canvases_are_owed(demo):
    """Of 5 finished answers (the batch has 4 rows), `tidy` completes the newest 4; the oldest stays as far as
    its cache held it."""
    cached = _engine(demo, 64 << 20)
    reqs = [_steps(cached, _ids(demo, 60, 20 + i), i) for i in range(5)]
    while cached.tidy():
        pass
    keys = {k[1] for k in cached.prefix_cache.entries}
    whole = [tuple(r.prompt + r.output) for r in reqs]
    assert whole[0] not in keys and whole[0][:_held(demo, reqs[0])] in keys and set(whole[1:]) <= keys


@pytest.mark.parametrize("engine", [AutoregressiveEngine, SpeculativeEngine])
def test_autoregressive_and_speculative_turns_reuse_the_previous_prompt_and_answer(demo, engine):
    """Three turns as above, decoded autoregressively (greedy, float32): each turn continues from the previous
    prompt and answer, all of it or all but the last token (a token is cached when the next one is computed), and
    its ids are the ones it gets without the cache."""
    eos = demo.defaults.eos_token_ids or ()
    cached, plain = engine(demo.module, eos, 2, PrefixCache(64 << 20)), engine(demo.module, eos, 2)
    history, reusable = _ids(demo, 150, 0), None
    for turn in range(3):
        params = SamplingParams(max_new_tokens=24 + 8 * turn, seed=turn)
        (a,), (b,) = cached.generate([history], params), plain.generate([history], params)
        assert a.output and a.output == b.output
        assert reusable is None and a.stats.cached_tokens == 0 or a.stats.cached_tokens in reusable
        reusable = (len(history) + len(a.output) - 1, len(history) + len(a.output))
        history = history + a.output + _ids(demo, 20, turn + 1)
    assert cached.prefix_cache.hits == 2


def test_requests_sharing_a_prefix_in_one_batch(demo):
    """Concurrent requests with a shared system prompt each get a private copy of it and the answers they get
    without the cache."""
    system = _ids(demo, 100, 5)
    prompts = [system + _ids(demo, 10, i) for i in range(3)]
    cached, plain = _engine(demo, 64 << 20), _engine(demo)
    _run(cached, [system], [0], n=1)  # leaves the system prompt behind
    got = _run(cached, prompts, [1, 2, 3])
    want = _run(plain, prompts, [1, 2, 3])
    assert [r.output for r in got] == [r.output for r in want]
    assert [r.stats.cached_tokens for r in got] == [len(system)] * 3


@torch.no_grad()
def test_hits_misses_partial_matches_and_eviction(either):
    demo, exact = either
    m = demo.module
    room = m.cfg.canvas_length

    def cache_of(ids):
        c = m.new_cache(1, 4)
        m.prefill(torch.tensor([ids]), c)
        return c

    long = _ids(demo, 3 * m.cfg.text.sliding_window, 7)
    one = cache_of(long).nbytes
    p = PrefixCache(int(2.5 * one))
    p.store(long, cache_of(long))
    assert p.lookup(_ids(demo, 50, 8)) == (None, 0)  # miss
    cache, n = p.lookup(long[:-room // 2] + [5, 6])  # within the ring's reach: usable, continued exactly
    assert n == len(long) - room // 2
    want = m.head(m.encode(torch.tensor([[5, 6]]), cache_of(long[:-room // 2])))
    # float32: summation order only; bf16: its rounding of logits of magnitude ~5 (a wrong cache moves them by units)
    assert (m.head(m.encode(torch.tensor([[5, 6]]), cache)) - want).abs().max() <= (1e-4 if exact else 0.1)
    assert p.lookup(long[:-room - 5] + [5]) == (None, 0)  # the rings no longer hold that far back
    for seed in (9, 10):
        other = _ids(demo, len(long), seed)
        p.store(other, cache_of(other))
    assert p.evictions == 1 and p.bytes <= p.budget and (None, tuple(long)) not in p.entries
    assert (p.hits, p.lookups) == (1, 3)


def test_a_longer_entry_replaces_the_prefixes_it_covers(demo):
    m = demo.module
    ids = _ids(demo, 60, 11)
    p = PrefixCache(1 << 30)
    for n in (40, 60):
        c = m.new_cache(1, 4)
        m.prefill(torch.tensor([ids[:n]]), c)
        p.store(ids[:n], c)
    assert list(p.entries) == [(None, tuple(ids))] and isinstance(p.entries[None, tuple(ids)], KVCache)


@pytest.mark.slow
def test_chat_through_the_server_reuses_earlier_turns(tmp_path_factory):
    """A 5-turn chat through the server, with the prefix cache and without: the same answers, and /metrics shows
    that most prompt tokens of turns 2-5 came from the cache."""
    import httpx

    from server_fixtures import served_checkpoint, start_server

    checkpoint = served_checkpoint(tmp_path_factory)
    answers, reused = {}, {}
    for mb in (0, 16):
        server = start_server(checkpoint, prefix_cache_mb=mb)
        try:
            messages, got, prompt_tokens = [{"role": "system", "content": "You answer briefly. " * 8}], [], 0
            for turn in range(5):
                messages.append({"role": "user", "content": f"Question number {turn}: what is the capital?"})
                r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                               json={"model": "tiny", "messages": messages, "max_tokens": 10, "seed": turn}).json()
                text = r["choices"][0]["message"]["content"]
                got.append(text)
                messages.append({"role": "assistant", "content": text})
                prompt_tokens += r["usage"]["prompt_tokens"] if turn else 0
            metrics = httpx.get(server.url + "/metrics").text
            answers[mb] = got
            reused[mb] = (metrics, prompt_tokens)
        finally:
            server.stop()
    assert answers[0] == answers[16]
    assert "dgemma_prefix_cache_hits_total" not in reused[0][0]
    metrics, later_prompts = reused[16]
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("dgemma_prefix_cache"))
    assert float(values["dgemma_prefix_cache_hits_total"]) == 4
    assert float(values["dgemma_prefix_cache_tokens_reused_total"]) >= later_prompts / 2


@pytest.mark.slow
def test_requests_over_the_cache_budget_are_refused_before_any_work(demo, tmp_path_factory):
    """`Limits.max_cache_bytes` (the server's --max-cache-mb) refuses, with one line naming max_new_tokens, a
    request whose prompt + max_new_tokens needs more KV cache; the estimate is what such a cache holds."""
    import httpx

    from dgemma.sampling import Limits, SamplingParamsError
    from server_fixtures import served_checkpoint, start_server

    m = demo.module
    ids = _ids(demo, 300, 1)
    cache = m.new_cache(1, 4)
    m.prefill(torch.tensor([ids]), cache)
    own = cache.extract(0, 0, cache.length)
    assert own.nbytes == KVCache.bytes_for(m.cfg.text, len(ids), m.dtype, m.cfg.canvas_length)
    need = demo.cache_bytes(len(ids) + 64)
    params = demo.params(max_new_tokens=64)
    demo.check_request(ids, params, Limits(max_cache_bytes=need))
    with pytest.raises(SamplingParamsError, match="needs .* MiB of KV cache; the limit is") as e:
        demo.check_request(ids, params, Limits(max_cache_bytes=need - 1))
    assert e.value.param == "max_new_tokens" and "\n" not in str(e.value)

    server = start_server(served_checkpoint(tmp_path_factory), max_cache_mb=0.01)
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello " * 40, "max_tokens": 200})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "KV cache" in r.json()["error"]["message"] and server.service.worker.running == 0
    finally:
        server.stop()


def test_joins_and_leaves_leave_the_other_requests_caches_alone(demo):
    """A request joining at a canvas boundary gets a cache of its own and one leaving takes only its own: the
    running request keeps the very same cache object throughout, and its output equals its output alone."""
    engine, alone = _engine(demo), _engine(demo)
    params = SamplingParams(max_new_tokens=128, seed=1, max_denoising_steps=4)
    a = engine.add_request(_ids(demo, 40, 1), params)
    engine.step()
    (cache_a,) = engine.batch.caches
    b = engine.add_request(_ids(demo, 20, 2), SamplingParams(max_new_tokens=32, seed=2, max_denoising_steps=4))
    while b not in engine.batch.rows:
        engine.step()
    assert engine.batch.caches[0] is cache_a and engine.batch.caches[1] is not cache_a
    while b in engine.batch.rows:
        engine.step()
    assert b.finished and engine.batch.caches == [cache_a]
    for _ in engine.stream():
        pass
    solo = alone.add_request(a.prompt, params)
    for _ in alone.stream():
        pass
    assert a.output == solo.output and len(a.output) == 128


def test_common_prefix_is_the_first_position_where_the_ids_differ():
    """Against an id-by-id scan: random id sequences over a small alphabet (long shared runs, every length
    relation, a list or a tuple on the right)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        a, b = (torch.randint(0, 2, (int(torch.randint(0, 70, (1,), generator=g)),), generator=g).tolist()
                for _ in range(2))
        if torch.rand(1, generator=g) < 0.5:
            b = a[:int(torch.randint(0, len(a) + 1, (1,), generator=g))] + b  # b starts with a part of a
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(tuple(a), b) == common_prefix(tuple(a), tuple(b)) == expected
