"""Chat templates: Jinja2 programs shipped with a model that turn a list of messages into
the prompt text the model was trained on.

A template comes from a downloaded file, so it is untrusted code. It runs in Jinja2's
immutable sandbox, with the globals and filters Hugging Face templates expect
(`raise_exception`, `strftime_now`, a JSON-faithful `tojson`, `{% generation %}`,
`{% break %}` / `{% continue %}`) and the same whitespace rules (trim_blocks, lstrip_blocks)
as transformers' `apply_chat_template`. Unlike the stock sandbox, touching an unsafe
attribute (`__class__`, `__globals__`, `mro`, ...) fails at once instead of yielding a
quiet undefined value, and every failure surfaces as ChatTemplateError. The data a
template sees is rebuilt from plain JSON types first, so no caller object with methods
reaches it.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, raised on purpose (raise_exception),
    or tried to reach Python internals."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for inference the body is simply rendered."""

    tags = {"generation"}  # noqa: RUF012 (the attribute Jinja reads, declared on its base class)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


_MAX_REPEAT = 1 << 24  # items a template may make with `*`
_MAX_POWER_BITS = 1 << 16  # bits of an integer a template may make with `**`


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute raises immediately: the stock sandbox
    returns an undefined value that is only an error once printed, so `{% if x.__class__ %}`
    would quietly be false."""

    # `*` and `**` are checked before they run, so `'a' * 10**10` or `9**9**9` fail fast
    # instead of taking the machine's memory or CPU (the stock sandbox allows both).
    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:  # type: ignore[override]
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > _MAX_REPEAT:
                    raise SecurityError(f"a chat template may not build a sequence of {len(seq) * times} items")
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
              and right > 0 and right * abs(left).bit_length() > _MAX_POWER_BITS):
            raise SecurityError("a chat template may not compute a number that large")
        return super().call_binop(context, operator, left, right)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so a template cannot park values
    under names the sandbox treats as internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same calling trick as Jinja's own
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template may not store {name!r} on a namespace")


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; prompts need the JSON as written.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


@lru_cache(maxsize=1)
def _environment() -> _StrictSandbox:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    del env.globals["lipsum"]  # no template needs filler text; it would only be a way to burn CPU
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace, dict=_make_dict)
    return env


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once; ChatTemplateError if it does not parse."""
    try:
        return _environment().from_string(source)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse (line {e.lineno}): {e.message}") from None
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def plain_data(value: Any) -> Any:
    """`value` rebuilt from JSON types (dict, list, str, int, float, bool, None).

    Dataclass-like objects with `model_dump()` (pydantic, the OpenAI client's messages)
    are converted; anything else becomes an inert "<TypeName>" string. str/int/float
    subclasses are cut back to the base type, which carries no extra methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return plain_data(value.item())  # numpy scalars
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return plain_data(dump())
    return f"<{type(value).__name__}>"


def render_chat(source: str, messages: list[dict], *, add_generation_prompt: bool = True,
                tools: list[dict] | None = None, special_tokens: Mapping[str, str | None] | None = None,
                **kwargs: Any) -> str:
    """Render template `source` for `messages` the way transformers'
    `apply_chat_template(tokenize=False)` does. Keys whose value is None are dropped from
    each message first (many templates print a literal "None" otherwise)."""
    template = compile_template(source)
    chat = []
    for m in plain_data(list(messages)):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"a chat message must be a dict, not {m!r}")
        chat.append({k: v for k, v in m.items() if v is not None})
    context = {**dict(special_tokens or {}), **plain_data(kwargs)}
    context.update(messages=chat, tools=plain_data(tools), add_generation_prompt=bool(add_generation_prompt))
    try:
        return template.render(**context)
    except SecurityError as e:
        raise ChatTemplateError(f"chat template blocked by the sandbox: {e}") from None
    except TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
            RecursionError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
