"""The budget rule of constrained output (sampling/budget.py): the searched completion is valid and, with its
EOS, within twice the tokens of a minimal instance built from the schema alone (dgemma/bench/schemas.py); on
the bundled model random schemas with free strings (no maxLength) end complete, parse and validate within
max_tokens = 2x that minimal answer, and within the searched minimum + 1; an answer that cannot fit still ends
with "length"."""

import json

import pytest

import dgemma
from dgemma import Grammar
from dgemma.bench.schemas import minimal_tokens, random_schemas

jsonschema_rs = pytest.importorskip("jsonschema_rs")

@pytest.fixture(scope="module")
def demo():
    return dgemma.load()


def _run(model, schemas, budgets, seed=0, mode="diffusion"):
    runner = model.runner(mode, "fast", max_batch=len(schemas))
    ids = model.encode_prompt("Describe a person as JSON:")
    reqs = [runner.add_request(ids, model.params(grammar=Grammar.json_schema(s), seed=seed + i, max_new_tokens=b))
            for i, (s, b) in enumerate(zip(schemas, budgets))]
    for _ in runner.stream():
        pass
    return [(model.tokenizer.decode(r.output), r.finish_reason, len(r.output)) for r in reqs]


def _searched(model, schema) -> list[int]:
    row = model.grammar_vocab().matcher(Grammar.json_schema(schema), (1,))
    return model.grammar_vocab().completions.shortest(row.matcher, 10_000)


def test_searched_completion_is_valid_and_short(demo):
    """Valid, and with its EOS within 2x the minimal instance's tokens (what the 2x budget below needs)."""
    for schema in random_schemas(40, seed=5, free=True):
        found = _searched(demo, schema)
        jsonschema_rs.validate(schema, json.loads(demo.tokenizer.decode(found)))
        assert len(found) + 1 <= 2 * minimal_tokens(demo.tokenizer, schema), schema


@pytest.mark.parametrize("scale", [2.0, 1.0])
def test_free_strings_end_valid_within_their_budget(demo, scale):
    """scale 2: max_tokens = 2x the minimal instance's tokens (the issue's bound); scale 1: the searched
    minimum + 1 for the EOS, the least budget the rule promises a valid answer in."""
    schemas = random_schemas(8, seed=7, free=True)
    budgets = [int(scale * minimal_tokens(demo.tokenizer, s)) if scale > 1 else len(_searched(demo, s)) + 1
               for s in schemas]
    for (text, reason, n), schema, budget in zip(_run(demo, schemas, budgets), schemas, budgets):
        assert reason == "stop" and n < budget, (text, schema)
        jsonschema_rs.validate(schema, json.loads(text))


def test_autoregressive_mode_keeps_the_budget_too(demo):
    schemas = random_schemas(4, seed=7, free=True)
    budgets = [2 * minimal_tokens(demo.tokenizer, s) for s in schemas]
    for (text, reason, _), schema in zip(_run(demo, schemas, budgets, mode="autoregressive"), schemas):
        assert reason == "stop", text
        jsonschema_rs.validate(schema, json.loads(text))


def test_an_answer_that_cannot_fit_ends_with_length(demo):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}}, "required": ["s"]}
    text, reason, n = _run(demo, [schema], [12])[0]
    assert reason == "length" and n == 12 and text.startswith('{"s":"')


@pytest.mark.parametrize("parallel", [False, True])
def test_a_tool_call_with_a_free_string_ends_valid(demo, parallel):
    """The text-format tool-call grammar the server builds (dgemma/chat/tools.py), max_tokens = 2x the minimal
    call's tokens: one whole call whose arguments validate."""
    from dgemma.chat.tools import ToolUse

    params = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    grammar = ToolUse.of(tools, "required", parallel, None, False).grammar()
    call = {"name": "get_weather", "arguments": {"city": ""}}
    budget = 2 * len(demo.tokenizer.encode(json.dumps(call, separators=(",", ":")), add_bos=False))
    runner = demo.runner("diffusion", "fast", max_batch=2)
    ids = demo.encode_prompt("Weather in Paris? Write a long city name.")
    reqs = [runner.add_request(ids, demo.params(grammar=grammar, seed=s, max_new_tokens=budget)) for s in (0, 1)]
    for _ in runner.stream():
        pass
    for r in reqs:
        text = demo.tokenizer.decode(r.output)
        assert r.finish_reason == "stop", text
        for line in text.splitlines():
            got = json.loads(line)
            assert got["name"] == "get_weather"
            jsonschema_rs.validate(params, got["arguments"])
