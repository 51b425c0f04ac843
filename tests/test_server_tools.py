"""Tool calls in the documented text format (the served checkpoint's template has no tool syntax) through the
server with the official `openai` client: required and named calls parse and their arguments validate against
the tool's schema, several calls per reply unless parallel_tool_calls is false, streamed calls arrive as one
delta each with its index, a follow-up turn with the call and a tool result is rendered into the prompt, bad
tools / tool_choice are 400s naming the field."""

import json

import pytest

from server_fixtures import check_tool_calls, streamed_tool_calls

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


def test_required_calls_validate(openai_client):
    r = openai_client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                              max_tokens=200, seed=3, n=3)
    for choice in r.choices:
        check_tool_calls(choice, SCHEMAS)
    ids = [c.id for choice in r.choices for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids)
    assert max(len(choice.message.tool_calls) for choice in r.choices) > 1  # parallel calls are on by default


def test_parallel_tool_calls_false_is_one_call(openai_client):
    r = openai_client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                              max_tokens=200, seed=3, n=3, parallel_tool_calls=False)
    for choice in r.choices:
        check_tool_calls(choice, SCHEMAS, count=1)


def test_named_tool_choice(openai_client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = openai_client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice=choice,
                                              max_tokens=200, seed=4)
    check_tool_calls(r.choices[0], SCHEMAS, "get_time")


def test_none_is_plain_text(openai_client):
    r = openai_client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="none",
                                              max_tokens=12, seed=4)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_streamed_calls(openai_client):
    kwargs = dict(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=200, seed=3)
    deltas, reason, whole = streamed_tool_calls(openai_client, **kwargs)
    check_tool_calls(whole, SCHEMAS)
    assert reason == "tool_calls" and [d.index for d in deltas] == list(range(len(whole.message.tool_calls)))
    assert [(d.function.name, d.function.arguments) for d in deltas] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_result_follow_up(openai_client, eos_server):
    first = openai_client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                                  max_tokens=200, seed=6)
    call = first.choices[0].message.tool_calls[0]
    follow = CHAT + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = openai_client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, tool_choice="none",
                                              max_tokens=8, seed=6)
    assert r.choices[0].message.content is not None
    longer = openai_client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="none",
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
def test_bad_tools_are_400s_naming_the_field(openai_client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, **kwargs)
    error = e.value.body
    assert error["param"] == param and words in error["message"], error


def test_auto_is_a_call_or_plain_text(openai_client):
    r = openai_client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=60, seed=7, n=4)
    for choice in r.choices:
        if choice.finish_reason == "tool_calls":
            check_tool_calls(choice, SCHEMAS)
        else:
            assert choice.message.tool_calls is None and not choice.message.content.startswith("{")


def test_a_reply_cut_by_max_tokens_keeps_its_complete_calls():
    from dgemma.chat.tools import ToolUse

    use = ToolUse.of(TOOLS, "required", None, None, False)
    text = '{"name":"get_time","arguments":{"zone":3}}\n{"name":"get_weather","arguments":{"ci'
    message, reason = use.reply(text, [], "length", None)
    assert reason == "length" and [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"zone": 3}
    assert use.reply(text.split("\n")[0], [], "stop", None)[1] == "tool_calls"
    assert use.reply(text, [], "stop", None) == ({"role": "assistant", "content": text}, "stop")
