"""Random JSON schemas for validity checks of constrained decoding (tests and benchmarks/structured.py): nested
objects, arrays, enums, integers and numbers with ranges, required and optional properties, strings with
lengths or patterns. Every generated schema has bounded instances (numbers carry a multipleOf), so a request
with enough max_tokens always ends with finish_reason "stop", whatever the model; with `free=True` strings have
no maxLength, and only the budget rule (sampling/budget.py) ends them."""

from __future__ import annotations

import json
import random
from typing import Any

KEYS = ["id", "name", "age", "tags", "score", "items", "kind", "ok", "note", "pos", "meta", "level"]
PATTERNS = ["[a-z]{1,6}", "[A-Z][a-z]{0,4}", "[0-9]{2,4}-[a-z]{1,3}", "(yes|no|maybe)", "[a-f0-9]{4}"]


def random_schema(rng: random.Random, depth: int = 0, free: bool = False) -> dict[str, Any]:
    """One schema; objects and arrays nest up to three levels. `free`: strings have no maxLength (a model may
    write them until its budget runs out)."""
    kinds = ["string", "integer", "number", "boolean", "enum", "null", "pattern"]
    if depth < 3:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds)
    if kind == "object" or depth == 0:
        return _object(rng, depth, free)
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1, free), "minItems": lo,
                "maxItems": lo + rng.randint(0, 2)}
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, **({} if free else {"maxLength": lo + rng.randint(1, 8)})}
    if kind == "pattern":
        return {"type": "string", "pattern": "^" + rng.choice(PATTERNS) + "$"}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        # multipleOf bounds the fraction digits (binary fractions: validators check them exactly)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100),
                "multipleOf": rng.choice([0.25, 0.5, 0.125])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True, "x y"], rng.randint(1, 4))}
    return {"type": kind}


def _object(rng: random.Random, depth: int, free: bool) -> dict[str, Any]:
    keys = rng.sample(KEYS, rng.randint(1 if depth else 2, 4))
    props = {k: random_schema(rng, depth + 1, free) for k in keys}
    required = [k for k in keys if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_schemas(n: int, seed: int = 0, free: bool = False) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng, free=free) for _ in range(n)]


# the shortest text each pattern above matches
SHORTEST = dict(zip(PATTERNS, ["a", "A", "00-a", "no", "0000"]))


def minimal(schema: dict[str, Any]) -> Any:
    """A smallest-looking valid instance of a generated schema, built from the schema alone (required properties
    in order, the shortest enum value, minItems items, minLength characters, 0 or the minimum)."""
    if "enum" in schema:
        return min(schema["enum"], key=lambda v: len(json.dumps(v)))
    kind = schema["type"]
    if kind == "object":
        return {k: minimal(schema["properties"][k]) for k in schema["required"]}
    if kind == "array":
        return [minimal(schema["items"])] * schema["minItems"]
    if kind == "string":
        return SHORTEST[schema["pattern"][1:-1]] if "pattern" in schema else "a" * schema["minLength"]
    if kind in ("integer", "number"):
        lo, hi = schema["minimum"], schema["maximum"]
        return 0 if lo <= 0 <= hi else lo
    return {"boolean": False, "null": None}[kind]


def minimal_tokens(tokenizer, schema: dict[str, Any]) -> int:
    """Tokens of `minimal(schema)` as compact JSON (no BOS)."""
    return len(tokenizer.encode(json.dumps(minimal(schema), separators=(",", ":")), add_bos=False))
