"""Tool calls in Gemma 4's own syntax, for a checkpoint whose chat template declares tools (a tiny checkpoint whose
tokenizer has Gemma 4's tool tokens and a Gemma-4-style template, tests/gemma4.jinja): calls the template
itself writes are sentences of the grammar and parse back to their arguments; through the server with the
`openai` client, required / named / auto / single calls validate, streamed calls equal the whole reply, the
tools and a tool-role follow-up are rendered by the template as Gemma 4 writes them."""

import json

import pytest

from server_fixtures import (check_tool_calls, gemma4_checkpoint, load_with_eos, openai_server,
                             streamed_tool_calls)

openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14},
                                         "dst": {"type": "boolean"}},
        "required": ["zone"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "opts": {"type": "object", "properties": {"deep": {"type": "boolean"}, "n": {"type": "number"}},
             "required": ["deep"]},
    "mode": {"anyOf": [{"type": "integer"}, {"enum": ["x", "y z"]}]}, "note": {"type": ["string", "null"]}},
    "required": ["tags"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "time now", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "search": NESTED}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The served tiny checkpoint's weights with Gemma 4's tokens and chat template."""
    return gemma4_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from dgemma.tokenizer import Tokenizer

    return Tokenizer(checkpoint)


@pytest.fixture(scope="module")
def served(checkpoint):
    with openai_server(checkpoint, max_concurrency=8) as pair:
        yield pair


def _template_call(tokenizer, name, arguments):
    """The ids of a model turn holding this call, as the chat template writes an earlier call."""
    messages = CHAT + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=TOOLS)
    turn = text.rsplit("<|turn>model\n", 1)[1].removesuffix("<turn|>\n")
    return tokenizer.encode(turn, add_bos=False)


@pytest.mark.parametrize("name, arguments", [
    ("get_weather", {"city": "Paris", "unit": "c"}),
    ("get_time", {"zone": -3}),
    ("get_time", {"zone": 14, "dst": True}),
    ("search", {"tags": ["a", "b c"], "opts": {"deep": False, "n": 1.5}, "mode": "y z"}),
    ("search", {"tags": [], "mode": 7, "note": None}),
])
def test_template_calls_are_sentences_of_the_grammar(tokenizer, name, arguments):
    from dgemma.sampling.constraints import GrammarVocab
    from dgemma.chat.gemma import GemmaSyntax

    syntax = GemmaSyntax.of(tokenizer)
    ids = _template_call(tokenizer, name, arguments)
    assert ids[0] == tokenizer.token_id("<|tool_call>") and ids[-1] == tokenizer.token_id("<tool_call|>")
    tools = [{"name": n, "description": "", "parameters": s} for n, s in SCHEMAS.items()]
    vocab = GrammarVocab(tokenizer.tok.to_str(), 384, (1,))
    row = vocab.matcher(syntax.grammar("required", tools, parallel=True), (1,))
    assert row.matcher.try_consume_tokens(ids + ids) == 2 * len(ids) and row.matcher.is_accepting()
    assert syntax.parse(ids + ids, tokenizer.decode) == [(name, arguments)] * 2
    cut = ids + ids[:-2]  # a reply cut by max_tokens inside its second call
    assert syntax.parse(cut, tokenizer.decode) is None
    assert syntax.parse(cut, tokenizer.decode, whole=False) == [(name, arguments)]
    single = vocab.matcher(syntax.grammar("required", tools, parallel=False), (1,))
    assert single.matcher.try_consume_tokens(ids + ids) == len(ids)  # one call only


def test_json_arguments_are_not_the_native_syntax(tokenizer):
    from dgemma.sampling.constraints import GrammarVocab
    from dgemma.chat.gemma import GemmaSyntax

    ids = _template_call(tokenizer, "get_weather", json.dumps({"city": "Paris", "unit": "c"}))
    tools = [{"name": "get_weather", "description": "", "parameters": WEATHER}]
    row = GrammarVocab(tokenizer.tok.to_str(), 384, (1,)).matcher(
        GemmaSyntax.of(tokenizer).grammar("required", tools, True), (1,))
    assert row.matcher.try_consume_tokens(ids) < len(ids)


def test_random_schemas_in_the_native_syntax_always_validate(checkpoint, tokenizer):
    """Calls generated on the random-weight model under the native grammar parse back and validate, whatever the
    model does (random schemas: nested objects, arrays, enums, ranges, patterns, optional properties)."""
    from dgemma.bench.schemas import random_schemas
    from dgemma.chat.gemma import GemmaSyntax

    model, syntax = load_with_eos(checkpoint), GemmaSyntax.of(tokenizer)
    schemas = random_schemas(16, seed=3)
    ids = model.encode_prompt(CHAT, tools=TOOLS)
    runner = model.runner("diffusion", "fast", max_batch=len(schemas))
    grammars = [syntax.grammar("required", [{"name": f"f{i}", "parameters": s}], parallel=i % 2 == 0)
                for i, s in enumerate(schemas)]
    reqs = [runner.add_request(ids, model.params(grammar=g, seed=i, max_new_tokens=400))
            for i, g in enumerate(grammars)]
    for _ in runner.stream():
        pass
    for i, (req, schema) in enumerate(zip(reqs, schemas)):
        calls = syntax.parse(req.output, tokenizer.decode)
        assert req.finish_reason == "stop" and calls and (i % 2 == 0 or len(calls) == 1), req.output
        for name, arguments in calls:
            assert name == f"f{i}"
            jsonschema_rs.validate(schema, arguments)


def test_required_named_and_single_calls(served):
    _, client = served
    r = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, seed=3, n=3)
    for choice in r.choices:
        check_tool_calls(choice, SCHEMAS)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice=named,
                                       max_tokens=200, seed=4, n=2, parallel_tool_calls=False)
    for choice in r.choices:
        check_tool_calls(choice, SCHEMAS, "get_time", count=1)


def test_auto_is_calls_or_text(served, tokenizer):
    _, client = served
    r = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=60, seed=7, n=4)
    for choice in r.choices:
        if choice.finish_reason == "tool_calls":
            check_tool_calls(choice, SCHEMAS)
        else:
            assert choice.message.tool_calls is None
    declared = tokenizer.encode(tokenizer.apply_chat_template(CHAT, tools=TOOLS), add_bos=False)
    assert r.usage.prompt_tokens == len(declared)  # the tools went through the template's declarations


def test_streamed_calls(served):
    _, client = served
    kwargs = dict(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=200, seed=5)
    deltas, reason, whole = streamed_tool_calls(client, **kwargs)
    check_tool_calls(whole, SCHEMAS)
    assert reason == "tool_calls" and [d.index for d in deltas] == list(range(len(whole.message.tool_calls)))
    assert [(d.function.name, d.function.arguments) for d in deltas] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_tool_result_follow_up(served, tokenizer, choice):
    _, client = served
    first = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, seed=6)
    calls = first.choices[0].message.tool_calls
    results = [{"role": "tool", "tool_call_id": c.id, "content": '{"sky": "sunny", "c": 21}'} for c in calls]
    follow = CHAT + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]}] + results
    r = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, tool_choice=choice, max_tokens=8,
                                       seed=6)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Gemma 4's own form: the calls with argument objects and their results as tool_responses of that turn
    native = CHAT + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in calls],
        "tool_responses": [{"name": c.function.name, "response": {"sky": "sunny", "c": 21}} for c in calls]}]
    text = tokenizer.apply_chat_template(native, tools=TOOLS)
    assert text.endswith("<tool_response|>")  # the model continues its own turn
    assert r.usage.prompt_tokens == len(tokenizer.encode(text, add_bos=False))


@pytest.mark.parametrize("parameters, words", [
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
    ({"type": "object", "properties": {"a b": {"type": "string"}}}, "property name"),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}, "format"),
])
def test_schemas_outside_the_syntax_are_400s_naming_tools(served, parameters, words):
    _, client = served
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, tools=tools, max_tokens=8)
    assert e.value.body["param"] == "tools" and words in e.value.body["message"], e.value.body


def test_python_api_native_calls(checkpoint, tokenizer):
    """`Model.generate(messages, tools=...)` on the same checkpoint: the Result's call is the one its ids hold, as
    the chat template writes that call back (text with the control tokens), and it validates."""
    model = load_with_eos(checkpoint)
    r = model.generate(CHAT, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_new_tokens=200,
                       seed=3)
    assert r.finish_reason == "tool_calls" and r.text is None and len(r.tool_calls) == 1
    call = r.tool_calls[0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema_rs.validate(SCHEMAS[call["function"]["name"]], arguments)
    written = _template_call(tokenizer, call["function"]["name"], arguments)
    assert tokenizer.tok.decode(r.token_ids, skip_special_tokens=False) == \
        tokenizer.tok.decode(written, skip_special_tokens=False)
    text = model.generate(CHAT, tools=TOOLS, tool_choice="none", max_new_tokens=8, seed=3)
    assert text.tool_calls is None and text.prompt_tokens == len(
        tokenizer.encode(tokenizer.apply_chat_template(CHAT, tools=TOOLS), add_bos=False))
