"""One client must not stall the others: huge prompts are refused before tokenizing and tokenizing never runs
on the event loop; slow, silent and surplus connections are dropped with OpenAI error objects; queue waits and
request deadlines end requests cleanly and free their places."""

import json
import socket
import threading
import time

import httpx
import pytest

from server_fixtures import error_of, raw_exchange, served_checkpoint, start_server, wait_until

C = "/v1/completions"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return served_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(checkpoint):
    s = start_server(checkpoint, header_timeout=0.6, body_timeout=0.6, keep_alive_timeout=0.4, max_connections=6,
                     tokenizer_threads=1)
    yield s
    s.stop()


def test_a_huge_prompt_is_refused_before_tokenizing(server, monkeypatch):
    model = server.service.model
    calls = []
    monkeypatch.setattr(model.tokenizer, "encode", lambda *a, **k: calls.append(1) or [5])
    limit = model.prompt_limit(server.service.config.limits)
    cap = limit * model.tokenizer.max_token_chars * 2
    r = httpx.post(server.url + C, json={"prompt": "a" * (cap + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert f"{cap} characters" in r.json()["error"]["message"] and not calls  # never tokenized
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * cap}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and not calls
    r = httpx.post(server.url + C, json={"prompt": [5] * (limit + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_tokenizing_is_off_the_loop_and_bounded(server, monkeypatch):
    """While a tokenization is stuck, /health still answers; with --tokenizer-threads 1, one runs at a time."""
    tok = server.service.model.tokenizer
    encode, active, peak, release = tok.encode, [0], [0], threading.Event()

    def stuck(text, *args, **kwargs):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        release.wait(30)  # a tokenization that takes as long as the test wants (waiting releases the GIL)
        active[0] -= 1
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", stuck)
    results = []
    clients = [threading.Thread(target=lambda: results.append(httpx.post(
        server.url + C, json={"prompt": "hello", "max_tokens": 1}, timeout=60).status_code)) for _ in range(3)]
    for t in clients:
        t.start()
    assert wait_until(lambda: active[0] == 1, 10)
    assert httpx.get(server.url + "/health", timeout=20).status_code == 200  # served while tokenizing
    assert active[0] == 1 and peak[0] == 1  # the others wait for the one tokenizer thread
    release.set()
    for t in clients:
        t.join(60)
    assert results == [200, 200, 200] and peak[0] == 1


def test_prompt_alone_over_the_context_names_the_prompt(server):
    context = server.service.model.max_context
    r = httpx.post(server.url + C, json={"prompt": [5] * context})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == f"the prompt has {context} tokens; at most {context - 1} tokens are allowed"


def test_slow_and_silent_connections_are_dropped(server):
    t0 = time.monotonic()
    status, error = error_of(raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"))
    assert status == 408 and error["code"] == "request_timeout" and "header" in error["message"]
    assert time.monotonic() - t0 < 3
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    status, error = error_of(raw_exchange(server, head + b"Content-Length: 100\r\n\r\n{\"prompt\""))
    assert status == 408 and "body" in error["message"]
    assert raw_exchange(server, b"") == b""  # silent: closed without a word after the header timeout
    with httpx.Client() as client:  # an idle keep-alive connection goes after --keep-alive-timeout
        assert client.get(server.url + "/health").status_code == 200
        assert wait_until(lambda: len(server.server.server_state.connections) == 0, 3)
    assert httpx.get(server.url + "/health").status_code == 200


def test_invalid_http_gets_an_error_object(server):
    status, error = error_of(raw_exchange(server, b"GARBAGE\r\n\r\n"))
    assert status == 400 and error["code"] == "invalid_http" and error["type"] == "invalid_request_error"


def test_connections_over_the_cap_are_refused(server):
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(6)]
    try:
        assert wait_until(lambda: len(server.server.server_state.connections) >= 6, 3)
        status, error = error_of(raw_exchange(server, b""))  # answered as soon as it connects
        assert status == 503 and error["code"] == "too_many_connections"
    finally:
        for s in socks:
            s.close()
    assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, 5)


def test_queue_wait_is_bounded(checkpoint):
    s = start_server(checkpoint, max_concurrency=1, max_queue=4, max_n=2, max_queue_seconds=0.5)
    try:
        long = threading.Thread(target=lambda: httpx.post(s.url + C, json={"prompt": "Hi", "max_tokens": 100_000,
                                                                            "dgemma_timeout": 8}, timeout=30))
        long.start()
        assert wait_until(lambda: s.service.worker.running == 1, 30)
        for stream in (False, True):
            t0 = time.monotonic()
            r = httpx.post(s.url + C, json={"prompt": "Hi", "max_tokens": 4, "stream": stream}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", r.text
            assert r.headers["retry-after"] == "1" and 0.4 < time.monotonic() - t0 < 5
        assert s.service.in_use == 1  # the refused ones gave their places back
    finally:
        s.stop()


def test_a_request_deadline_aborts_and_frees_the_row(server):
    t0 = time.monotonic()
    r = httpx.post(server.url + C, json={"prompt": "Hi", "max_tokens": 100_000, "dgemma_timeout": 0.5}, timeout=30)
    assert r.status_code == 408 and r.json()["error"]["code"] == "deadline_exceeded"
    assert r.json()["error"]["param"] == "dgemma_timeout" and time.monotonic() - t0 < 10
    with httpx.stream("POST", server.url + C, json={"prompt": "Hi", "max_tokens": 100_000, "stream": True,
                                                    "dgemma_drafts": True, "dgemma_timeout": 1.0}, timeout=30) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "deadline_exceeded"
    assert any("choices" in json.loads(e) for e in events[:-2])  # it streamed before the deadline
    assert wait_until(lambda: server.service.in_use == 0 and server.service.worker.running == 0, 5)
    r = httpx.post(server.url + C, json={"prompt": "Hi", "dgemma_timeout": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dgemma_timeout"


def _stuck_tokenizer(server, monkeypatch):
    """The model's tokenizer blocks every encode until the returned event is set (and counts them)."""
    tok = server.service.model.tokenizer
    encode, release, calls = tok.encode, threading.Event(), []

    def stuck(text, *args, **kwargs):
        calls.append(text)
        release.wait(30)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", stuck)
    return release, calls


def test_the_deadline_covers_preparation(server, monkeypatch):
    """A request whose tokenizing outlasts its dgemma_timeout is answered 408 at the deadline, not after."""
    release, calls = _stuck_tokenizer(server, monkeypatch)
    try:
        r = httpx.post(server.url + C, json={"prompt": "hello", "max_tokens": 1, "dgemma_timeout": 0.5}, timeout=20)
        assert not release.is_set() and calls  # answered while its tokenizing was still stuck
        assert r.status_code == 408 and r.json()["error"]["code"] == "deadline_exceeded"
        assert server.service.in_use == 0
    finally:
        release.set()


def test_a_client_gone_during_preparation_frees_its_place(server, monkeypatch):
    release, calls = _stuck_tokenizer(server, monkeypatch)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            body = json.dumps({"prompt": "hello", "max_tokens": 1}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert wait_until(lambda: server.service.in_use == 1 and calls, 10)
        assert wait_until(lambda: server.service.in_use == 0, 5) and not release.is_set()
    finally:
        release.set()


def test_a_pipelined_request_is_not_cut_by_the_header_timeout(server, monkeypatch):
    """Two requests sent back to back on one connection; the second runs past --header-timeout (0.6 s here)
    after the first's answer, and still gets its answer."""
    release, calls = _stuck_tokenizer(server, monkeypatch)
    threading.Timer(2.0, release.set).start()  # 3x the header timeout
    body = json.dumps({"prompt": "hello", "max_tokens": 1}).encode()
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    out = raw_exchange(server, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n" + post, wait=10)
    assert out.count(b"HTTP/1.1 200") == 2 and b"request_timeout" not in out, out


def test_output_text_and_stop_strings_are_decoded_off_the_event_loop(server, monkeypatch):
    tok = server.service.model.tokenizer
    decode, threads = tok.decode, set()
    monkeypatch.setattr(tok, "decode", lambda ids, *a, **k: threads.add(threading.get_ident()) or decode(ids, *a, **k))
    r = httpx.post(server.url + C, json={"prompt": "Hello", "max_tokens": 40, "stop": ["never", "e"], "seed": 3},
                   timeout=60)
    assert r.status_code == 200 and threads and server.thread.ident not in threads  # the loop runs in that thread
