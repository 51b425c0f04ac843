"""Tool calls in a chat (Python API and server). `ToolUse` holds one request's choices (mode, callable tools,
parallel calls) and the syntax: the checkpoint's own (Gemma 4's tool-call tokens, `gemma.py`) when its chat template
declares tools, else the documented text format here: the tools are described in a system block, the reply is held
to a grammar built from their parameter schemas (one compact JSON call per line), and the calls in the output become
OpenAI `tool_calls`; earlier calls and `role: "tool"` results are rendered back into the prompt as text."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from dgemma.chat.gemma import GemmaSyntax, template_messages
from dgemma.sampling import Grammar, SamplingParamsError
from dgemma.sampling.constraints import JSON_OPTIONS

PREAMBLE = ("You can call these functions. To call one, reply with only a JSON object "
            '{"name": <function name>, "arguments": <its arguments as a JSON object>} and nothing else.')
AUTO = "Otherwise reply with plain text (not starting with '{')."
PARALLEL = "To call several, write one such object per line."


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


@dataclass
class ToolUse:
    """One chat request's tool calls: mode "none" (plain text), "auto" (calls or text) or "required" (calls);
    the callable tools [{name, description, parameters}]; several calls per reply or one; the request's own
    `tools` (for a template that declares them); the checkpoint's call syntax, or None for the text format."""

    mode: str
    tools: list[dict[str, Any]]
    parallel: bool = True
    declared: list[dict[str, Any]] | None = None
    syntax: GemmaSyntax | None = None

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool | None,
           constraint: Any, logprobs: bool, tokenizer: Any = None, constraint_param: str = "response_format"
           ) -> ToolUse:
        """The request's fields checked (SamplingParamsError naming the field); `tokenizer` picks the syntax.
        `constraint`: the request's other constraint on the reply (`constraint_param`: response_format, grammar)."""
        kind, callable_tools = choose(check_tools(tools or []), choice)
        if kind != "none" and constraint not in (None, {"type": "text"}):
            raise SamplingParamsError(f'{constraint_param} and tools both constrain the reply; send one (or '
                                      'tool_choice "none")', constraint_param)
        if kind != "none" and logprobs:
            raise SamplingParamsError("logprobs are not supported with tools", "logprobs")
        syntax = GemmaSyntax.of(tokenizer)  # also for "none": earlier calls and results keep the native form
        use = cls(kind, callable_tools, parallel is not False, (tools or None) if syntax else None, syntax)
        use.grammar()  # a schema the syntax cannot follow: a 400 before any model work
        return use

    def grammar(self) -> Grammar | None:
        if self.mode == "none":
            return None
        if self.syntax is not None:
            return self.syntax.grammar(self.mode, self.tools, self.parallel)
        return grammar(self.mode, self.tools, self.parallel)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Chat messages ({role, content, tool_calls, tool_call_id}; "developer" is the newer name of "system")
        for the chat template."""
        plain = [plain_message(m, i) for i, m in enumerate(messages)]
        if self.syntax is not None:
            return template_messages(plain)
        return render(plain, self.mode, self.tools, self.parallel)

    def reply(self, text: str, ids: list[int], reason: str, decode: Any) -> tuple[dict[str, Any], str]:
        """A finished choice's assistant message and finish reason: a reply of whole calls becomes `tool_calls`
        (finish reason "tool_calls"); one cut by max_tokens keeps its complete calls (finish reason "length")."""
        calls, whole = None, reason == "stop"
        if self.mode != "none" and reason in ("stop", "length"):
            calls = self.syntax.parse(ids, decode, whole) if self.syntax else parse_calls(text, self.tools, whole)
        calls = [openai_call(n, a) for n, a in calls or ()]
        return assistant_message(text, calls), "tool_calls" if calls and whole else reason


def assistant_message(text: str | None, calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A reply as an OpenAI assistant message: its calls (content null), or its text."""
    return {"role": "assistant", "content": None, "tool_calls": calls} if calls else {"role": "assistant",
                                                                                    "content": text}


def plain_message(m: Any, i: int) -> dict[str, Any]:
    """A chat message with every field `messages` reads (absent ones None), checked."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise SamplingParamsError(f"messages[{i}] must be an object with a role", "messages")
    out = m | {"role": "system" if m["role"] == "developer" else m["role"], "content": _flat(m.get("content")),
               "tool_calls": m.get("tool_calls") or None, "tool_call_id": m.get("tool_call_id")}
    for field in ("content", "tool_call_id"):
        if out[field] is None and (why := missing(field, out)):
            raise SamplingParamsError(f"messages[{i}]: {why}", "messages")
    return out


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


def grammar(mode: str, tools: list[dict[str, Any]], parallel: bool = True) -> Grammar | None:
    """A call: {"name": one tool's name, "arguments": that tool's schema}, compact JSON, one per line (several
    lines when `parallel`); "auto" also allows text that does not start with "{" (a Lark alternation)."""
    if mode == "none":
        return None
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools],
            "x-guidance": JSON_OPTIONS}
    if mode == "required" and not parallel:
        return Grammar.json_schema(call, "tools")
    calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
    start = "start: calls | text" if mode == "auto" else "start: calls"
    return Grammar.lark(f"{start}\n{calls}\ncall: %json {json.dumps(call)}\ntext: /[^{{\\s][\\s\\S]*/\n", "tools")


def system_block(mode: str, tools: list[dict[str, Any]], parallel: bool = True) -> str:
    lines = [" ".join([PREAMBLE] + [PARALLEL] * parallel + [AUTO] * (mode == "auto")), "Functions:"]
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


def parse_calls(text: str, tools: list[dict[str, Any]], whole: bool = True) -> list[tuple[str, Any]] | None:
    """[(name, arguments)] of a reply made of JSON calls, one per line, or None when the reply is text.
    `whole=False` (a reply cut by max_tokens): the complete calls before the cut."""
    names, calls = {t["name"] for t in tools}, []
    for line in text.split("\n"):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None if whole else calls or None
        calls.append((obj["name"], obj.get("arguments", {})))
    return calls


def openai_call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))}}


def render(messages: list[dict[str, Any]], mode: str, tools: list[dict[str, Any]],
           parallel: bool = True) -> list[dict[str, str]]:
    """Chat messages ({role, content, tool_calls, tool_call_id}) as plain template messages: with tools, the
    system block in front (merged into a leading system message); earlier calls written as the model is asked
    to write them; tool results as user messages."""
    names = {c.get("id"): (c.get("function") or {}).get("name") for m in messages for c in m["tool_calls"] or ()}
    out = []
    for m in messages:
        text, call_id = m["content"], m["tool_call_id"]
        if m["role"] == "tool":
            name = names.get(call_id) or "?"
            out.append({"role": "user", "content": f"Result of function {name} (call {call_id or '?'}):\n{text}"})
            continue
        if m["tool_calls"]:
            text = "\n".join([text] * bool(text) + [render_call(c) for c in m["tool_calls"]])
        out.append({"role": m["role"], "content": text})
    if mode != "none":
        block = system_block(mode, tools, parallel)
        if out[0]["role"] == "system":
            first = out[0]["content"]  # a string, or parts with an image
            out[0]["content"] = [{"type": "text", "text": block + "\n\n"}, *first] if isinstance(first, list) \
                else block + "\n\n" + first
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _flat(content: Any) -> Any:
    """A content given as text parts -> their text (OpenAI's other form of it); other contents unchanged."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content

