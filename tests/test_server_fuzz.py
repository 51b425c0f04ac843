"""No client input is a 5xx: the malformed bodies an attacker tried (JSON nested 70,000 deep, a hole length of
5,000 digits, tool calls of the wrong shape), then a seeded fuzz that puts random JSON values (deep, huge,
odd strings) into every field of the request schemas (/tokenize and /detokenize too); and the key is checked before a body is read."""

import json
import random

import httpx
import pytest

from dgemma.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server_fixtures import served_checkpoint, start_server

C, X, T, D = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
CHAT = [{"role": "user", "content": "Hi"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(served_checkpoint(tmp_path_factory), max_tokens=4)
    yield s
    s.stop()


def _post(server, path, body, **kwargs):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"content-type": "application/json"}, timeout=60,
                      **kwargs)


@pytest.mark.parametrize("path, body", [
    (C, '{"prompt": ' + "[" * 70_000 + "]" * 70_000 + "}"),  # over 64 KiB: parsed in a thread
    (C, '{"prompt": "x", "z": ' + "[" * 500 + "]" * 500 + "}"),  # under the recursion limit, over the cap
    (X, {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": json.loads(
        '{"type": "object", "properties": {"a": ' * 40 + '{}' + "}}" * 40)}}]}),
    (C, {"prompt": "x", "dgemma_template": "[[hole:" + "7" * 5000 + "]]"}),
    (X, {"messages": CHAT + [{"role": "assistant", "content": None, "tool_calls": [CALL | {"function": "f"}]}]}),
    (X, {"messages": CHAT + [{"role": "assistant", "content": None, "tool_calls": [CALL | {"id": ["c1"]}]}]}),
    (X, {"messages": CHAT + [{"role": "assistant", "content": None, "tool_calls": ["f"]}]}),
])
def test_malformed_bodies_are_400s(server, path, body):
    r = _post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text[:300]


def test_the_key_is_checked_before_the_body_is_read(tmp_path_factory):
    s = start_server(served_checkpoint(tmp_path_factory), api_keys=("k",))
    try:
        for body in ("x{{", '{"prompt": ' + "[" * 70_000 + "]" * 70_000 + "}", {"prompt": "hi"}):
            r = _post(s, C, body)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.url + "/openapi.json").status_code == 401
        assert httpx.get(s.url + "/openapi.json", headers={"authorization": "Bearer k"}).json()["paths"]
    finally:
        s.stop()


def _value(rng: random.Random, depth: int = 0):
    """A random JSON value, biased to what breaks parsers and validators."""
    kinds = ["null", "bool", "int", "big", "float", "str", "digits", "hole", "special", "list", "dict", "deep"]
    kind = rng.choice(kinds[:9] if depth > 2 else kinds)
    if kind in ("list", "dict"):
        items = [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
        return items if kind == "list" else {rng.choice(["name", "type", "id", "x", ""]): v for v in items}
    return {"null": None, "bool": rng.random() < 0.5, "int": rng.randint(-3, 300), "big": rng.choice([2**64, -2**70]),
            "float": rng.choice([0.5, -1.5, 1e308, 1e-300]), "str": rng.choice(["", "hi", "\u00e9\u00fc", "a" * 300]),
            "digits": "9" * rng.randint(1, 6000), "hole": rng.choice(["[[hole]]", "[[hole:0]]", "[[hole:99999]]"]),
            "special": rng.choice(["<start_of_turn>", "<bos>", "<eos>", "\x00"]),
            "deep": json.loads("[" * 80 + "]" * 80)}[kind]


def _paths(schema) -> list[str]:
    """Top-level fields of a request model, and the nested fields clients get wrong most."""
    nested = ["messages.0.content", "messages.0.role", "messages.0.tool_calls", "messages.0.tool_calls.0.function",
              "messages.0.tool_calls.0.id", "messages.0.content.0", "dgemma_sampling.t_max", "stream_options.x"]
    return list(schema.model_fields) + (nested if schema is ChatCompletionRequest else [])


def _set(body: dict, path: str, value) -> dict:
    body = json.loads(json.dumps(body))
    *keys, last = path.split(".")
    node = body
    for k in keys:  # a scalar on the way (an earlier mutation) becomes a container again
        k = int(k) if k.isdigit() else k
        if isinstance(node, list):
            node += [] if node else [{}]
            k = k if isinstance(k, int) and k < len(node) else 0
            if not isinstance(node[k], (dict, list)):
                node[k] = {}
        elif not isinstance(node.get(k), (dict, list)):
            node[k] = [{}] if last.isdigit() or k in ("messages", "tool_calls") else {}
        node = node[k]
    if isinstance(node, list):
        node[:1] = [value]
    elif isinstance(node, dict):
        node[last] = value
    return body


def test_a_fuzz_over_the_request_schemas_finds_no_5xx(server):
    rng = random.Random(23)
    bases = {C: (CompletionRequest, {"prompt": "hi", "max_tokens": 1}),
             X: (ChatCompletionRequest, {"messages": [CHAT[0] | {"tool_calls": [CALL]}], "max_tokens": 1}),
             T: (TokenizeRequest, {"messages": [CHAT[0] | {"tool_calls": [CALL]}]}),
             D: (DetokenizeRequest, {"tokens": [3]})}
    failures = []
    for _ in range(200):
        path = rng.choice(list(bases))
        schema, base = bases[path]
        body = base
        for _ in range(rng.randint(1, 2)):
            body = _set(body, rng.choice(_paths(schema)), _value(rng))
        r = _post(server, path, body)
        if r.status_code >= 500:
            failures.append((r.status_code, json.dumps(body)[:200], r.text[:200]))
    assert not failures, failures
