"""Request fields that become a grammar or a layout canvas: chat's `response_format` -> Grammar, and the
completion's infill / template / edit fields -> the layout options of `Model.params`."""

from __future__ import annotations

from typing import Any

from dgemma.sampling import Grammar, SamplingParamsError


def response_grammar(fmt: dict[str, Any] | None, param: str = "response_format") -> Grammar | None:
    """{"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
    "strict": ...}} -> Grammar; "text" or none: free text (None)."""
    kind = None if fmt is None else fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Grammar.json_object(param)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise SamplingParamsError('response_format json_schema needs {"json_schema": {"name": ..., '
                                      '"schema": {...}}}', param)
        return Grammar.json_schema(spec["schema"], param)
    raise SamplingParamsError(f"response_format type {kind!r} must be text, json_object or json_schema", param)


# a completion's layout fields -> the options of Model.params, and back (to name them in errors)
LAYOUT_FIELDS = {"suffix": "suffix", "dgemma_template": "template", "dgemma_edit": "edit", "dgemma_renoise": "renoise"}
LAYOUT_PARAMS = {option: field for field, option in LAYOUT_FIELDS.items()}


def as_layout_options(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields that are set, as `Model.params` options (renoise spans as (start, end) pairs)."""
    out = {LAYOUT_FIELDS[k]: v for k, v in fields.items() if v is not None and k in LAYOUT_FIELDS}
    if isinstance(out.get("renoise"), list):
        out["renoise"] = [tuple(span) for span in out["renoise"]]
    return out
