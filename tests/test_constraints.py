"""Grammar-constrained decoding in the engine and the Python API: outputs parse and validate for random schemas
on a random tiny model and on the bundled model, constrained and unconstrained requests share a batch without
changing the unconstrained ones, regexes are matched, budgets end with "length", and bad grammars are refused
naming the parameter before any model work."""

import json
import re

import pytest

import dgemma
from dgemma import Grammar
from dgemma.bench.schemas import random_schemas
from dgemma.sampling import SamplingParams, SamplingParamsError
from server_fixtures import load_with_eos, served_checkpoint

jsonschema_rs = pytest.importorskip("jsonschema_rs")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_with_eos(served_checkpoint(tmp_path_factory))


@pytest.fixture(scope="module")
def demo():
    return dgemma.load()


def _run(model, requests, mode="diffusion", drafts=False):
    """requests: [(prompt ids, params)] decoded together; returns (text, finish_reason, drafts) per request."""
    runner = model.runner(mode, "fast", max_batch=len(requests))
    reqs = [runner.add_request(ids, p, drafts=drafts) for ids, p in requests]
    seen = {r.id: [] for r in reqs}
    for ev in runner.stream():
        if ev.kind == "draft":
            seen[ev.request_id].append(ev.token_ids)
    return [(model.tokenizer.decode(r.output), r.finish_reason, seen[r.id]) for r in reqs]


def _check_valid(results, schemas):
    for (text, reason, _), schema in zip(results, schemas):
        assert reason == "stop", (text, schema)
        jsonschema_rs.validate(schema, json.loads(text))


def test_random_schemas_on_a_random_model_always_validate(tiny):
    schemas = random_schemas(24, seed=1)
    ids = tiny.encode_prompt("Hello world, give me some JSON:")
    params = [tiny.params(grammar=Grammar.json_schema(s), seed=i, max_new_tokens=400) for i, s in enumerate(schemas)]
    _check_valid(_run(tiny, [(ids, p) for p in params]), schemas)


@pytest.mark.slow
def test_random_schemas_on_the_bundled_model_always_validate(demo):
    schemas = random_schemas(8, seed=2)
    ids = demo.encode_prompt("The king said")
    params = [demo.params(grammar=Grammar.json_schema(s), seed=i, max_new_tokens=320, max_denoising_steps=12)
              for i, s in enumerate(schemas)]
    _check_valid(_run(demo, [(ids, p) for p in params]), schemas)


def test_constrained_and_plain_requests_share_a_batch(tiny):
    """A plain request's output is the same alone and next to constrained ones (its own generator and rows)."""
    ids = tiny.encode_prompt("The quick brown fox")
    plain = tiny.params(seed=7, max_new_tokens=24)
    alone = _run(tiny, [(ids, plain)])[0]
    schemas = [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                "additionalProperties": False}, {"type": "array", "items": {"enum": ["x", 3]}, "maxItems": 9}]
    mixed = _run(tiny, [(ids, tiny.params(grammar=Grammar.json_schema(schemas[0]), seed=1, max_new_tokens=200)),
                        (ids, plain), (ids, tiny.params(grammar=Grammar.json_schema(schemas[1]), seed=2))])
    assert mixed[1][:2] == alone[:2]
    _check_valid([mixed[0], mixed[2]], schemas)


def test_regex_and_autoregressive_mode(tiny):
    pattern = r"(yes|no), [a-z]{2,8}( [a-z]{2,8}){0,3}\."
    ids = tiny.encode_prompt("Answer:")
    for mode in ("diffusion", "autoregressive"):
        p = tiny.params(grammar=Grammar.regex(pattern), seed=3, max_new_tokens=120, ar_temperature=1.0)
        text, reason, _ = _run(tiny, [(ids, p)], mode)[0]
        assert reason == "stop" and re.fullmatch(pattern, text), (mode, text)


def test_json_object_streams_drafts(tiny):
    """Any JSON object, with draft events on: the output parses (this seed closes the object)."""
    ids = tiny.encode_prompt("JSON please")
    p = tiny.params(grammar=Grammar.json_object(), seed=5, max_new_tokens=300)
    text, reason, drafts = _run(tiny, [(ids, p)], drafts=True)[0]
    assert reason == "stop" and drafts
    assert isinstance(json.loads(text), dict)


def test_max_tokens_inside_a_value_ends_with_length(tiny):
    ids = tiny.encode_prompt("Write a long string")
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 200}}, "required": ["s"]}
    text, reason, _ = _run(tiny, [(ids, tiny.params(grammar=Grammar.json_schema(schema), seed=0,
                                                    max_new_tokens=20))])[0]
    assert reason == "length" and text.startswith('{"s":"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


@pytest.mark.parametrize("grammar, words", [
    (lambda: Grammar.json_schema("{not json"), "not valid JSON"),
    (lambda: Grammar.json_schema([1, 2]), "JSON object"),
    (lambda: Grammar.json_schema({"type": "object", "if": {}}), "if"),
    (lambda: Grammar.json_schema({"type": "strin"}), "strin"),
    (lambda: Grammar.json_schema({"type": "string", "format": "bogus"}), "bogus"),
    (lambda: Grammar.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "minLength"),
    (lambda: Grammar.regex("[a-"), "unclosed"),
    (lambda: Grammar.regex(""), "empty"),
    (lambda: Grammar.lark("start: foo"), "foo"),
    (lambda: Grammar("xml", "<a/>"), "kind"),
])
def test_bad_grammars_are_refused_naming_the_parameter(grammar, words):
    with pytest.raises(SamplingParamsError, match=re.escape(words)) as e:
        SamplingParams(grammar=grammar())
    assert e.value.param == "grammar"


def test_a_regex_that_cannot_match_is_refused_before_model_work(tiny):
    g = Grammar.regex(r"[^\x00-\U0010FFFF]", param="regex")
    params = tiny.params(grammar=g)
    with pytest.raises(SamplingParamsError, match="cannot match") as e:
        tiny.check_request([2, 5], params)
    assert e.value.param == "regex"
    with pytest.raises(SamplingParamsError, match="dgemma.Grammar"):
        SamplingParams(grammar={"type": "object"})


def test_cli_regex_and_json_schema(tmp_path, capsys):
    from dgemma.cli import main

    assert main(["generate", "The king said", "--regex", "(yes|no)", "--steps", "4", "--seed", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    assert main(["generate", "The king said", "--json-schema", str(schema), "--steps", "4", "--json"]) == 0
    assert json.loads(json.loads(capsys.readouterr().out)["text"]) in ({"ok": True}, {"ok": False})
    schema.write_text('{"type": "object", "if": {}}')
    assert main(["generate", "x", "--json-schema", str(schema)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "if" in err


def test_logprobs_of_constrained_output(tiny):
    """A constrained row's committed tokens carry their log-probability under the final step's distribution:
    finite and at most the best alternative's, one entry per committed token."""
    r = tiny.generate("JSON please", grammar=Grammar.json_schema({"type": "array", "items": {"enum": [1, 2]},
                                                                  "maxItems": 3}), seed=5, logprobs=2)
    assert r.finish_reason == "stop" and [e[0] for e in r.logprobs] == r.token_ids
    assert all(lp <= alts[0][1] + 1e-6 and len(alts) == 2 and alts[0][1] >= alts[1][1] for _, lp, alts in r.logprobs)
