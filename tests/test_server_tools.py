"""Tool calls through the server with the official `openai` client: required and named calls parse and their
arguments validate against the tool's schema, streamed calls arrive as one tool_calls delta, a follow-up turn
with the call and a tool result is rendered into the prompt, bad tools / tool_choice are 400s naming the field."""

import json

import pytest

from server_fixtures import load_with_eos, served_checkpoint, start_server

openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "time now", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = served_checkpoint(tmp_path_factory)
    s = start_server(checkpoint, loader=lambda: load_with_eos(checkpoint), max_concurrency=8)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema_rs.validate(SCHEMAS[call.function.name], json.loads(call.function.arguments))


def test_required_call_validates(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, seed=3, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0])


def test_named_tool_choice(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice=choice,
                                       max_tokens=200, seed=4)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_call(r.choices[0].message.tool_calls[0], "get_time")


def test_none_is_plain_text(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="none",
                                       max_tokens=12, seed=4)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_streamed_call(client):
    kwargs = dict(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=200, seed=5)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    calls, reasons = [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    assert reasons[-1] == "tool_calls" and len(calls) == 1
    _check_call(calls[0])
    assert (calls[0].function.name, calls[0].function.arguments) == (whole.function.name, whole.function.arguments)


def test_tool_result_follow_up(client, server):
    first = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, seed=6)
    call = first.choices[0].message.tool_calls[0]
    follow = CHAT + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, seed=6)
    assert r.choices[0].message.content is not None
    longer = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, seed=6)
    assert r.usage.prompt_tokens > longer.usage.prompt_tokens + len("sunny, 21 C") // 4  # the result is in the prompt


@pytest.mark.parametrize("kwargs, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}]},
     "tools", "if"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools", "JSON schema"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "send one"),
])
def test_bad_tools_are_400s_naming_the_field(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, **kwargs)
    error = e.value.body
    assert error["param"] == param and words in error["message"], error


def test_auto_is_a_call_or_plain_text(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=60, seed=7, n=4)
    for choice in r.choices:
        if choice.finish_reason == "tool_calls":
            _check_call(choice.message.tool_calls[0])
        else:
            assert choice.message.tool_calls is None and not choice.message.content.startswith("{")
