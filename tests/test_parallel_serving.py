"""The feature set through `dgemma serve -tp 2` (2 gloo ranks) against one plain server, both float32 on the bundled
model: structured output (a JSON schema), a later chat turn continued from rank 0's prefix cache, logprobs with
sampling knobs, stop strings and several choices give the same text (logprobs within 1e-4)."""

import json

import httpx
import pytest

from fleet import Fleet, prefix_counters

jsonschema_rs = pytest.importorskip("jsonschema_rs")
pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
TURNS = ["Tell me about the fox.", "And the dog?"]


@pytest.fixture(scope="module")
def servers():
    pair = [Fleet("demo", 1, "--dtype", "float32", threads=1), Fleet("demo", 1, "--dtype", "float32", "-tp", "2")]
    try:
        yield [f.wait_ready(300) for f in pair]
    finally:
        assert [f.stop() for f in pair] == [0, 0]


def _post(fleet: Fleet, path: str, body: dict) -> dict:
    response = httpx.post(fleet.url + path, json={"model": "tiny", **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _both(servers, path: str, body: dict) -> list[dict]:
    return [_post(f, path, body) for f in servers]


def test_structured_output_matches_one_process(servers):
    one, tp = _both(servers, "/v1/chat/completions", {"messages": [{"role": "user", "content": "A person as JSON."}],
                                                      "response_format": FORMAT, "max_tokens": 64, "seed": 3})
    text = tp["choices"][0]["message"]["content"]
    jsonschema_rs.validate(SCHEMA, json.loads(text))
    assert text == one["choices"][0]["message"]["content"]


def test_a_later_turn_continues_from_the_prefix_cache(servers):
    messages, answers = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        replies = _both(servers, "/v1/chat/completions", {"messages": messages, "max_tokens": 24, "temperature": 0})
        answers.append([r["choices"][0]["message"]["content"] for r in replies])
        messages.append({"role": "assistant", "content": answers[-1][0]})
    assert all(one == tp for one, tp in answers)
    hits = prefix_counters(httpx.get(servers[1].url + "/metrics", timeout=10).text)["hits"]
    assert hits >= 1, "the second turn did not continue from rank 0's prefix cache"


def test_logprobs_knobs_stops_and_choices_match_one_process(servers):
    body = {"prompt": "The quick brown fox", "max_tokens": 24, "seed": 5, "n": 2, "logprobs": 2, "top_k": 20,
            "top_p": 0.9, "presence_penalty": 0.5, "logit_bias": {"9": -5}, "stop": ["."]}
    one, tp = _both(servers, "/v1/completions", body)
    assert [c["text"] for c in tp["choices"]] == [c["text"] for c in one["choices"]]
    for a, b in zip(one["choices"], tp["choices"]):
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        pairs = zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"])
        assert max(abs(x - y) for x, y in pairs) < 1e-4
