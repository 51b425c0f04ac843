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
