"""Tool calls through the Python API (`Model.generate(messages, tools=...)`) on the bundled model, whose chat
template declares no tools: the JSON fallback. The calls in a Result are the ones in its own token ids (decoded and
parsed here as JSON), in OpenAI's shape, with arguments valid under the tool's schema; without tools the reply is
text; earlier calls and their results are rendered into the prompt; conflicting options are refused."""

import json

import pytest

import dgemma
from dgemma.sampling import Grammar, SamplingParamsError

jsonschema_rs = pytest.importorskip("jsonschema_rs")

TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14},
                                         "dst": {"type": "boolean"}},
        "required": ["zone"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "time now", "parameters": TIME}},
         {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": CITY}}]
SCHEMAS = {"get_time": TIME, "get_weather": CITY}
CHAT = [{"role": "user", "content": "What time is it in Paris?"}]


@pytest.fixture(scope="module")
def demo():
    return dgemma.load()


def _check_calls(model, r, names=None):
    """The Result's calls equal the JSON lines of its own decoded ids, validate, and carry ids."""
    assert r.finish_reason == "tool_calls" and r.text is None and r.tool_calls
    lines = [json.loads(line) for line in model.tokenizer.decode(r.token_ids).split("\n")]
    assert [(c["name"], c["arguments"]) for c in lines] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in r.tool_calls]
    for call in r.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert names is None or call["function"]["name"] in names
        jsonschema_rs.validate(SCHEMAS[call["function"]["name"]], json.loads(call["function"]["arguments"]))


@pytest.mark.parametrize("choice, parallel, names", [
    ("required", None, None),
    ({"type": "function", "function": {"name": "get_weather"}}, False, {"get_weather"}),
])
def test_required_and_named_calls(demo, choice, parallel, names):
    r = demo.generate(CHAT, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, max_new_tokens=64, seed=3)
    _check_calls(demo, r, names)
    assert parallel is not False or len(r.tool_calls) == 1


def test_auto_is_calls_or_text_and_none_is_text(demo):
    for seed in range(3):
        r = demo.generate(CHAT, tools=TOOLS, max_new_tokens=40, seed=seed)
        if r.finish_reason == "tool_calls":
            _check_calls(demo, r)
        else:
            assert r.tool_calls is None and r.text == demo.tokenizer.decode(r.token_ids)
            assert not r.text.startswith("{")
    r = demo.generate(CHAT, tools=TOOLS, tool_choice="none", max_new_tokens=8, seed=0)
    assert r.tool_calls is None and r.finish_reason in ("stop", "length") and r.text is not None


def test_stream_holds_the_text_and_ends_with_the_calls(demo):
    events = list(demo.stream(CHAT, drafts=False, tools=TOOLS, tool_choice="required", max_new_tokens=64, seed=3))
    assert all(e.text == "" for e in events) and events[-1].kind == "done"
    assert events[-1].finish_reason == "tool_calls"
    whole = demo.generate(CHAT, tools=TOOLS, tool_choice="required", max_new_tokens=64, seed=3)
    result = events[-1].result
    assert result.token_ids == whole.token_ids
    assert [c["function"] for c in result.tool_calls] == [c["function"] for c in whole.tool_calls]


def test_earlier_calls_and_results_are_in_the_prompt(demo):
    messages = CHAT + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_time", "arguments": {"zone": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    text = demo.tokenizer.decode(demo.encode_prompt(messages, tools=TOOLS))
    assert '{"name":"get_time","arguments":{"zone":1}}' in text
    assert "Result of function get_time (call c1):\n12:00" in text
    assert '{"name":"get_weather","description":"weather","parameters":' in text  # the system block


def test_content_given_as_text_parts_renders_as_its_text(demo):
    """OpenAI messages may carry their content as a list of text parts: with tools the system block joins a
    system message's parts, and a tool result's parts are its text, as if each content were the one string; with
    or without tools, a control token's text in a part stays text (as in a string content: encode_chat)."""
    def parts(text):
        return [{"type": "text", "text": text[:3]}, {"type": "text", "text": text[3:]}]

    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": 1}}}
    plain = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Time <eos> in Paris?"},
             {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    split = [m | {"content": parts(m["content"])} if m.get("content") else m for m in plain]
    assert demo.encode_prompt(split, tools=TOOLS) == demo.encode_prompt(plain, tools=TOOLS)
    assert demo.encode_prompt(split[:2]) == demo.encode_prompt(plain[:2])


@pytest.mark.parametrize("prompt, options, param", [
    ("What time is it?", {}, "tools"),
    (CHAT, {"grammar": Grammar.json_schema(TIME)}, "grammar"),
    (CHAT, {"logprobs": 1}, "logprobs"),
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ([{"role": "tool", "content": "x"}], {}, "messages"),
])
def test_refused(demo, prompt, options, param):
    with pytest.raises(SamplingParamsError) as e:
        demo.generate(prompt, tools=TOOLS, max_new_tokens=4, **options)
    assert e.value.param == param
