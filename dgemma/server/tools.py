"""Tool calls on /v1/chat/completions for chat templates without tool syntax: the tools are described in a system
block, the reply is held to a grammar built from their parameter schemas, and a JSON call in the output becomes
OpenAI `tool_calls`; earlier calls and `role: "tool"` results are rendered back into the prompt as text."""

from __future__ import annotations

import json
import uuid
from typing import Any

from dgemma.sampling import Grammar, SamplingParamsError
from dgemma.sampling.constraints import JSON_OPTIONS

PREAMBLE = ("You can call these functions. To call one, reply with only a JSON object "
            '{"name": <function name>, "arguments": <its arguments as a JSON object>} and nothing else.')
AUTO = "Otherwise reply with plain text (not starting with '{')."


def check_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI `tools` -> [{"name", "description", "parameters"}]; each parameter schema must compile."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise SamplingParamsError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name or any(t["name"] == name for t in out):
            raise SamplingParamsError(f"tools[{i}].function.name must be a new non-empty string", "tools")
        if not isinstance(params, dict):
            raise SamplingParamsError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        try:
            Grammar.json_schema(params, "tools").check()
        except SamplingParamsError as e:
            raise SamplingParamsError(f"tools[{i}] ({name}): {e}", "tools") from None
        out.append({"name": name, "description": str(fn.get("description", "")), "parameters": params})
    return out


def mode(tools: list[dict[str, Any]], choice: str | dict[str, Any] | None, response_format: dict[str, Any] | None,
         logprobs: bool) -> tuple[str, list[dict[str, Any]]]:
    """A chat request's (mode, callable tools), its fields checked; raises SamplingParamsError naming the field."""
    kind, callable_tools = choose(check_tools(tools), choice)
    if kind != "none" and response_format not in (None, {"type": "text"}):
        raise SamplingParamsError('response_format and tools both constrain the reply; send one (or tool_choice '
                                  '"none")', "response_format")
    if kind != "none" and logprobs:
        raise SamplingParamsError("logprobs are not supported with tools", "logprobs")
    return kind, callable_tools


def missing(field: str, message: dict[str, Any]) -> str | None:
    """Why a chat message's `content` / `tool_call_id` cannot be null here, or None when it can."""
    if field == "content" and not (message.get("role") == "assistant" and message.get("tool_calls")):
        return "content is required (null only in an assistant message with tool_calls)"
    if field == "tool_call_id" and message.get("role") == "tool":
        return "a tool message needs the tool_call_id it answers"
    return None


def choose(tools: list[dict[str, Any]], choice: str | dict[str, Any] | None) -> tuple[str, list[dict[str, Any]]]:
    """(mode, callable tools): mode "none" (plain text), "auto" (a call or text) or "required" (a call)."""
    if choice is None:
        return ("auto" if tools else "none"), tools
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise SamplingParamsError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice, tools
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise SamplingParamsError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}', "tool_choice")
    picked = [t for t in tools if t["name"] == name]
    if not picked:
        raise SamplingParamsError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return "required", picked


def grammar(mode: str, tools: list[dict[str, Any]]) -> Grammar | None:
    """A call: {"name": one tool's name, "arguments": that tool's schema}, compact JSON; "auto" also allows text
    that does not start with "{" (a Lark alternation)."""
    if mode == "none":
        return None
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools],
            "x-guidance": JSON_OPTIONS}
    if mode == "required":
        return Grammar.json_schema(call, "tools")
    return Grammar.lark(f"start: call | text\ncall: %json {json.dumps(call)}\ntext: /[^{{\\s][\\s\\S]*/\n", "tools")


def system_block(mode: str, tools: list[dict[str, Any]]) -> str:
    lines = [PREAMBLE + (" " + AUTO if mode == "auto" else ""), "Functions:"]
    lines += [json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools]
    return "\n".join(lines)


def render_call(call: dict[str, Any]) -> str:
    """An earlier assistant call as the model is asked to write one (arguments back to a JSON value)."""
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except (TypeError, json.JSONDecodeError):
        args = fn.get("arguments")
    return json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False, separators=(",", ":"))


def render_result(name: str | None, call_id: str, content: str) -> str:
    return f"Result of function {name or '?'} (call {call_id}):\n{content}"


def parse_call(text: str, tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The OpenAI tool call in a finished reply, or None when the reply is text."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in {t["name"] for t in tools}:
        return None
    arguments = json.dumps(obj.get("arguments", {}), ensure_ascii=False, separators=(",", ":"))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


def render(messages: list[dict[str, Any]], mode: str, tools: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Chat messages ({role, content, tool_calls, tool_call_id}) as plain template messages: with tools, the
    system block in front (merged into a leading system message); earlier calls written as the model is asked
    to write them; tool results as user messages."""
    names = {c.get("id"): (c.get("function") or {}).get("name") for m in messages for c in m["tool_calls"] or ()}
    out = []
    for m in messages:
        text, call_id = m["content"], m["tool_call_id"]
        if m["role"] == "tool":
            out.append({"role": "user", "content": render_result(names.get(call_id), call_id or "?", text)})
            continue
        if m["tool_calls"]:
            text = "\n".join([text] * bool(text) + [render_call(c) for c in m["tool_calls"]])
        out.append({"role": m["role"], "content": text})
    if mode != "none":
        block = system_block(mode, tools)
        if out[0]["role"] == "system":
            out[0]["content"] = block + "\n\n" + out[0]["content"]
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def reply(text: str, reason: str, mode: str, tools: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """A finished choice's assistant message and finish reason: a whole call becomes `tool_calls`."""
    call = parse_call(text, tools) if mode != "none" and reason == "stop" else None
    if call is None:
        return {"role": "assistant", "content": text}, reason
    return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
