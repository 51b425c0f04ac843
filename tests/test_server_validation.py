"""Bad input gets a 4xx OpenAI error object (every item of server.md's validation list), schemathesis finds no
5xx, and the security rules hold: API keys per route, Host headers on loopback, CORS off unless configured."""

import json

import httpx
import pytest

from server_fixtures import served_checkpoint, start_server

CHAT = [{"role": "user", "content": "Hi"}]
C, X = "/v1/completions", "/v1/chat/completions"
JSON = {"content-type": "application/json"}
LIMITS = dict(max_n=4, max_stop=4, max_stop_chars=32, max_prompt_tokens=128, max_tokens=200_000,
              max_body_bytes=64 << 10)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return served_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(checkpoint):
    s = start_server(checkpoint, **LIMITS)
    yield s
    s.stop()


BAD = [
    # (id, path, body: JSON-encoded, or a str sent as is, status, param); the type is always invalid_request_error
    ("invalid json", X, 'x{{', 400, None),
    ("json list", X, [], 400, None),
    ("json number", X, "42", 400, None),
    ("json null", X, "null", 400, None),
    ("json string", X, '"hello"', 400, None),
    ("empty body", C, "", 400, None),
    ("nested too deep", C, '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", 400, None),
    ("NaN", C, '{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("Infinity", C, '{"prompt": "hi", "max_tokens": Infinity}', 400, "max_tokens"),
    ("lone surrogate", C, '{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("prompt wrong type", C, {"prompt": 5}, 400, "prompt"),
    ("prompt missing", C, {}, 400, "prompt"),
    ("prompt empty", C, {"prompt": ""}, 400, "prompt"),
    ("prompt empty list", C, {"prompt": []}, 400, "prompt"),
    ("prompt list of empty", C, {"prompt": ["hi", ""]}, 400, "prompt"),
    ("prompt empty ids", C, {"prompt": [[]]}, 400, "prompt"),
    ("token id over vocab", C, {"prompt": [5, 384]}, 400, "prompt"),
    ("token id negative", C, {"prompt": [5, -1]}, 400, "prompt"),
    ("token id huge", C, {"prompt": [5, 10**30]}, 400, "prompt"),
    ("token id bool", C, {"prompt": [5, True]}, 400, "prompt"),
    ("prompt over the prompt limit", C, {"prompt": "hello " * 300}, 400, "prompt"),
    ("max_tokens string", C, {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens bool", C, {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("max_tokens zero", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens over the server cap", C, {"prompt": "hi", "max_tokens": 300_000}, 400, "max_tokens"),
    ("max_tokens huge", C, {"prompt": "hi", "max_tokens": 2**70}, 400, "max_tokens"),
    ("max_completion_tokens zero", X, {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("temperature string", C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("temperature negative", C, {"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("temperature over 2", C, {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("top_p zero", C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p over 1", C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("n float", C, {"prompt": "hi", "n": 1.5}, 400, "n"),
    ("n zero", C, {"prompt": "hi", "n": 0}, 400, "n"),
    ("n negative", C, {"prompt": "hi", "n": -2}, 400, "n"),
    ("n over the cap", C, {"prompt": "hi", "n": 5}, 400, "n"),
    ("n x prompts over the cap", C, {"prompt": ["a", "b", "c"], "n": 2}, 400, "n"),
    ("seed float", C, {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("seed string", C, {"prompt": "hi", "seed": "1"}, 400, "seed"),
    ("seed negative", C, {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("seed over 64 bits", C, {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("stream string", C, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("stop wrong type", X, {"messages": CHAT, "stop": 5}, 400, "stop"),
    ("stop empty string", C, {"prompt": "hi", "stop": ""}, 400, "stop"),
    ("stop empty in list", C, {"prompt": "hi", "stop": ["a", ""]}, 400, "stop"),
    ("stop too many", C, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("stop too long", C, {"prompt": "hi", "stop": "x" * 33}, 400, "stop"),
    ("stream_options wrong type", X, {"messages": CHAT, "stream": True, "stream_options": "x"}, 400,
     "stream_options"),
    ("stream_options without stream", X, {"messages": CHAT, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("drafts without stream", C, {"prompt": "hi", "dgemma_drafts": True}, 400, "dgemma_drafts"),
    ("unknown dgemma_sampling field", C, {"prompt": "hi", "dgemma_sampling": {"early_comit": 2}}, 400,
     "dgemma_sampling.early_comit"),
    ("early_commit_cache without early_commit", C, {"prompt": "hi", "dgemma_sampling": {"early_commit_cache": True}},
     400, "dgemma_sampling.early_commit_cache"),
    ("early_first_token with a schema", X, {"messages": CHAT, "dgemma_sampling": {"early_first_token": True},
                                             "response_format": {"type": "json_object"}},
     400, "dgemma_sampling.early_first_token"),
    ("soft_top_k zero", C, {"prompt": "hi", "dgemma_sampling": {"soft_top_k": 0}}, 400, "dgemma_sampling.soft_top_k"),
    ("skip_settled float", C, {"prompt": "hi", "dgemma_sampling": {"skip_settled": 1.5}}, 400,
     "dgemma_sampling.skip_settled"),
    ("messages missing", X, {"model": "tiny"}, 400, "messages"),
    ("messages null", X, {"messages": None}, 400, "messages"),
    ("messages a string", X, {"messages": "hello"}, 400, "messages"),
    ("messages empty", X, {"messages": []}, 400, "messages"),
    ("messages [123]", X, {"messages": [123]}, 400, "messages[0]"),
    ("messages [{}]", X, {"messages": [{}]}, 400, "messages[0].role"),
    ("message without content", X, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("message content null", X, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ("message content number", X, {"messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content"),
    ("unknown role", X, {"messages": [{"role": "bot", "content": "hi"}]}, 400, "messages[0].role"),
    ("tool role without tool_call_id", X, {"messages": [{"role": "tool", "content": "hi"}]}, 400,
     "messages[0].tool_call_id"),
    ("user content null with tool_calls", X, {"messages": [{"role": "user", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     400, "messages[0].content"),
    ("image part", X, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://x/y.png"}}]}]}, 400, "messages[0].content[0]"),  # not fetched (tests/test_vision_server.py)
    ("top_logprobs without logprobs", X, {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("too many top_logprobs", X, {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("tools with a bad schema", X, {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "strin"}}}]}, 400, "tools"),
    ("response_format xml", X, {"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("json_schema without schema", X, {"messages": CHAT, "response_format": {"type": "json_schema",
                                                                            "json_schema": {"name": "x"}}},
     400, "response_format"),
    ("invalid json schema", X, {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, 400, "response_format"),
    ("functions", X, {"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ("function_call", X, {"messages": CHAT, "function_call": {"name": "f"}}, 400, "function_call"),
    ("parallel_tool_calls not a bool", X, {"messages": CHAT, "parallel_tool_calls": "yes"}, 400,
     "parallel_tool_calls"),
    ("audio modality", X, {"messages": CHAT, "modalities": ["text", "audio"]}, 400, "modalities"),
    ("audio", X, {"messages": CHAT, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    ("prediction", X, {"messages": CHAT, "prediction": {"type": "content", "content": "x"}}, 400, "prediction"),
    ("reasoning effort", X, {"messages": CHAT, "reasoning_effort": "high"}, 400, "reasoning_effort"),
    ("presence penalty out of range", C, {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("logit bias out of range", C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit bias not an id", C, {"prompt": "hi", "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ("top_k not an integer", C, {"prompt": "hi", "top_k": 2.5}, 400, "top_k"),
    ("min_p over 1", C, {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("echo", C, {"prompt": "hi", "echo": True}, 400, "echo"),
    ("best_of", C, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("suffix without an EOS id", C, {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
]


@pytest.mark.parametrize("path, body, status, param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(server, path, body, status, param):
    kwargs = {"content": body, "headers": JSON} if isinstance(body, str) else {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_fields_are_named_in_a_header(server, stream):
    """Fields OpenAI does not define are ignored and listed in X-Dgemma-Ignored-Fields; defaults of the refused
    ones (text-only modalities) are accepted."""
    body = {"messages": CHAT, "max_tokens": 2, "stream": stream, "my_vendor_option": 1, "another": "x",
            "modalities": ["text"], "parallel_tool_calls": False}
    with httpx.stream("POST", server.url + X, json=body, timeout=60) as r:
        r.read()
    assert r.status_code == 200, r.text
    assert r.headers["x-dgemma-ignored-fields"] == "another, my_vendor_option"
    odd = httpx.post(server.url + X, json={"messages": CHAT, "max_tokens": 2, "é\r\nX-Evil: 1": 1, "ok": 2})
    assert odd.status_code == 200 and odd.headers["x-dgemma-ignored-fields"] == "ok, +1 others"
    assert "x-evil" not in odd.headers
    plain = httpx.post(server.url + X, json={"messages": CHAT, "max_tokens": 2}, timeout=60)
    assert plain.status_code == 200 and "x-dgemma-ignored-fields" not in plain.headers


def test_context_overflow_states_both_counts_even_when_streaming(server):
    for stream in (False, True):
        r = httpx.post(server.url + C, json={"prompt": [5, 6, 7], "max_tokens": 131_070, "stream": stream})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        message = r.json()["error"]["message"]
        assert "3 tokens" in message and "131070" in message and "131072" in message


@pytest.mark.parametrize("headers, content", [
    ({"content-type": "text/plain"}, json.dumps({"prompt": "hi"})),
    ({"content-type": "application/x-www-form-urlencoded"}, "prompt=hi"),
    ({}, json.dumps({"prompt": "hi"})),
])
def test_wrong_content_type(server, headers, content):
    r = httpx.post(server.url + C, content=content, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_route_and_method(server):
    r = httpx.post(server.url + C, json={"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/v1/models/gpt-4").status_code == 404
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + C)
    assert r.status_code == 405 and "error" in r.json()


def test_oversized_bodies_and_headers_are_refused(server):
    big = {"prompt": "x" * (65 << 10)}
    r = httpx.post(server.url + C, json=big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

    def chunks():  # no Content-Length: the cap applies while reading
        for _ in range(80):
            yield b"x" * 1024

    r = httpx.post(server.url + C, content=chunks(), headers=JSON)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(server.url + "/health", headers={"x-big": "y" * (40 << 10)})
    assert r.status_code == 431 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200  # and the server lives on


def test_valid_edge_values_are_accepted(server):
    ok = [
        {"prompt": "hi", "max_tokens": 1, "temperature": 0, "top_p": 1, "seed": 2**64 - 1, "stop": []},
        {"prompt": [[5, 6], [7]], "max_tokens": 2, "n": 2},
        {"prompt": "hi", "max_tokens": 1, "temperature": 2, "presence_penalty": 0, "logit_bias": {}, "user": "u"},
    ]
    for body in ok:
        r = httpx.post(server.url + C, json=body, timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(server.url + X, json={"messages": [{"role": "developer", "content": "Be brief."}, {
        "role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_completion_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- schemathesis ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_server_error(server, mode):
    """Every operation of /openapi.json, a bounded number of generated requests each: no 5xx, and only
    documented statuses, content types and response shapes."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 13
    for operation in operations:
        @given(case=operation.as_strategy(GenerationMode(mode)))
        @settings(max_examples=12, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            case.call_and_validate(timeout=60, checks=checks)

        try:
            run()
        except Unsatisfiable:  # negative mode on an operation without inputs (GET /health)
            assert mode == "negative"


# ---- security -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(checkpoint):
    s = start_server(checkpoint, api_keys=("key-one", "key-two"))
    yield s
    s.stop()


PROTECTED = [("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None), ("GET", "/metrics", None),
             ("POST", C, {"prompt": "hi", "max_tokens": 1}), ("POST", X, {"messages": CHAT, "max_tokens": 1})]


@pytest.mark.parametrize("method, path, body", PROTECTED)
def test_api_key_is_enforced_per_route(keyed, method, path, body):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer key-one2"},
                    {"authorization": "Basic a2V5LW9uZTo="}, {"authorization": "key-one"}):
        r = httpx.request(method, keyed.url + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error" and "key-one" not in r.text
    for key in ("key-one", "key-two"):
        r = httpx.request(method, keyed.url + path, json=body, headers={"authorization": f"Bearer {key}"},
                          timeout=60)
        assert r.status_code == 200


def test_api_key_cannot_be_bypassed(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200  # open for load balancers
    for path in ("/v1/models/", "//v1/models", "/v1/models?x=/health", "/v1/models#/health", "/health/../v1/models",
                 "/v1/./models", "/V1/models", "/v1/models%2F"):
        r = httpx.get(keyed.url + path)
        assert r.status_code != 200, path
    r = httpx.get(keyed.url + "/v1/models", headers={"host": "localhost/health"})
    assert r.status_code in (400, 401)
    # the key is checked before the body is validated
    assert httpx.post(keyed.url + C, json={"prompt": 5}).status_code == 401


def test_foreign_host_headers_are_refused_on_loopback(server):
    port = server.port
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example",
                 "10.0.0.1", ""):
        r = httpx.get(server.url + "/health", headers={"host": host})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "app.localhost", "127.0.0.2"):
        assert httpx.get(server.url + "/health", headers={"host": host}).status_code == 200, host


def test_cors_is_off_by_default_and_exact_when_configured(server, checkpoint):
    preflight = {"origin": "http://app.example", "access-control-request-method": "POST"}
    r = httpx.options(server.url + C, headers=preflight)
    assert "access-control-allow-origin" not in r.headers and r.status_code == 405
    r = httpx.get(server.url + "/health", headers={"origin": "http://app.example"})
    assert "access-control-allow-origin" not in r.headers
    s = start_server(checkpoint, cors_origins=("http://app.example",), allowed_hosts=("myhost.internal",))
    try:
        r = httpx.options(s.url + C, headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        assert "access-control-allow-credentials" not in r.headers
        r = httpx.options(s.url + C, headers=preflight | {"origin": "http://other.example"})
        assert r.headers.get("access-control-allow-origin") != "http://other.example"
        assert r.status_code == 400 and r.json()["error"]["code"] == "cors_refused"  # an OpenAI error object
        assert "origin" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/health", headers={"host": "myhost.internal"}).status_code == 200
    finally:
        s.stop()


def test_the_opt_in_savings_pass_through_dgemma_sampling(server):
    body = {"prompt": "hi", "max_tokens": 4, "seed": 0, "dgemma_sampling": {"soft_top_k": 4, "skip_settled": 1,
                                                                 "settled_kv_reuse": True}}
    r = httpx.post(server.url + C, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
