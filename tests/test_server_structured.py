"""Structured output, logprobs and infill through the server with the official `openai` client: response_format
json_schema and json_object, streamed and not, constrained and plain requests at once, bad schemas refused with a
400 that names response_format before any model work; completions with a suffix, a template with holes
(`dgemma_template`) or an edit of a draft (`dgemma_edit` + `dgemma_renoise`), streamed and not, their fixed text
byte-identical, bad ones 400s naming the field."""

import json
import re
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def test_json_schema_output_validates(openai_client):
    r = openai_client.chat.completions.create(model="tiny", messages=CHAT, response_format=FORMAT, max_tokens=300,
                                              seed=3, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema_rs.validate(SCHEMA, json.loads(choice.message.content))


def test_json_object(openai_client):
    r = openai_client.chat.completions.create(model="tiny", messages=CHAT, response_format={"type": "json_object"},
                                              max_tokens=400, seed=11)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_schema_streams(openai_client):
    stream = openai_client.chat.completions.create(model="tiny", messages=CHAT, response_format=FORMAT, max_tokens=300,
                                                   seed=4, stream=True)
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema_rs.validate(SCHEMA, json.loads("".join(parts)))


def test_constrained_and_plain_requests_at_once(openai_client):
    out = {}

    def ask(key, **kwargs):
        out[key] = openai_client.chat.completions.create(model="tiny", messages=CHAT, seed=5, max_tokens=300, **kwargs)

    threads = [threading.Thread(target=ask, args=("json",), kwargs={"response_format": FORMAT}),
               threading.Thread(target=ask, args=("plain",))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jsonschema_rs.validate(SCHEMA, json.loads(out["json"].choices[0].message.content))
    alone = openai_client.chat.completions.create(model="tiny", messages=CHAT, seed=5, max_tokens=300)
    assert out["plain"].choices[0].message.content == alone.choices[0].message.content


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}}, "if"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "[a-"}}},
     "unclosed"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}, "JSON object"),
    ({"type": "grammar"}, "must be text, json_object or json_schema"),
])
def test_bad_schemas_are_400s_naming_response_format(eos_server, openai_client, fmt, words):
    before = _prompt_tokens(eos_server)
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="tiny", messages=CHAT, response_format=fmt)
    error = e.value.body
    assert error["param"] == "response_format" and words in error["message"], error
    assert _prompt_tokens(eos_server) == before  # nothing was admitted, so nothing reached the model


def _prompt_tokens(server) -> str:
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    return next(line for line in lines if line.startswith("dgemma_prompt_tokens_total"))


def test_completion_with_a_suffix(openai_client):
    kwargs = dict(model="tiny", prompt="The quick brown", suffix=" over the lazy dog.", max_tokens=10, seed=2)
    r = openai_client.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 10
    plain = openai_client.completions.create(**(kwargs | {"suffix": None}))
    assert plain.choices[0].text != r.choices[0].text  # the frozen suffix changes what comes before it
    streamed = "".join(c.choices[0].text for c in openai_client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_chat_logprobs(openai_client):
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=12, seed=6, logprobs=True, top_logprobs=3)
    r = openai_client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(bytes(c.bytes).decode("utf-8", "replace") for c in content) == r.choices[0].message.content
    for c in content:  # a plain request commits each canvas's argmax: the most likely token of its distribution
        assert len(c.top_logprobs) == 3 and c.logprob <= 0 and c.logprob == pytest.approx(c.top_logprobs[0].logprob)
    streamed = [c for chunk in openai_client.chat.completions.create(**kwargs, stream=True) for ch in chunk.choices
                if ch.logprobs for c in ch.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_completion_logprobs(openai_client):
    r = openai_client.completions.create(model="tiny", prompt="The quick brown", max_tokens=10, seed=2, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 and max(top.values()) >= v for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def _completion(client, **extra):
    """(the text, its streamed text) of a completion with these dgemma extension fields."""
    kwargs = dict(model="tiny", prompt="The story:", max_tokens=16, seed=2, extra_body=extra)
    r = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert r.choices[0].finish_reason == "stop"
    return r.choices[0].text, streamed


def test_completion_template_keeps_its_fixed_text(openai_client):
    text, streamed = _completion(openai_client, dgemma_template="Alice is [[hole:4]] years and [[hole:3]].")
    assert re.fullmatch(r"Alice is (.*) years and (.*)\.", text, re.S) and streamed == text


def test_completion_edit_renoises_only_the_span(openai_client):
    draft = "The quick brown fox jumps over the lazy dog."
    text, streamed = _completion(openai_client, dgemma_edit=draft, dgemma_renoise=[[4, 9]])
    assert text.startswith("The") and text.endswith(" brown fox jumps over the lazy dog.") and streamed == text
    text, streamed = _completion(openai_client, dgemma_edit=draft, dgemma_renoise=0.3)
    assert text != draft and streamed == text


@pytest.mark.parametrize("extra, param, words", [
    ({"dgemma_template": "no holes"}, "dgemma_template", "no hole"),
    ({"dgemma_template": "[[hole:9999]]"}, "dgemma_template", "9999"),
    ({"dgemma_template": "a [[hole]]", "suffix": "x"}, "dgemma_template", "one of"),
    ({"dgemma_renoise": 0.3}, "dgemma_edit", "edit with renoise"),
    ({"dgemma_edit": "abc", "dgemma_renoise": 1.5}, "dgemma_renoise", "fraction"),
    ({"dgemma_edit": "abc", "dgemma_renoise": [[1]]}, "dgemma_renoise", "spans"),
    ({"dgemma_edit": "abc"}, "dgemma_edit", "renoise"),
])
def test_bad_templates_and_edits_are_400s_naming_the_field(openai_client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model="tiny", prompt="The story:", max_tokens=8, extra_body=extra)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
