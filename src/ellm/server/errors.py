"""OpenAI-shaped errors: APIError, and the translation of pydantic's validation errors
into one message that names the field a client got wrong.

Every error the server answers has the body {"error": {"message", "type", "param",
"code"}}, the shape OpenAI's clients parse (openai.BadRequestError and friends).
Validators in ellm.server.protocol raise two kinds of PydanticCustomError on top of
pydantic's own errors: `phrase` (a short predicate, prefixed here with the field's name)
and `refused` (a whole message, with the param and code to report in its context).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic_core import PydanticCustomError

# Union members of the request models are tagged by the JSON shape of the value; those
# tags appear in pydantic's error locations but mean nothing to a client.
SHAPE_TAGS = frozenset({"string", "strings", "tokens", "token_arrays", "parts", "text_part", "image_part"})


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def phrase(text: str) -> PydanticCustomError:
    """A validator's complaint about its own field: 'text' follows the field's name."""
    return PydanticCustomError("phrase", text)


def refused(message: str, param: str | None, code: str | None = None) -> PydanticCustomError:
    """A whole message about `param` (also for checks that span several fields)."""
    return PydanticCustomError("refused", message, {"param": param, "code": code})


# ---------------------------------------------------------------------------------------
# pydantic errors -> one APIError
# ---------------------------------------------------------------------------------------

def json_type_name(v: Any) -> str:
    return {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
            list: "array", dict: "object", bytes: "bytes"}.get(type(v), type(v).__name__)


class _Key(str):
    """A dict key in an error location (data, not a field name)."""


def _keys_marked(loc: Sequence[Any]) -> list[Any]:
    # pydantic reports a bad dict key as (..., key, "[key]") and a bad value as (..., key).
    out: list[Any] = []
    for part in loc:
        if part == "[key]" and out:
            out[-1] = _Key(out[-1])
        else:
            out.append(part)
    return out


def _path(loc: Sequence[Any], keys: bool) -> str:
    """('messages', 0, 'content') -> 'messages[0].content', shape tags dropped. A dict key
    (data, not a field) is shown as '["5"]' when keys, else it ends the path."""
    out = ""
    for part in _keys_marked(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in SHAPE_TAGS:
            continue
        elif isinstance(part, _Key) or not str(part).isidentifier():
            if not keys:
                break
            out += f'["{part}"]'
        else:
            out += f".{part}" if out else str(part)
    return out


def _param(loc: Sequence[Any]) -> str | None:
    """The field a 400 names: the path up to the first dict key."""
    return _path(loc, keys=False) or None


def _display(loc: Sequence[Any]) -> str:
    """The full path for a message, dict keys included: 'logit_bias["5"]'."""
    return _path(loc, keys=True)


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _predicate(err: dict[str, Any]) -> str:
    """What the value should have been, for pydantic's built-in error types."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    got = f", got {json_type_name(value)} {_shown(value)}" if kind.endswith("_type") else ""
    table = {
        "int_type": "must be an integer", "int_from_float": "must be an integer",
        "int_parsing": "must be an integer", "float_type": "must be a number",
        "float_parsing": "must be a number", "finite_number": "must be a finite number",
        "string_type": "must be a string", "bool_type": "must be a boolean",
        "bool_parsing": "must be a boolean", "list_type": "must be an array",
        "dict_type": "must be an object", "model_type": "must be an object",
        "model_attributes_type": "must be an object",
    }
    if kind in table:
        return table[kind] + got
    if kind == "greater_than_equal":
        return f"must be at least {ctx['ge']}, got {_shown(value)}"
    if kind == "greater_than":
        return f"must be greater than {ctx['gt']}, got {_shown(value)}"
    if kind == "less_than_equal":
        return f"must be at most {ctx['le']}, got {_shown(value)}"
    if kind == "less_than":
        return f"must be less than {ctx['lt']}, got {_shown(value)}"
    if kind in ("too_short", "string_too_short"):
        if ctx.get("min_length") == 1:
            return "must not be empty" if kind == "string_too_short" else "must be a non-empty array"
        return f"must hold at least {ctx.get('min_length')} items"
    if kind == "too_long":
        return f"may hold at most {ctx.get('max_length')} items, got {ctx.get('actual_length')}"
    if kind == "string_too_long":
        return f"may be at most {ctx.get('max_length')} characters long"
    if kind == "string_pattern_mismatch":
        return f"must match the pattern {ctx.get('pattern')}, got {_shown(value)}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {_shown(value)}"
    if kind == "extra_forbidden":
        return "is not a field of this object"
    return err.get("msg", "is not valid")


def from_validation(errors: Sequence[Mapping[str, Any]], body_prefix: bool = True) -> APIError:
    """The first of pydantic's errors as a 400 (FastAPI's locations start with 'body')."""
    if not errors:
        return APIError(400, "the request is not valid")
    err = dict(errors[0])
    loc = tuple(err.get("loc", ()))
    if body_prefix and loc[:1] == ("body",):
        loc = loc[1:]
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "json_invalid":
        detail = ctx.get("error", "")
        where = f" (at character {loc[0]})" if loc and isinstance(loc[0], int) else ""
        return APIError(400, f"the request body is not valid JSON: {detail}{where}", code="invalid_json")
    if not loc:   # the body itself
        if kind == "missing":
            return APIError(400, "the request body is empty; expected a JSON object")
        if kind == "refused":
            return APIError(400, err["msg"], param=ctx.get("param"), code=ctx.get("code"))
        value = err.get("input")
        if isinstance(value, (bytes, bytearray)):
            return APIError(400, "the request body must be JSON: send it with 'Content-Type: application/json'")
        return APIError(400, f"the request body must be a JSON object, got {json_type_name(value)}")
    param = _param(loc)
    if kind == "missing":
        return APIError(400, f"you must provide a {param} parameter", param=param,
                        code="missing_required_parameter")
    if kind == "refused":
        return APIError(400, err["msg"], param=ctx.get("param", param), code=ctx.get("code"))
    if kind == "value_error":   # a ValueError raised by a validator: its message is the text
        text = str(ctx.get("error", err.get("msg", "")))
        return APIError(400, f"'{param}' {text}", param=param)
    predicate = err["msg"] if kind == "phrase" else _predicate(err)
    return APIError(400, f"'{_display(loc)}' {predicate}", param=param)
