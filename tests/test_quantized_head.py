"""Grammar, logprobs and tool calls on models whose embedding / LM head is quantized (int8, int4, a Q4_0 GGUF file),
through the Python API and through the server: they all read logits through the model's one head, which runs the
quantized weight's own matmul (before, `h @ embedding.T` raised AttributeError on an IntWeight)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import write_gguf

import dgemma
from dgemma.quant import QuantizedWeight
from dgemma.sampling import Grammar

openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}
KINDS = ("int8", "int4", "gguf-q4_0")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random checkpoint (hidden 64: every group of 32 fits) with a Gemma-style tokenizer and EOS ids."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from build_bench_checkpoint import build
    from gguf_checkpoint import prepare

    directory = tmp_path_factory.mktemp("qhead") / "ckpt"
    build(directory, hidden=64, layers=2, vocab=512, canvas=16, experts=4)
    prepare(directory)
    write_gguf(directory, directory.parent / "m.gguf", Q.Q4_0)
    return directory


def _load(checkpoint: Path, kind: str):
    model = dgemma.load(checkpoint.parent / "m.gguf") if kind.startswith("gguf") else dgemma.load(checkpoint,
                                                                                                   quantize=kind)
    assert isinstance(model.module.embed_tokens.weight, QuantizedWeight)
    return model


def _check_logprobs(entries, ids, top):
    assert [e[0] for e in entries] == ids and ids
    for _, lp, alts in entries:
        assert len(alts) == top and alts[0][1] >= alts[1][1] and lp <= alts[0][1] + 1e-5 and lp <= 0


@pytest.mark.parametrize("kind", KINDS)
def test_python_api(checkpoint, kind):
    model = _load(checkpoint, kind)
    r = model.generate("Hello", grammar=Grammar.json_schema(SCHEMA), max_new_tokens=64, seed=1, logprobs=2)
    assert r.finish_reason == "stop"
    jsonschema_rs.validate(SCHEMA, json.loads(r.text))
    _check_logprobs(r.logprobs, r.token_ids, 2)
    plain = model.generate("Hello", max_new_tokens=20, seed=2, logprobs=2)
    _check_logprobs(plain.logprobs, plain.token_ids, 2)
    auto = model.generate("Hello", mode="autoregressive", grammar=Grammar.json_schema(SCHEMA), max_new_tokens=64)
    jsonschema_rs.validate(SCHEMA, json.loads(auto.text))


@pytest.mark.parametrize("kind", KINDS)
def test_python_api_tools(checkpoint, kind):
    """Tool calls through `Model.generate(messages, tools=...)`: the calls validate under the tool's schema."""
    model = _load(checkpoint, kind)
    tool = {"type": "function", "function": {"name": "pick", "description": "pick", "parameters": SCHEMA}}
    r = model.generate([{"role": "user", "content": "call"}], tools=[tool], tool_choice="required",
                       max_new_tokens=64, seed=4)
    assert r.finish_reason == "tool_calls" and r.tool_calls
    for call in r.tool_calls:
        assert call["function"]["name"] == "pick"
        jsonschema_rs.validate(SCHEMA, json.loads(call["function"]["arguments"]))


def test_head_is_the_quantized_weights_matmul(checkpoint):
    """The head's logits are softcap * tanh(h @ W.T / softcap) with W the dequantized embedding (computed here
    from the float rows the quantized weight decodes, in float32)."""
    model = _load(checkpoint, "int4").module
    h = torch.randn(3, model.cfg.text.hidden_size, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    w = model.embed_tokens.weight.dequantize(dtype=torch.float32)
    cap = model.cfg.text.final_logit_softcapping
    want = cap * torch.tanh(h.float() @ w.T / cap)
    torch.testing.assert_close(model.head(h), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_server(checkpoint, kind):
    from server_fixtures import start_server

    server = start_server(checkpoint, loader=lambda: _load(checkpoint, kind))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}],
                                           response_format=fmt, max_tokens=64, seed=3, logprobs=True, top_logprobs=2)
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and len(choice.logprobs.content) == r.usage.completion_tokens
        jsonschema_rs.validate(SCHEMA, json.loads(choice.message.content))
        tool = {"type": "function", "function": {"name": "pick", "description": "pick", "parameters": SCHEMA}}
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "call"}],
                                           tools=[tool], tool_choice="required", max_tokens=64, seed=4)
        for call in r.choices[0].message.tool_calls:
            jsonschema_rs.validate(SCHEMA, json.loads(call.function.arguments))
    finally:
        server.stop()
