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

The sandbox stops code execution; a render is also bounded in size and time
(RenderLimits, configurable per call or process-wide with `set_default_limits`):
- every operation that can make a large string or list in one step is checked *before*
  it runs: `*`, `+` and `~` on strings and lists, printf-style `%` and `|format` widths,
  `str.format` widths, the str methods and filters that pad, repeat or join (center,
  ljust, rjust, zfill, expandtabs, replace, join, indent, batch, slice, tojson indent),
  so no single step can allocate more than `max_output_chars`;
- the output is counted as it is produced and the render stops at `max_output_chars`;
- the render stops after `max_seconds` of wall-clock time, checked on every line the
  compiled template executes (a trace function active only in template frames), so
  nested `range` loops end by themselves even in a worker thread nobody can kill.
"""
from __future__ import annotations

import json
import re
import string
import sys
import threading
import time
import types
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.filters import do_batch, do_center, do_format, do_indent, do_replace, sync_do_join, sync_do_slice
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .template_errors import ChatTemplateError


@dataclass(frozen=True)
class RenderLimits:
    """Bounds on one render. max_output_chars bounds the prompt text and every string or
    list built on the way; max_seconds the wall-clock time; max_format_width any padding
    width or precision in a format (`%10s`, `{:>10}`, center(10), ...)."""

    max_output_chars: int = 4_000_000   # ~1M tokens: more than any model's context
    max_seconds: float = 2.0            # real templates render in well under 10 ms
    max_format_width: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_output_chars", "max_format_width"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"RenderLimits.{name} must be an int >= 1, got {v!r}")
        if not (isinstance(self.max_seconds, (int, float)) and 0 < self.max_seconds < float("inf")):
            raise ValueError(f"RenderLimits.max_seconds must be a finite number > 0, got {self.max_seconds!r}")


_default_limits = RenderLimits()


def set_default_limits(limits: RenderLimits) -> None:
    """The limits of every render that is not given its own."""
    global _default_limits
    if not isinstance(limits, RenderLimits):
        raise TypeError(f"limits must be a RenderLimits, got {type(limits).__name__}")
    _default_limits = limits


def default_limits() -> RenderLimits:
    return _default_limits


class _RenderTimeout(Exception):
    """Raised inside a template frame by the deadline check."""


# The limits of the render running on this thread (renders on several threads at once
# each see their own).
_active = threading.local()


def _limits() -> RenderLimits:
    return getattr(_active, "limits", None) or _default_limits


def _too_big(n: int, what: str) -> None:
    cap = _limits().max_output_chars
    if n > cap:
        raise SecurityError(f"a chat template may not build {what} of {n} items (the limit is {cap})")


def _check_width(width: Any, what: str) -> None:
    cap = _limits().max_format_width
    if isinstance(width, int) and not isinstance(width, bool) and width > cap:
        raise SecurityError(f"{what} width {width} is over the limit of {cap}")


# printf-style conversions: flags, width, precision (either may be `*`).
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(fmt: str) -> None:
    for width, precision in _PRINTF.findall(fmt):
        for v in (width, precision):
            if v == "*":
                raise SecurityError("a chat template may not take a format width from its arguments (`*`)")
            if v:
                _check_width(int(v), "a format")


def _check_format_spec(spec: str) -> None:
    if "{" in spec:
        raise SecurityError("a chat template may not nest fields in a format spec")
    for digits in re.findall(r"\d+", spec):  # only width and precision hold digit runs
        _check_width(int(digits), "a format")


def _check_str_format(fmt: str) -> None:
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format itself will raise the same error
    for _, _, spec, _ in fields:
        if spec:
            _check_format_spec(spec)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _joined_size(sep: str, items: list[Any]) -> int:
    total = len(sep) * max(0, len(items) - 1)
    for x in items:  # (a plain loop: a generator would be a traced call per item)
        total += len(x) if isinstance(x, str) else len(str(x))
    return total


# str methods that pad or expand by a count given as an argument
_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


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


_MAX_POWER_BITS = 1 << 16  # bits of an integer a template may make with `**`


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute raises immediately: the stock sandbox
    returns an undefined value that is only an error once printed, so `{% if x.__class__ %}`
    would quietly be false."""

    # `*`, `**`, `+` and `%` are checked before they run, so `'a' * 10**10`, `9**9**9`
    # or `'%999999999s' % x` fail fast instead of taking the machine's memory or CPU
    # (the stock sandbox allows all of them).
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    _too_big(len(seq) * times, "a sequence")
        elif operator == "+":
            _too_big(_size(left) + _size(right), "a sequence")
        elif operator == "%" and isinstance(left, str):
            _check_printf(left)
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
              and right > 0 and right * abs(left).bit_length() > _MAX_POWER_BITS):
            raise SecurityError("a chat template may not compute a number that large")
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_str_format(fmt)
            return wrapped(*args, **kwargs)

        return checked

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's names)
        if isinstance(__obj, types.BuiltinMethodType) and isinstance(__obj.__self__, str):
            name, text = __obj.__name__, __obj.__self__
            if name in _PADDING_METHODS and args:
                _check_width(args[0], f"str.{name}")
                if name == "expandtabs":
                    _too_big(len(text) * max(1, args[0] if isinstance(args[0], int) else 1), "a string")
            elif name == "join" and args:
                items = list(args[0]) if isinstance(args[0], Iterable) else args[0]
                _too_big(_joined_size(text, items) if isinstance(items, list) else 0, "a string")
                args = (items, *args[1:])
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                _check_replace(text, args[0], args[1], args[2] if len(args) > 2 else -1)
        return super().call(__context, __obj, *args, **kwargs)

    def bounded_concat(self, parts: tuple[Any, ...], join: Any) -> Any:
        """`a ~ b ~ ...`, refused before joining when the result would be over the limit."""
        _too_big(_joined_size("", list(parts)), "a string")
        return join(parts)


def _check_replace(text: str, old: str, new: str, count: Any = -1) -> None:
    n = (len(text) + 1) if old == "" else text.count(old)
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    _too_big(len(text) + n * (len(new) - len(old)), "a string")


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles `~` through the environment's bounded_concat, so a template cannot double
    a string in a loop (`{% set ns.s = ns.s ~ ns.s %}`) past the limit."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        # the same join function the stock generator picks (markup under autoescape)
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {join})")


# Filters that pad, repeat or join, checked before they run.
def _center(value: Any, width: int = 80) -> str:
    _check_width(width, "center")
    return do_center(value, width)


def _indent(s: str, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    _check_width(width, "indent")
    if isinstance(width, str):
        _too_big(len(width) * (str(s).count("\n") + 1) + len(str(s)), "a string")
    return do_indent(s, width, first, blank)


def _format(value: str, *args: Any, **kwargs: Any) -> str:
    _check_printf(str(value))
    return do_format(value, *args, **kwargs)


@jinja2.pass_eval_context   # as do_replace and sync_do_join, which these wrap
def _replace(eval_ctx: Any, s: str, old: str, new: str, count: int | None = None) -> str:
    _check_replace(str(s), str(old), str(new), -1 if count is None else count)
    return do_replace(eval_ctx, s, old, new, count)


@jinja2.pass_eval_context
def _join(eval_ctx: Any, value: Iterable[Any], d: str = "", attribute: Any = None) -> str:
    items = list(value)
    if attribute is None:
        _too_big(_joined_size(str(d), items), "a string")
    return sync_do_join(eval_ctx, items, d, attribute)


def _batch(value: Iterable[Any], linecount: int, fill_with: Any = None) -> Any:
    if fill_with is not None:
        _check_width(linecount, "batch")
    return do_batch(value, linecount, fill_with)


def _slice(value: Collection[Any], slices: int, fill_with: Any = None) -> Any:
    _check_width(slices, "slice")
    return sync_do_slice(value, slices, fill_with)


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
    _check_width(indent, "tojson indent")
    if isinstance(indent, str):
        _check_width(len(indent), "tojson indent")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


@lru_cache(maxsize=1)
def _environment() -> _StrictSandbox:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.code_generator_class = _BoundedCodeGenerator
    env.filters.update(tojson=_tojson, center=_center, indent=_indent, format=_format, replace=_replace,
                       join=_join, batch=_batch, slice=_slice)
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
                render_limits: RenderLimits | None = None, **kwargs: Any) -> str:
    """Render template `source` for `messages` the way transformers'
    `apply_chat_template(tokenize=False)` does. Keys whose value is None are dropped from
    each message first (many templates print a literal "None" otherwise). The render is
    bounded by render_limits (default: `default_limits()`); going past them is a
    ChatTemplateError saying which limit."""
    template = compile_template(source)
    if isinstance(messages, (str, bytes, dict)):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts, "
                                f"not a {type(messages).__name__}")
    chat = []
    for m in plain_data(list(messages)):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"a chat message must be a dict, not {m!r}")
        chat.append({k: v for k, v in m.items() if v is not None})
    context = {**dict(special_tokens or {}), **plain_data(kwargs)}
    context.update(messages=chat, tools=plain_data(tools), add_generation_prompt=bool(add_generation_prompt))
    limits = render_limits or _default_limits
    try:
        return _bounded_render(template, context, limits)
    except _RenderTimeout:
        raise ChatTemplateError(f"chat template took more than {limits.max_seconds:g} s to render "
                                "(a runaway loop?)") from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat template blocked by the sandbox: {e}") from None
    except TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
            RecursionError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None


def _bounded_render(template: jinja2.Template, context: dict[str, Any], limits: RenderLimits) -> str:
    """template.render(**context) within `limits` (see the module docstring)."""
    deadline = time.monotonic() + limits.max_seconds
    template_code = template.root_render_func.__code__.co_filename  # "<template>"

    def on_line(frame: types.FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _RenderTimeout
        return on_line

    def on_call(frame: types.FrameType, event: str, arg: Any) -> Any:
        # Only frames of compiled template code are traced line by line (their loops are
        # the template's loops); everything they call runs untraced at full speed.
        if frame.f_code.co_filename == template_code:
            if time.monotonic() > deadline:
                raise _RenderTimeout
            return on_line
        return None

    previous_limits = getattr(_active, "limits", None)
    previous_trace = sys.gettrace()
    _active.limits = limits
    sys.settrace(on_call)
    try:
        out: list[str] = []
        size = 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > limits.max_output_chars:
                raise SecurityError(f"a chat template may not render more than {limits.max_output_chars} characters")
            out.append(piece)
        return "".join(out)
    finally:
        sys.settrace(previous_trace)
        _active.limits = previous_limits
