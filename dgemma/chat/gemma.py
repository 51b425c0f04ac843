"""Gemma 4's own tool-call syntax, for checkpoints whose chat template declares tools: a grammar that produces
exactly the model's calls, `<|tool_call>call:NAME{key:value,...}<tool_call|>` (strings between `<|"|>` tokens,
keys unquoted and sorted, as the template writes them back), built from the tools' parameter schemas; the
parser that reads calls back from the committed token ids; and the messages the template expects for earlier
calls and their results (`tool_calls` with argument objects, `tool_responses` on the calling message).

The syntax is Google's Gemma 4 chat template's, as vLLM's `gemma4` tool parser and llama.cpp's Gemma 4 templates
read and write it."""

from __future__ import annotations

import json
import re
from typing import Any

from dgemma.sampling import Grammar, SamplingParamsError
from dgemma.sampling.constraints import JSON_OPTIONS

CALL, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # names the syntax carries unquoted (tools, properties)
NOTES = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
         "writeOnly", "$defs", "definitions", "additionalProperties"}
COMMON = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "nullable"}
BY_TYPE = {"string": {"minLength", "maxLength", "pattern"}, "integer": {"minimum", "maximum", "exclusiveMinimum",
           "exclusiveMaximum", "multipleOf"}, "object": {"properties", "required"}, "array": {"items", "minItems",
           "maxItems"}, "boolean": set(), "null": set()}
BY_TYPE["number"] = BY_TYPE["integer"]
NULL = '("null" | "None")'  # JSON's, and what the template writes for a None argument
ANY = r"""any: str_any | NUMBER | "true" | "false" | """ + NULL + r""" | obj_any | arr_any
str_any: {q} {q} | {q} ANY_STR {q}
obj_any: "{{" any_items? "}}"
any_items: KEY ":" any ("," KEY ":" any)*
arr_any: "[" "]" | "[" any ("," any)* "]"
ANY_STR: /[\s\S]+/
KEY: /[A-Za-z_][A-Za-z0-9_]*/
NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
"""


class GemmaSyntax:
    """The call syntax of a tokenizer whose chat template declares tools with Gemma 4's tool-call tokens."""

    def __init__(self, call: int, end: int, quote: int):
        self.call, self.end, self.quote = call, end, quote

    @classmethod
    def of(cls, tokenizer: Any) -> GemmaSyntax | None:
        template = getattr(tokenizer, "chat_template", None) or ""
        if "tools" not in template or CALL not in template:
            return None
        ids = [tokenizer.token_id(t) for t in (CALL, END, QUOTE)]
        return None if None in ids else cls(*ids)

    # ---- the grammar -----------------------------------------------------------------------------------------
    def grammar(self, mode: str, tools: list[dict[str, Any]], parallel: bool) -> Grammar:
        """One call (several when `parallel`) to the callable tools, or in "auto" mode plain text instead."""
        rules = _Rules(f"<[{self.quote}]>")
        calls = []
        for i, tool in enumerate(tools):
            try:
                args = rules.arguments(tool["parameters"], tool["name"])
            except SamplingParamsError as e:
                raise SamplingParamsError(f"tools[{i}] ({tool['name']}): {e}", "tools") from None
            calls.append(rules.rule(f'<[{self.call}]> {_lit("call:" + tool["name"] + "{")} {args} "}}" '
                                    f"<[{self.end}]>"))
        top = ["start: TEXT | calls" if mode == "auto" else "start: calls", "calls: call" + "+" * parallel,
               "call: " + " | ".join(calls), "TEXT: /[\\s\\S]+/"]
        return Grammar.lark("\n".join(top + rules.lines) + "\n" + rules.any_rules(), "tools")

    # ---- reading calls back ----------------------------------------------------------------------------------
    def parse(self, ids: list[int], decode: Any, whole: bool = True) -> list[tuple[str, Any]] | None:
        """[(name, arguments)] of a reply made only of calls, or None (text, or calls cut short). `whole=False`
        (a reply cut by max_tokens): the complete calls before the cut."""
        items: list[Any] = []
        run: list[int] = []
        for t in [*ids, -1]:
            if t in (self.call, self.end, self.quote, -1):
                items += list(decode(run)) if run else []
                items.append(t)
                run = []
            else:
                run.append(t)
        return _Reader(items[:-1], self).calls(whole)


class _Rules:
    """Lark rules for values of JSON schemas in Gemma's argument syntax; `q` is the quote token's reference."""

    def __init__(self, q: str):
        self.q, self.lines, self.refs, self.defs = q, [], {}, {}

    def rule(self, body: str) -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def any_rules(self) -> str:
        return ANY.format(q=self.q)

    def arguments(self, schema: dict[str, Any], name: str) -> str:
        """A rule for the inside of the call's braces: the parameters object's items."""
        if not PLAIN_NAME.fullmatch(name):
            raise SamplingParamsError("a function name must be letters, digits, '_', '.' or '-' for this "
                                      "checkpoint's tool-call syntax")
        self.defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
        if _types(schema) not in (["object"], []) or any(k in schema for k in ("anyOf", "oneOf", "$ref")):
            raise SamplingParamsError("parameters must be an object schema for this checkpoint's tool-call syntax")
        return self._items(schema, "parameters")

    def value(self, schema: Any, where: str) -> str:
        if schema is True or schema == {}:
            return "any"
        if not isinstance(schema, dict):
            raise SamplingParamsError(f"{where} is not a schema this syntax can follow")
        if "$ref" in schema:
            return self._ref(schema["$ref"], where)
        if "enum" in schema or "const" in schema:
            options = schema["enum"] if "enum" in schema else [schema["const"]]
            return self.rule(" | ".join(self.literal(v) for v in options) or '""')
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                return self.rule(" | ".join(self.value(rest | s, f"{where}.{key}[{i}]")
                                            for i, s in enumerate(schema[key])))
        if "allOf" in schema:
            if len(schema["allOf"]) != 1:
                raise SamplingParamsError(f"{where}: allOf with several schemas is not supported by this syntax")
            return self.value({k: v for k, v in schema.items() if k != "allOf"} | schema["allOf"][0], where)
        types = _types(schema) or ["object"] * ("properties" in schema) or ["array"] * ("items" in schema)
        if not types:
            return "any"
        types += ["null"] * bool(schema.get("nullable"))
        return self.rule(" | ".join(self._typed(t, schema, where) for t in dict.fromkeys(types)))

    def literal(self, v: Any) -> str:
        """A constant value as Gemma's template writes an argument (strings quoted, keys bare and sorted)."""
        if isinstance(v, str):
            return f"{self.q} {_lit(v)} {self.q}" if v else f"{self.q} {self.q}"
        if isinstance(v, dict):
            parts = [f"{_lit(str(k) + ':')} {self.literal(v[k])}" for k in sorted(v)]
            return '"{" ' + ' "," '.join(parts) + ' "}"'
        if isinstance(v, list):
            return '"[" ' + ' "," '.join(self.literal(x) for x in v) + ' "]"'
        return NULL if v is None else _lit(json.dumps(v))

    def _typed(self, kind: str, schema: dict[str, Any], where: str) -> str:
        allowed = NOTES | COMMON | BY_TYPE.get(kind, set())
        if kind not in BY_TYPE or (extra := sorted(set(schema) - allowed)):
            what = f"type {kind!r}" if kind not in BY_TYPE else f"keyword {extra[0]!r}"
            raise SamplingParamsError(f"{where}: {what} is not supported by this checkpoint's tool-call syntax")
        if kind == "string":
            return self._string(schema)
        if kind in ("integer", "number"):
            keep = {k: v for k, v in schema.items() if k in BY_TYPE[kind]}
            return "%json " + json.dumps({"type": kind, **keep, "x-guidance": JSON_OPTIONS})
        if kind == "object":
            return f'"{{" {self._items(schema, where)} "}}"'
        if kind == "array":
            return self._array(schema, where)
        return '"true" | "false"' if kind == "boolean" else NULL

    def _string(self, schema: dict[str, Any]) -> str:
        """Raw text between quote tokens; the empty string as its own alternative (a lexeme is never empty)."""
        if "pattern" in schema:
            body = re.sub(r"^\^|(?<!\\)\$$", "", schema["pattern"])
            term, empty = "/(?:" + body.replace("/", "\\/") + ")/", _matches_empty(body)
        else:
            low, high = max(1, schema.get("minLength", 0)), schema.get("maxLength", "")
            if high == 0:
                return f"{self.q} {self.q}"
            term, empty = f"/[\\s\\S]{{{low},{high}}}/", schema.get("minLength", 0) == 0
        name = f"S{len(self.lines)}"
        self.lines.append(f"{name}: {term}")
        return f"{self.q} {self.q} | " * empty + f"{self.q} {name} {self.q}"

    def _items(self, schema: dict[str, Any], where: str) -> str:
        """Sorted properties, the required ones always, each optional one present or not, comma separated:
        first[i] = what may come from property i on when nothing was written yet, rest[i] after a comma."""
        props, required = dict(schema.get("properties", {})), set(schema.get("required", []))
        props |= {k: True for k in required - props.keys()}
        if not props:
            return "any_items?" if schema.get("additionalProperties", True) is not False else '""'
        first, rest = '""', '""'
        for key in sorted(props, reverse=True):
            if not PLAIN_NAME.fullmatch(key):
                raise SamplingParamsError(f"{where}: property name {key!r} must be letters, digits, '_', '.' or '-'")
            item = f"{_lit(key + ':')} {self.value(props[key], f'{where}.{key}')}"
            new_first, new_rest = f"{item} {rest}", f'"," {item} {rest}'
            if key not in required:
                new_first, new_rest = f"{new_first} | {first}", f"{new_rest} | {rest}"
            first, rest = self.rule(new_first), self.rule(new_rest)
        return first

    def _array(self, schema: dict[str, Any], where: str) -> str:
        item = self.value(schema.get("items", True), f"{where}.items")
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high == 0:
            return '"[" "]"'
        more = "" if high == 1 else f'("," {item}){{{max(low - 1, 0)},{"" if high is None else high - 1}}} '
        return ('"[" "]" | ' if low == 0 else "") + f'"[" {item} {more}"]"'

    def _ref(self, ref: str, where: str) -> str:
        name = ref.rsplit("/", 1)[-1]
        if not re.fullmatch(r"#/(\$defs|definitions)/[^/]+", ref) or name not in self.defs:
            raise SamplingParamsError(f"{where}: $ref {ref!r} must name an entry of $defs / definitions")
        if ref not in self.refs:
            self.refs[ref] = f"ref{len(self.refs)}"
            self.lines.append(f"{self.refs[ref]}: {self.value(self.defs[name], ref)}")
        return self.refs[ref]


def _types(schema: dict[str, Any]) -> list[str]:
    kind = schema.get("type")
    return [kind] if isinstance(kind, str) else list(kind or [])


def _matches_empty(pattern: str) -> bool:
    try:
        return re.fullmatch(pattern, "") is not None
    except re.error:
        return False


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class _Reader:
    """Reads calls from a reply's items: characters of the text between markers, and the marker ids."""

    def __init__(self, items: list[Any], syntax: GemmaSyntax):
        self.items, self.pos, self.s = items, 0, syntax

    def take(self, expected: Any = None) -> Any:
        item = self.items[self.pos]
        if expected is not None and item != expected:
            raise ValueError(f"expected {expected!r}")
        self.pos += 1
        return item

    def until(self, stops: str) -> str:
        out = []
        while isinstance(self.items[self.pos], str) and self.items[self.pos] not in stops:
            out.append(self.take())
        return "".join(out)

    def calls(self, whole: bool) -> list[tuple[str, Any]] | None:
        calls = []
        while self.pos < len(self.items):
            try:
                calls.append(self.call())
            except (ValueError, IndexError):
                return None if whole else calls or None
        return calls or None

    def call(self) -> tuple[str, Any]:
        self.take(self.s.call)
        head = self.until("{")
        if not head.startswith("call:"):
            raise ValueError("not a call")
        call = (head[len("call:"):], self.mapping())
        self.take(self.s.end)
        return call

    def mapping(self) -> dict[str, Any]:
        self.take("{")
        out = {}
        while self.items[self.pos] != "}":
            key = self.until(":")
            self.take(":")
            out[key] = self.value()
            if self.items[self.pos] == ",":
                self.take()
        self.take("}")
        return out

    def value(self) -> Any:
        item = self.items[self.pos]
        if item == self.s.quote:
            self.take()
            text = self.until("") if isinstance(self.items[self.pos], str) else ""
            self.take(self.s.quote)
            return text
        if item == "{":
            return self.mapping()
        if item == "[":
            self.take()
            out = []
            while self.items[self.pos] != "]":
                out.append(self.value())
                if self.items[self.pos] == ",":
                    self.take()
            self.take("]")
            return out
        bare = self.until(",}]")
        return None if bare == "None" else json.loads(bare)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as Gemma's template expects them: an assistant's calls with argument objects, and the
    `role: "tool"` messages after it as that message's `tool_responses` [{name, response}] (the template writes
    them as `<|tool_response>response:NAME{...}<tool_response|>` in the same model turn)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] != "tool":
            calls = [c | {"function": (c.get("function") or {}) | {"arguments": _arguments(c)}}
                     for c in m.get("tool_calls") or ()]
            out.append(m | {"tool_calls": calls or None})
            continue
        host = out[-1] if out and out[-1]["role"] == "assistant" and out[-1]["tool_calls"] else None
        if host is None:
            raise SamplingParamsError("a tool message must follow an assistant message with tool_calls", "messages")
        name = next((c["function"].get("name") for c in host["tool_calls"] if c.get("id") == m["tool_call_id"]),
                    "unknown")
        host["tool_responses"] = host.get("tool_responses", []) + [{"name": name, "response": _json(m["content"])}]
    return out


def _arguments(call: dict[str, Any]) -> Any:
    return _json((call.get("function") or {}).get("arguments") or "{}")


def _json(text: Any) -> Any:
    """A JSON object's text as the object (the template writes its items), anything else unchanged."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return text
    return value if isinstance(value, dict) else text
