"""Random JSON schemas for validity checks of constrained decoding (tests and benchmarks/structured.py): nested
objects, arrays, enums, integers and numbers with ranges, required and optional properties, strings with
lengths or patterns. Every generated schema has bounded instances (numbers carry a multipleOf), so a request
with enough max_tokens always ends with finish_reason "stop", whatever the model."""

from __future__ import annotations

import random
from typing import Any

KEYS = ["id", "name", "age", "tags", "score", "items", "kind", "ok", "note", "pos", "meta", "level"]
PATTERNS = ["[a-z]{1,6}", "[A-Z][a-z]{0,4}", "[0-9]{2,4}-[a-z]{1,3}", "(yes|no|maybe)", "[a-f0-9]{4}"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """One schema; objects and arrays nest up to three levels."""
    kinds = ["string", "integer", "number", "boolean", "enum", "null", "pattern"]
    if depth < 3:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds)
    if kind == "object" or depth == 0:
        return _object(rng, depth)
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 2)}
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(1, 8)}
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


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = rng.sample(KEYS, rng.randint(1 if depth else 2, 4))
    props = {k: random_schema(rng, depth + 1) for k in keys}
    required = [k for k in keys if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_schemas(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]
