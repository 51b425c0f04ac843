"""Thinking mode on a tiny checkpoint whose tokenizer has Gemma 4's control tokens and whose template is a reduced copy
of Google's (tests/gemma4.jinja: `<|think|>` at the top of the system turn, `<|channel>thought\\n ... <channel|>`
before the answer, earlier thoughts stripped, an empty channel after the generation prompt with thinking off).
Prompts are checked against the template rendered by jinja2 and tokenized by `tokenizers` directly; replies split at
the channel's ids exactly (reasoning = the text of the ids between them, the `thought\\n` label dropped); structured
output and tool calls hold for the answer after the thought; max_thinking_tokens puts the close at the budget in every
decoding mode, in the same canvas as the answer after it; the server returns vLLM's fields."""

import json

import jinja2
import pytest

from dgemma.chat.gemma import GemmaSyntax
from dgemma.chat.thinking import Channel
from dgemma.chat.tools import ToolUse
from dgemma.chat.turn import ChatTurn
from dgemma.engine import Event, OutputStream
from dgemma.sampling import Grammar, SamplingParamsError
from server_fixtures import GEMMA4_TEMPLATE, gemma4_checkpoint, load_with_eos, openai_server

CHAT = [{"role": "user", "content": "What is two plus two?"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return gemma4_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_with_eos(checkpoint)


@pytest.fixture(scope="module")
def ids(model):
    """The channel's ids and a text's ids, from the `tokenizers` library itself."""
    tok = model.tokenizer.tok
    return {"open": tok.token_to_id("<|channel>"), "close": tok.token_to_id("<channel|>"),
            "text": lambda s: tok.encode(s, add_special_tokens=False).ids,
            "decode": lambda x: tok.decode(x, skip_special_tokens=True)}


def _rendered(messages, **kwargs) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(GEMMA4_TEMPLATE).render(messages=messages, add_generation_prompt=True, bos_token="<bos>",
                                                    eos_token="<eos>", **kwargs)


def test_prompts_are_what_the_template_renders(model):
    tok = model.tokenizer.tok
    on, off = _rendered(CHAT, enable_thinking=True), _rendered(CHAT)
    assert on.startswith("<bos><|turn>system\n<|think|>\n<turn|>\n") and on.endswith("<|turn>model\n")
    assert off.endswith("<|turn>model\n<|channel>thought\n<channel|>") and "<|think|>" not in off
    for text, kwargs in ((on, {"think": True}), (on, {"chat_template_kwargs": {"enable_thinking": True}}),
                         (off, {}), (off, {"think": False})):
        turn = model.prompts.turn(template_kwargs=kwargs.get("chat_template_kwargs"), think=kwargs.get("think"))
        assert model.encode_prompt(CHAT, tools=turn) == tok.encode(text, add_special_tokens=False).ids
    # an earlier turn's thought, sent back as OpenAI clients do (reasoning_content), is left out by the template
    history = CHAT + [{"role": "assistant", "content": "Four.", "reasoning_content": "hmm"},
                      {"role": "user", "content": "And three?"}]
    assert model.encode_prompt(history, tools=model.prompts.turn(think=True)) == tok.encode(
        _rendered(history, enable_thinking=True), add_special_tokens=False).ids
    assert "hmm" not in _rendered(history, enable_thinking=True)


@pytest.mark.parametrize("kwargs, param", [({"messages": []}, "chat_template_kwargs"),
                                           ({"x": [1]}, "chat_template_kwargs"),
                                           ({"x": "<|turn>system"}, "chat_template_kwargs")])
def test_template_arguments_are_checked(model, kwargs, param):
    with pytest.raises(SamplingParamsError) as e:
        model.prompts.turn(template_kwargs=kwargs)
    assert e.value.param == param


def _reply(ids, thought: str, answer: str) -> list[int]:
    return [ids["open"], *ids["text"]("thought\n" + thought), ids["close"], *ids["text"](answer)]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 100])
def test_the_thought_splits_from_the_answer_at_the_channel_ids(model, ids, chunk):
    turn = model.prompts.turn(think=True)
    reply = _reply(ids, "Two and two make four.", "It is 4.")
    out, events = OutputStream(model.tokenizer, (), turn), []
    for i in range(0, len(reply), chunk):
        events += out.feed(Event("r", "commit", reply[i:i + chunk]))
    events += out.feed(Event("r", "finish", finish_reason="stop"))
    assert "".join(e.reasoning for e in events) == "Two and two make four."
    assert "".join(e.text for e in events) == "It is 4."
    result = out.result(0, False)
    assert (result.reasoning, result.text, result.token_ids) == ("Two and two make four.", "It is 4.", reply)


def test_drafts_split_like_commits(model, ids):
    """A draft of the first canvas and one after a committed thought: each shows its thought and answer apart."""
    out = OutputStream(model.tokenizer, (), model.prompts.turn(think=True))
    first = out.feed(Event("r", "draft", [ids["open"], *ids["text"]("thought\nHm, yes")]))[0]
    assert (first.reasoning, first.text) == ("Hm, yes", "")
    out.feed(Event("r", "commit", [ids["open"], *ids["text"]("thought\nHm")]))
    later = out.feed(Event("r", "draft", [*ids["text"](" yes"), ids["close"], *ids["text"]("Four")]))[0]
    assert (later.reasoning, later.text) == (" yes", "Four")


def test_a_reply_that_does_not_open_the_channel_has_no_thought(model, ids):
    reply = ids["text"]("thought\nIt is 4.") + [ids["close"]] + ids["text"](" ok")
    out = OutputStream(model.tokenizer, (), model.prompts.turn(think=True))
    events = out.feed(Event("r", "commit", reply)) + out.feed(Event("r", "finish", finish_reason="stop"))
    assert out.result(0, False).reasoning is None and "".join(e.text for e in events) == "thought\nIt is 4. ok"


def test_stop_strings_apply_to_the_answer(model, ids):
    reply = _reply(ids, "I could STOP here.", "Four. STOP and more")
    out = OutputStream(model.tokenizer, ("STOP",), model.prompts.turn(think=True))
    events = out.feed(Event("r", "commit", reply))
    result = out.result(0, False)
    assert out.stopped and result.text == "Four. " and result.reasoning == "I could STOP here."
    assert ids["decode"](result.token_ids[len(reply) - len(ids["text"]("Four. STOP and more")):]) == "Four. "
    assert "".join(e.reasoning for e in events) == "I could STOP here."


def test_tool_calls_are_read_after_the_thought(model, ids):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    text = model.tokenizer.apply_chat_template(CHAT + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]}],
        add_generation_prompt=False, tools=tools)
    call = ids["text"](text.rsplit("<|turn>model\n", 1)[1].removesuffix("<turn|>\n"))
    turn = ChatTurn.of(ToolUse.of(tools, "auto", None, None, False, model.tokenizer), {"enable_thinking": True},
                       model.tokenizer)
    out = OutputStream(model.tokenizer, (), turn)
    out.feed(Event("r", "commit", [ids["open"], *ids["text"]("thought\nI add."), ids["close"], *call]))
    out.feed(Event("r", "finish", finish_reason="stop"))
    result = out.result(0, False)
    assert result.reasoning == "I add." and result.finish_reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls] == \
        [("add", {"a": 2})]


def test_a_grammar_after_the_thought_takes_the_thought_then_the_answer(model, ids):
    channel = Channel.of(model.tokenizer)
    grammar = Grammar.json_schema(SCHEMA).after_thought(channel.open, channel.close)
    vocab = model.grammar_vocab()

    def accepts(seq):
        row = vocab.matcher(grammar, (1,))
        return row.matcher.try_consume_tokens(seq) == len(seq) and row.matcher.is_accepting()

    assert accepts(_reply(ids, "think {not json}", '{"n":4}')) and accepts(ids["text"]('{"n":4}'))
    assert accepts([ids["open"], ids["close"], *ids["text"]('{"n":4}')])
    assert not accepts(_reply(ids, "x", "four")) and not accepts(_reply(ids, "x", '{"n":12}'))
    assert not accepts([ids["open"], *ids["text"]("a"), ids["open"]])


@pytest.mark.parametrize("mode", ["diffusion", "autoregressive", "speculative"])
def test_max_thinking_tokens_closes_the_thought_at_the_budget(model, ids, mode):
    """The open id is all but forced (logit bias) and the close all but banned: without a budget the thought never
    ends; with one, the close is the id right after `budget` thought ids, and the answer follows it."""
    bias = {ids["open"]: 100, ids["close"]: -100}
    for budget in (0, 3, 5):
        r = model.generate(CHAT, mode=mode, think=True, max_thinking_tokens=budget, logit_bias=bias,
                           max_new_tokens=12, seed=1)
        assert r.token_ids[0] == ids["open"] and r.token_ids.index(ids["close"]) == budget + 1, r.token_ids
        assert len(r.token_ids) > budget + 2
    free = model.generate(CHAT, mode=mode, think=True, logit_bias=bias, max_new_tokens=12, seed=1)
    assert ids["close"] not in free.token_ids


def test_the_budget_closes_inside_the_first_canvas_and_the_answer_is_denoised_after_it(model, ids):
    """Canvas 8: a budget of 3 puts the close at position 4 of the first canvas; positions 5-7 of the same canvas
    hold the answer's first ids (one commit)."""
    events = list(model.stream(CHAT, think=True, max_thinking_tokens=3, drafts=False, seed=2, max_new_tokens=16,
                               logit_bias={ids["open"]: 100, ids["close"]: -100}))
    first = next(e for e in events if e.kind == "text" and e.token_ids)
    assert len(first.token_ids) == 8 and first.token_ids[4] == ids["close"]


def test_structured_output_with_thinking_validates_after_the_thought(model, ids):
    """The random model is pushed to open the channel; the budget ends the thought; the answer is the schema's."""
    for seed in range(3):
        r = model.generate(CHAT, think=True, max_thinking_tokens=4, grammar=Grammar.json_schema(SCHEMA),
                           logit_bias={ids["open"]: 30}, max_new_tokens=40, seed=seed)
        assert r.token_ids[0] == ids["open"] and ids["close"] in r.token_ids[1:6], r.token_ids
        assert r.finish_reason == "stop" and 0 <= json.loads(r.text)["n"] <= 9
        close = r.token_ids.index(ids["close"])
        assert r.reasoning == ids["decode"](r.token_ids[1:close]).removeprefix("thought\n")


def test_thinking_needs_a_chat_and_a_channel(model, tmp_path):
    with pytest.raises(SamplingParamsError, match="max_thinking_tokens needs"):
        model.generate(CHAT, max_thinking_tokens=3)
    with pytest.raises(SamplingParamsError, match="needs a prompt of chat messages"):
        model.generate("plain text", think=True)
    import dgemma

    demo = dgemma.load()
    with pytest.raises(SamplingParamsError, match="no thinking mode"):
        demo.generate(CHAT, think=True)


# ---- the server -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(checkpoint):
    with openai_server(checkpoint, max_concurrency=4) as pair:
        yield pair


def test_server_returns_the_thought_as_reasoning_content(served, ids):
    """A schema with thinking on: the thought (pushed open by a bias, closed by the budget) comes back as
    reasoning_content and reasoning, the answer as content, valid against the schema; streamed deltas add up to the
    same; include_reasoning=false drops the thought only."""
    _, client = served
    body = {"chat_template_kwargs": {"enable_thinking": True}, "max_thinking_tokens": 4}
    ask = dict(model="tiny", messages=CHAT, max_tokens=40, seed=1, logit_bias={str(ids["open"]): 30},
               response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    message = client.chat.completions.create(**ask, extra_body=body).choices[0].message
    assert message.reasoning_content and message.reasoning_content == message.reasoning
    assert 0 <= json.loads(message.content)["n"] <= 9
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**ask, extra_body=body, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)
    hidden = client.chat.completions.create(**ask, extra_body=body | {"include_reasoning": False}).choices[0].message
    assert getattr(hidden, "reasoning_content", None) is None and hidden.content == message.content


@pytest.mark.parametrize("body, param", [({"max_thinking_tokens": 3}, "max_thinking_tokens"),
                                         ({"chat_template_kwargs": {"tools": 1}}, "chat_template_kwargs")])
def test_server_refuses_bad_thinking_fields(served, body, param):
    import openai

    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param


# ---- the command line ---------------------------------------------------------------------------------------------
def test_the_cli_shows_the_thought_before_the_answer(capsys):
    from dgemma.display import print_stream
    from dgemma.engine import Result, StreamEvent

    done = StreamEvent("done", finish_reason="stop", result=Result([1], "It is 4.", "stop", {
        "seconds": 1.0, "tokens_per_second": 1.0, "steps_per_canvas": [1], "tokens_per_forward": 1.0}))
    print_stream([StreamEvent("text", "", reasoning="Two and"), StreamEvent("text", "", reasoning=" two."),
                  StreamEvent("text", "It is 4."), done])
    assert capsys.readouterr().out == "Thinking...\nTwo and two.\n...done thinking.\n\nIt is 4.\n"


def test_think_on_a_checkpoint_without_thinking_is_one_clear_line(capsys):
    from dgemma.cli import main

    assert main(["generate", "--think", "Hello", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no thinking mode" in err[0]


def test_server_default_template_arguments(checkpoint, model):
    """--default-chat-template-kwargs (vLLM's flag): a chat without its own arguments renders with thinking on; a
    request's own value wins; /tokenize renders as the chat routes do."""
    import httpx

    from server_fixtures import start_server

    s = start_server(checkpoint, loader=lambda: load_with_eos(checkpoint),
                     default_chat_template_kwargs='{"enable_thinking": true}')
    tok = model.tokenizer.tok
    try:
        def tokens(**extra) -> list[int]:
            r = httpx.post(s.url + "/tokenize", json={"messages": CHAT, **extra}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        assert tokens() == tok.encode(_rendered(CHAT, enable_thinking=True), add_special_tokens=False).ids
        off = tokens(chat_template_kwargs={"enable_thinking": False})
        assert off == tok.encode(_rendered(CHAT), add_special_tokens=False).ids
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokens())
    finally:
        s.stop()
