"""The server's structured-output fields -> one SamplingParams constraint.

Clients of three APIs ask for constrained output in their own words; all of them land
on SamplingParams' json_schema / regex / choice / grammar (ellm.engine.structured):
  OpenAI     response_format {"type": "text" | "json_object" | "json_schema",
             "json_schema": {"name", "schema", "strict"}}  (llama.cpp also reads
             {"type": "json_object", "schema": {...}})
  llama.cpp  json_schema (an object), grammar (GBNF text)
  vLLM       guided_json, guided_regex, guided_choice, guided_grammar,
             guided_decoding_backend (any value: ellm always uses llguidance), and
             structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}
A field that ellm cannot honour (guided_whitespace_pattern, a structured_outputs key
outside those) is a ConstraintError naming it, never a request run unconstrained; so is
a second constraint beside the first, and an invalid schema, regex or grammar.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..engine import structured

# The request fields this module reads (the protocol declares each, so none is dropped).
FIELDS = ("response_format", "json_schema", "grammar", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs")
_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# structured_outputs keys vLLM sends with their "off" value; anything else there is refused.
_STRUCTURED_OUTPUTS_OFF = {"json_object": (None, False), "disable_fallback": (None, False, True),
                           "disable_any_whitespace": (None, False), "disable_additional_properties": (None, False),
                           "whitespace_pattern": (None,), "structural_tag": (None,), "backend": None}


class ConstraintError(ValueError):
    """A structured-output field that is wrong or cannot be honoured; param names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _response_format(rf: Any) -> tuple[str, Any] | None:
    if not isinstance(rf, Mapping) or not isinstance(rf.get("type"), str):
        raise ConstraintError("response_format", 'response_format must be {"type": "text" | "json_object" | '
                                                 '"json_schema", ...}')
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")   # llama.cpp's extension
        return "json_schema", schema if schema is not None else {"type": "object"}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ConstraintError("response_format.json_schema",
                                  'response_format {"type": "json_schema"} needs "json_schema": {"name", "schema"}')
        schema = spec.get("schema")
        if schema is None:
            raise ConstraintError("response_format.json_schema.schema",
                                  "response_format.json_schema needs a 'schema' (a JSON schema object)")
        if spec.get("strict") is True and isinstance(schema, Mapping):   # OpenAI's strict mode, at every level
            schema = structured.strict_objects(dict(schema))
        return "json_schema", schema
    raise ConstraintError("response_format.type", f"response_format type {kind!r} is not supported "
                                                  "(text, json_object, json_schema are)")


def _structured_outputs(so: Any) -> list[tuple[str, str, Any]]:
    if not isinstance(so, Mapping):
        raise ConstraintError("structured_outputs", "structured_outputs must be an object")
    found = []
    for key, value in so.items():
        if key in _STRUCTURED_OUTPUTS_KEYS:
            if value is not None:
                found.append((f"structured_outputs.{key}", _STRUCTURED_OUTPUTS_KEYS[key], value))
        elif key == "json_object":
            if value is True:
                found.append(("structured_outputs.json_object", "json_schema", {"type": "object"}))
            elif value not in (None, False):
                raise ConstraintError("structured_outputs.json_object",
                                      "structured_outputs.json_object must be a boolean")
        elif key in _STRUCTURED_OUTPUTS_OFF:
            allowed = _STRUCTURED_OUTPUTS_OFF[key]
            if allowed is not None and value not in allowed:
                raise ConstraintError(f"structured_outputs.{key}", f"structured_outputs.{key} is not supported")
        else:
            raise ConstraintError(f"structured_outputs.{key}", f"structured_outputs.{key} is not supported "
                                                               f"(json, regex, choice, grammar, json_object are)")
    return found


def constraint_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments ({} or one of json_schema / regex / choice /
    grammar) from a request's structured-output fields (None values are absent).
    Raises ConstraintError naming the field at fault."""
    found: list[tuple[str, str, Any]] = []   # (request field, SamplingParams field, value)
    if fields.get("response_format") is not None:
        got = _response_format(fields["response_format"])
        if got is not None:
            found.append(("response_format", *got))
    for name, kind in (("json_schema", "json_schema"), ("grammar", "grammar"), ("guided_json", "json_schema"),
                       ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if fields.get(name) is not None:
            found.append((name, kind, fields[name]))
    if fields.get("structured_outputs") is not None:
        found += _structured_outputs(fields["structured_outputs"])
    if fields.get("guided_whitespace_pattern") is not None:
        raise ConstraintError("guided_whitespace_pattern", "guided_whitespace_pattern is not supported "
                                                           "(JSON is generated compactly)")
    backend = fields.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise ConstraintError("guided_decoding_backend", "guided_decoding_backend must be a string")
    if not found:
        return {}
    if len(found) > 1:
        raise ConstraintError(found[1][0], f"only one structured-output constraint per request: got {found[0][0]} "
                                           f"and {found[1][0]}")
    param, kind, value = found[0]
    try:
        if kind == "json_schema":
            value = structured.schema_dict(value)
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("must be a non-empty list of non-empty strings")
        elif not isinstance(value, str) or not value.strip():
            raise ValueError("must be a non-empty string")
        structured.compile_constraint(kind, value)
    except ValueError as e:
        raise ConstraintError(param, f"{param}: {e}") from None
    return {kind: value}
