"""Tool (function) calling for any model: the tools into the prompt, tool_choice into a
constraint, the model's text back into calls. Pure functions; the server and LLM.chat
use them through ToolPlan.

Formats. A model writes calls in the format its chat template taught it:
  hermes   `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call
           (Qwen 2.5/3, SmolLM3, Hermes); templates that mention `<tool_call>`.
  llama3   a bare JSON object `{"name": ..., "parameters": {...}}`, optionally after
           `<|python_tag|>`; several are separated by `;` (Llama 3.1-3.3).
  mistral  `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects, or (newer
           tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call.
  generic  for a template that takes no tools (SmolLM2, Gemma): ellm describes the
           tools in a system message of its own and asks for hermes-style blocks (the
           format most open models have seen); see docs/tools.md.
A template that uses the `tools` variable gets the tools itself; otherwise the generic
system message is added. Assistant messages with tool_calls and "tool" messages are
given to a tools-aware template as they are (arguments as a dict, as Hugging Face
templates expect) and written out in the generic format otherwise.

tool_choice: "none" (tools are not shown and nothing is parsed), "auto" (the output is
parsed for calls in the model's format), "required" or a named function (the output is
constrained by a Lark grammar whose calls embed each function's parameter schema, so it
always parses and its arguments always validate).
"""
from __future__ import annotations

import dataclasses
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..engine import structured

FORMATS = ("hermes", "llama3", "mistral", "generic")
# How many calls a required turn may hold when parallel calls are allowed: at most this,
# and at most one per function offered (small models otherwise repeat a call until
# max_tokens; one turn rarely needs the same function twice).
MAX_PARALLEL_CALLS = 4
# JSON inside the call grammars is written compactly (see engine/structured.py).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class ToolError(ValueError):
    """A bad tools / tool_choice / messages field; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]
    where: str = field(default="tools", compare=False)   # the request field of its parameters

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass
class ToolCall:
    name: str
    arguments: str                 # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# ---------------------------------------------------------------- request fields

def parse_tools(tools: Any) -> list[Function]:
    """OpenAI `tools` ([{"type": "function", "function": {name, description, parameters}}])
    -> Functions. The Responses API's flat form ({"type": "function", "name": ...}) is
    accepted too. A ToolError names the bad entry."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    out: list[Function] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ToolError(where, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}; "
                                   f"only function tools are supported")
        fn = t.get("function", t if "name" in t else None)
        if not isinstance(fn, dict):
            raise ToolError(where, f"{where}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"{where}.function.name", f"{where}.function.name must be 1-64 letters, digits, "
                                                      f"'_', '-' or '.', got {name!r}")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema object")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise ToolError(f"{where}.function.description", f"{where}.function.description must be a string")
        if any(f.name == name for f in out):
            raise ToolError(where, f"{where}: function {name!r} is defined twice")
        out.append(Function(name, desc, params, f"{where}.function.parameters"))
    return out


def parse_tool_choice(choice: Any, functions: list[Function]) -> tuple[str, str | None]:
    """-> (mode, function name) with mode "none" | "auto" | "required" | "named"."""
    if choice is None:
        return ("auto" if functions else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not functions:
            raise ToolError("tool_choice", f"tool_choice {choice!r} needs tools")
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function", choice)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not any(f.name == name for f in functions):
            raise ToolError("tool_choice", f"tool_choice names function {name!r}, which is not in tools "
                                           f"({', '.join(f.name for f in functions) or 'none given'})")
        return "named", name
    raise ToolError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                   '{"type": "function", "function": {"name": ...}}')


# ---------------------------------------------------------------- templates

def template_takes_tools(template: str | None) -> bool:
    """True when a chat template reads the `tools` variable."""
    return bool(template and re.search(r"\btools\b", template))


def detect_format(template: str | None) -> str:
    """The call format a chat template teaches (see the module docstring)."""
    if not template_takes_tools(template):
        return "generic"
    assert template is not None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3"
    return "generic"


GENERIC_INSTRUCTIONS = """\
You can call functions. These are available, described as JSON schemas:
<tools>
{tools}
</tools>
To call a function, reply with one block per call (and nothing else in the block):
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>
Each result comes back to you in a <tool_response> block."""


def generic_system_prompt(functions: list[Function]) -> str:
    return GENERIC_INSTRUCTIONS.format(tools="\n".join(json.dumps(f.spec()) for f in functions))


def _text(content: Any) -> str:
    """Message content as text: a string, None, or a list of {"type": "text"} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text"))
    raise ToolError("messages",
                    f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _call_parts(tc: Any, where: str) -> tuple[str, str, str]:
    """(id, name, arguments JSON text) of an OpenAI tool_calls entry."""
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError(where, f"{where} must be "
                        "{\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args)
    return str(tc.get("id") or ""), fn["name"], args


def _loads_or_text(args: str) -> Any:
    try:
        return json.loads(args)
    except json.JSONDecodeError:
        return args


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a tools-aware template: tool_calls with their arguments as dicts (as
    Hugging Face templates read them), tool results with the called function's name."""
    names: dict[str, str] = {}
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for j, tc in enumerate(m["tool_calls"]):
                cid, name, args = _call_parts(tc, f"messages[{i}].tool_calls[{j}]")
                names[cid] = name
                calls.append({"id": cid, "type": "function",
                              "function": {"name": name, "arguments": _loads_or_text(args)}})
            m["tool_calls"] = calls
            m["content"] = _text(m.get("content"))
        elif m.get("role") == "tool":
            m["content"] = _text(m.get("content"))
            m.setdefault("name", names.get(str(m.get("tool_call_id", "")), ""))
        out.append(m)
    return out


def generic_messages(messages: list[dict[str, Any]], functions: list[Function]) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: the tool descriptions join the system
    message, calls are written as <tool_call> blocks in the assistant's text, tool results
    become user turns of <tool_response> blocks, and consecutive turns of one role merge
    (templates such as Gemma's insist on alternating turns)."""
    names: dict[str, str] = {}
    flat: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            blocks = []
            for j, tc in enumerate(m["tool_calls"]):
                cid, name, args = _call_parts(tc, f"messages[{i}].tool_calls[{j}]")
                names[cid] = name
                blocks.append(f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n</tool_call>')
            text = "\n".join(([_text(m.get("content"))] if m.get("content") else []) + blocks)
            flat.append({"role": "assistant", "content": text})
        elif role == "tool":
            name = m.get("name") or names.get(str(m.get("tool_call_id", "")), "")
            body = json.dumps({"name": name, "content": _text(m.get("content"))}, ensure_ascii=False)
            flat.append({"role": "user", "content": f"<tool_response>\n{body}\n</tool_response>"})
        else:
            flat.append(dict(m))
    if functions:
        prompt = generic_system_prompt(functions)
        if flat and flat[0].get("role") == "system":
            flat[0] = {**flat[0], "content": _text(flat[0].get("content")) + "\n\n" + prompt}
        else:
            flat.insert(0, {"role": "system", "content": prompt})
    merged: list[dict[str, Any]] = []
    for m in flat:
        if merged and merged[-1].get("role") == m.get("role") and m.get("role") in ("user", "tool"):
            merged[-1] = {**merged[-1], "content": _text(merged[-1].get("content")) + "\n" + _text(m.get("content"))}
        else:
            merged.append(m)
    return merged


# ---------------------------------------------------------------- constraints

# Where a function's parameters go inside its call schema, so that their own "#..." refs
# still resolve once the parameters sit under "arguments".
_PARAMS_DEF = "ellm_parameters"


def _relocate_refs(schema: Any, base: str) -> Any:
    """schema with every local $ref ("#", "#/...") moved under the JSON pointer base."""
    if isinstance(schema, list):
        return [_relocate_refs(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in structured.DATA_KEYWORDS:
            out[k] = v
        elif k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = base + v[1:]
        elif k in structured.SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _relocate_refs(sub, base) for name, sub in v.items()}
        else:
            out[k] = _relocate_refs(v, base)
    return out


def _has_refs(schema: Any) -> bool:
    if isinstance(schema, dict):
        return any((k == "$ref" and isinstance(v, str)) or (k not in structured.DATA_KEYWORDS and _has_refs(v))
                   for k, v in schema.items())
    if isinstance(schema, list):
        return any(_has_refs(x) for x in schema)
    return False


def call_schema(f: Function, args_key: str = "arguments") -> dict[str, Any]:
    """One call of f as a JSON schema: {"name": f's name, args_key: its parameters}. The
    parameters are made strict (structured.strict_objects) and, when they use $ref, moved into the
    call schema's $defs with their refs rewritten, so "#/$defs/X" (every nested pydantic
    model) still resolves inside the call object."""
    params = structured.strict_objects(f.parameters)
    defs: dict[str, Any] = {}
    if _has_refs(params):
        defs[_PARAMS_DEF] = _relocate_refs(params, f"#/$defs/{_PARAMS_DEF}")
        params = {"$ref": f"#/$defs/{_PARAMS_DEF}"}
    schema: dict[str, Any] = {"type": "object", "properties": {"name": {"const": f.name}, args_key: params},
                              "required": ["name", args_key], "additionalProperties": False}
    if defs:
        schema["$defs"] = defs
    return {**schema, "x-guidance": _COMPACT}


def check_parameters(functions: list[Function]) -> None:
    """Compiles each function's call schema; a schema llguidance cannot use (an unresolved
    $ref, a bad keyword) is a ToolError naming that tool's parameters."""
    for f in functions:
        try:
            structured.compile_constraint("json_schema", call_schema(f))
        except ValueError as e:
            raise ToolError(f.where, f"{f.where} (function {f.name!r}) cannot constrain a call: {e}") from None


# How each format writes a sequence of calls: (before the first, between two, after the last).
_SEPARATORS = {"hermes": ("", r'"\n"', ""), "generic": ("", r'"\n"', ""), "llama3": ("", '"; "', ""),
               "mistral": ('"["', '", "', '"]"')}


def call_grammar(functions: list[Function], fmt: str, *, parallel: bool = True,
                 answer: dict[str, Any] | None = None) -> str:
    """A Lark grammar (llguidance dialect: %json embeds a JSON schema) for one call, or
    when parallel 1..min(MAX_PARALLEL_CALLS, len(functions)) calls, of the given functions
    in format fmt; each function is called at most once, in the order of the list (so a
    small model cannot repeat a call until max_tokens). With answer (a JSON schema), the
    output may instead be one JSON value of that schema: tool_choice "auto" with a
    response format. The Mistral grammar leaves out the [TOOL_CALLS] control token (a
    grammar matches text; the parser reads the array with or without it)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; known: {', '.join(FORMATS)}")
    if not functions:
        raise ValueError("a call grammar needs at least one function")
    n = len(functions)
    most = min(MAX_PARALLEL_CALLS, n) if parallel else 1
    before, sep, after = _SEPARATORS[fmt]
    key = "parameters" if fmt == "llama3" else "arguments"
    rules = ["start: calls" + (" | answer" if answer is not None else ""),
             "calls: " + " ".join(x for x in (before, "first0", after) if x)]
    for i, f in enumerate(functions):
        body = f"%json {json.dumps(call_schema(f, key))}"
        if fmt in ("hermes", "generic"):
            rules += [f"body{i}: {body}", rf'call{i}: "<tool_call>\n" body{i} "\n</tool_call>"']
        else:
            rules.append(f"call{i}: {body}")
    # first<i>: calls from function i on, the first of them i or later; more<i>_<k>: up
    # to k further calls, each after sep, from function i on (one rule set, unambiguous).
    for i in range(n):
        rest = f" more{i + 1}_{most - 1}" if i + 1 < n and most > 1 else ""
        alts = [f"call{i}{rest}", f"call{i}"] if rest else [f"call{i}"]
        if i + 1 < n:
            alts.append(f"first{i + 1}")
        rules.append(f"first{i}: " + " | ".join(alts))
    for k in range(1, most):
        for i in range(1, n):
            rest = f" more{i + 1}_{k - 1}" if i + 1 < n and k > 1 else ""
            alts = [f"{sep} call{i}{rest}", f"{sep} call{i}"] if rest else [f"{sep} call{i}"]
            if i + 1 < n:
                alts.append(f"more{i + 1}_{k}")
            rules.append(f"more{i}_{k}: " + " | ".join(alts))
    if answer is not None:
        rules.append(f"answer: %json {json.dumps({'x-guidance': _COMPACT, **answer})}")
    return "\n".join(rules) + "\n"


# ---------------------------------------------------------------- parsing

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_TAIL = re.compile(r"\s*</tool_call>")


def _hermes_block_end(text: str, start: int, final: bool = True) -> int | None:
    """Where the <tool_call> block opening at start ends (past its closing tag, or the end
    of text). Its JSON value is read whole first, so a string in the arguments may hold
    "</tool_call>" itself. None while the block may still grow (final False). A block
    whose text is not one JSON value ends at its first closing tag."""
    body = start + len(_HERMES_OPEN)
    while body < len(text) and text[body].isspace():
        body += 1
    try:
        _, after = json.JSONDecoder().raw_decode(text, body)
    except json.JSONDecodeError:
        if not final:
            return None   # unfinished, or not JSON: known once the output ends
        after = body
    else:
        tail = _HERMES_TAIL.match(text, after)
        if tail is not None:
            return tail.end()
        rest = text[after:].strip()
        if not final and (not rest or _HERMES_CLOSE.startswith(rest)):
            return None   # the closing tag may still come
    end = text.find(_HERMES_CLOSE, after)
    if end < 0:
        return len(text) if final else None
    return end + len(_HERMES_CLOSE)


def _hermes_blocks(text: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, the text inside the tags) of each <tool_call> block of a whole output."""
    at = text.find(_HERMES_OPEN)
    while at >= 0:
        end = _hermes_block_end(text, at)
        assert end is not None
        inner = text[at + len(_HERMES_OPEN):end]
        if inner.endswith(_HERMES_CLOSE):
            inner = inner[:-len(_HERMES_CLOSE)]
        yield at, end, inner.strip()
        at = text.find(_HERMES_OPEN, end)
_MISTRAL_ARGS = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")


def _as_call(obj: Any, functions: list[Function] | None, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if functions is not None and not any(f.name == obj["name"] for f in functions):
        return None
    for k in args_keys:
        if k in obj:
            args = obj[k]
            break
    else:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, seps: str) -> list[Any] | None:
    """Consecutive JSON values in text separated by any of seps (and whitespace); None
    when anything else is there."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in seps):
            i += 1
        if i == len(text):
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(v)


def _all_parsed(calls: list[ToolCall | None]) -> list[ToolCall]:
    """calls when every one parsed (none is None), else []."""
    parsed = [c for c in calls if c is not None]
    return parsed if len(parsed) == len(calls) else []


def parse_calls(text: str, fmt: str, functions: list[Function] | None = None,
                cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from a model's whole output in format fmt. Calls to functions not
    in `functions` (when given) and blocks that do not parse stay in the content, except,
    when the output was cut short (cut: max_tokens), the unfinished call it ends with:
    that is dropped, never shown as text."""
    if cut:
        text = _without_cut_call(text, fmt, functions)
    if fmt in ("hermes", "generic"):
        calls: list[ToolCall] = []
        kept: list[str] = []
        last = 0
        for start, end, inner in _hermes_blocks(text):
            try:
                call = _as_call(json.loads(inner), functions, ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue
            kept.append(text[last:start])
            last = end
            calls.append(call)
        kept.append(text[last:])
        content = "".join(kept).strip()
        return (content or None), calls
    if fmt == "llama3":
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        values = _json_values(body, ";") if body.lstrip().startswith("{") else None
        parsed = _all_parsed([_as_call(v, functions, ("parameters", "arguments")) for v in values or []])
        if parsed:
            return None, parsed
        return (text.strip() or None), []
    if fmt == "mistral":
        head, marker, rest = text.partition("[TOOL_CALLS]")
        if not marker:
            head, rest = "", text  # a constrained turn is the bare array
        found: list[ToolCall | None] = []
        values = _json_values(rest, "")
        if values and len(values) == 1 and isinstance(values[0], list):
            found = [_as_call(v, functions, ("arguments",)) for v in values[0]]
        elif marker:  # name[ARGS]{...} per call
            dec, i = json.JSONDecoder(), 0
            while (m := _MISTRAL_ARGS.match(rest, i)):
                try:
                    args, i = dec.raw_decode(rest, m.end())
                except json.JSONDecodeError:
                    found = []
                    break
                found.append(_as_call({"name": m.group(1), "arguments": args}, functions, ("arguments",)))
                i = len(rest) - len(rest[i:].lstrip().removeprefix("[TOOL_CALLS]"))
            if rest[i:].strip():
                found = []
        parsed = _all_parsed(found)
        if parsed:
            return (head.strip() or None), parsed
        return (text.strip() or None), []
    raise ValueError(f"unknown tool call format {fmt!r}")


def _without_cut_call(text: str, fmt: str, functions: list[Function] | None) -> str:
    """text less an unfinished call at its end (an output cut by max_tokens)."""
    if fmt in ("hermes", "generic"):
        at = text.rfind("<tool_call>")
        if at >= 0 and "</tool_call>" not in text[at:]:
            _, calls = parse_calls(text[at:], fmt, functions)
            return text if calls else text[:at]   # (a whole JSON object without its closing tag stands)
        return text[:len(text) - _partial_suffix(text, "<tool_call>")]
    content, calls = parse_calls(text, fmt, functions)
    if calls:
        return text
    body = text.lstrip()
    markers = ("{", "<|python_tag|>") if fmt == "llama3" else ("[TOOL_CALLS]", "[")
    if any(body.startswith(m) for m in markers):
        return ""   # it opened as a call and was cut before it closed
    at = text.find("[TOOL_CALLS]") if fmt == "mistral" else -1
    return text[:at] if at >= 0 else text


class StreamParser:
    """parse_calls for a stream: feed() text deltas, then finish(). Each returns events,
    ("content", text) or ("call", ToolCall), in order; together they give what
    parse_calls gives on the whole text. Content streams until something may be a call:
    hermes-style text is held only from a possible `<tool_call>` on, and each call comes
    out when its block closes; llama3 / mistral output that opens like a call is held to
    the end (their calls have no closing marker). Whitespace alone (the newline between
    two calls) is held until text follows it; beside calls it is not content, as in
    parse_calls."""

    def __init__(self, fmt: str, functions: list[Function] | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool call format {fmt!r}")
        self.fmt, self.functions = fmt, functions
        self._buf = ""
        self._hold_all = False
        self._started = False   # some non-space text has been seen (llama3 / mistral)
        self._lead = ""         # whitespace before the first text, held until it is decided
        self._space = ""        # whitespace-only content, held until what follows is known
        self._calls = 0         # calls sent so far

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        if self.fmt in ("hermes", "generic"):
            return self._settle(self._hermes(final=False), final=False)
        return self._settle(self._opener(), final=False)

    def finish(self, cut: bool = False) -> list[tuple[str, Any]]:
        """The last events; cut: the output was cut short (max_tokens), so an unfinished
        call at its end is dropped rather than sent as text (see parse_calls)."""
        if self.fmt in ("hermes", "generic"):
            if cut:
                self._buf = _without_cut_call(self._buf, self.fmt, self.functions)
            return self._settle(self._hermes(final=True), final=True)
        text, self._buf = self._lead + self._buf, ""
        self._lead = ""
        if cut and self._hold_all:
            text = _without_cut_call(text, self.fmt, self.functions)
        if not text:
            return self._settle([], final=True)
        if not self._hold_all:
            return self._settle([("content", text)], final=True)
        content, calls = parse_calls(text, self.fmt, self.functions)
        return self._settle(([("content", content)] if content else []) + [("call", c) for c in calls], final=True)

    def _settle(self, events: list[tuple[str, Any]], final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for kind, v in events:
            if kind == "content":
                if not v.strip():
                    self._space += v
                    continue
                v, self._space = self._space + v, ""
            else:
                self._space = ""
                self._calls += 1
            out.append((kind, v))
        if final and self._space:
            if not self._calls:   # a reply of whitespace alone is still the reply
                out.append(("content", self._space))
            self._space = ""
        return _merge_content(out)

    def _opener(self) -> list[tuple[str, Any]]:
        if self._hold_all:
            return []
        if not self._started:
            stripped = self._buf.lstrip()
            self._lead += self._buf[:len(self._buf) - len(stripped)]
            self._buf = stripped
            if not stripped:
                return []
            markers = ("{", "<|python_tag|>") if self.fmt == "llama3" else ("[TOOL_CALLS]", "[{", "[")
            if any(m.startswith(stripped) or stripped.startswith(m) for m in markers):
                if any(stripped.startswith(m) for m in markers):
                    self._hold_all = True
                return []  # a marker's prefix: wait for more
            self._started = True
        out, self._buf = self._lead + self._buf, ""
        self._lead = ""
        if self.fmt == "mistral":  # calls may follow some text: hold from the marker on
            at = out.find("[TOOL_CALLS]")
            if at >= 0:
                self._buf, self._hold_all, out = out[at:], True, out[:at]
            else:
                keep = _partial_suffix(out, "[TOOL_CALLS]")
                out, self._buf = out[:len(out) - keep], out[len(out) - keep:]
        return [("content", out)] if out else []

    def _hermes(self, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        open_ = _HERMES_OPEN
        while self._buf:
            start = self._buf.find(open_)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buf, open_)
                text = self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                if text:
                    out.append(("content", text))
                break
            stop = _hermes_block_end(self._buf, start, final)
            if stop is None:
                if start:
                    out.append(("content", self._buf[:start]))
                    self._buf = self._buf[start:]
                break
            block = self._buf[:stop] if start == 0 else self._buf[start:stop]
            if start:
                out.append(("content", self._buf[:start]))
            _, calls = parse_calls(block, self.fmt, self.functions)
            out.extend(("call", c) for c in calls) if calls else out.append(("content", block))
            self._buf = self._buf[stop:]
        return _merge_content(out)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _merge_content(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for kind, v in events:
        if kind == "content" and out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + v)
        else:
            out.append((kind, v))
    return out


# ---------------------------------------------------------------- the plan for one request

@dataclass
class ToolPlan:
    """Everything one chat request with tools needs: how to render its prompt, how to
    constrain its generation, how to read its output."""

    functions: list[Function]
    mode: str                     # none | auto | required | named
    name: str | None              # the function of a named tool_choice
    fmt: str
    native: bool                  # the chat template takes the tools itself
    parallel: bool = True

    @classmethod
    def make(cls, tokenizer: Any, tools: Any, tool_choice: Any = None,
             parallel_tool_calls: bool | None = True) -> ToolPlan:
        functions = parse_tools(tools)
        mode, name = parse_tool_choice(tool_choice, functions)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ToolError("parallel_tool_calls", "parallel_tool_calls must be true or false")
        template = getattr(tokenizer, "chat_template", None)
        fmt = detect_format(template)
        return cls(functions, mode, name, fmt, native=fmt != "generic",
                   parallel=parallel_tool_calls is not False and mode != "named")

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def render(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages for the template, tools for the template)."""
        shown = self.functions if self.mode != "none" else []
        if self.mode == "named":  # only the named function is offered
            shown = [f for f in self.functions if f.name == self.name]
        if self.native:
            tools = [{"type": "function", "function": f.spec()} for f in shown] or None
            return native_messages(messages), tools
        return generic_messages(messages, shown), None

    def prompt_ids(self, tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
        msgs, tools = self.render(messages)
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tools=tools)
        ids = tokenizer.encode(text, add_special_tokens=False)
        bos = getattr(tokenizer, "bos_token_id", None)
        if getattr(tokenizer, "add_bos", False) and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def grammar(self, answer: dict[str, Any] | None = None) -> str | None:
        """The Lark grammar that constrains a required / named turn, or (answer: a JSON
        schema) an auto turn that is either calls or an answer of that schema; else None."""
        if self.mode == "required":
            return call_grammar(self.functions, self.fmt, parallel=self.parallel)
        if self.mode == "named":
            return call_grammar([f for f in self.functions if f.name == self.name], self.fmt, parallel=False)
        if self.mode == "auto" and answer is not None:
            return call_grammar(self.functions, self.fmt, parallel=self.parallel, answer=answer)
        return None

    def sampling(self, params: Any) -> Any:
        """params with the call grammar set; special tokens kept in the text where the
        format's markers are special tokens. With a JSON schema response format: a
        required / named turn is calls alone, so the format (which shapes the assistant's
        answer) has nothing to apply to in it and the call grammar replaces it; an auto
        turn is either calls or an answer in that schema (one grammar with both). A regex,
        choice or grammar constraint cannot be joined with calls (a ToolError)."""
        changes: dict[str, Any] = {}
        answer = None
        if params.constraint is not None and self.mode != "none":
            kind = params.constraint[0]
            if kind != "json_schema":
                raise ToolError("tool_choice", f"tool_choice {self.mode!r} cannot be combined with {kind} (only "
                                               f"with a JSON schema response format); use tool_choice 'none'")
            if self.mode == "auto":
                answer = params.json_schema
        g = self.grammar(answer)
        if g is not None:
            check_parameters(self.functions if self.mode != "named" else
                             [f for f in self.functions if f.name == self.name])
            changes.update(json_schema=None, regex=None, choice=None, grammar=g)
        if self.parses and self.fmt in ("llama3", "mistral"):
            changes["skip_special_tokens"] = False
        try:
            return dataclasses.replace(params, **changes) if changes else params
        except ValueError as e:   # (each part was checked alone: this is their combination)
            raise ToolError("tools", f"the tools' call grammar cannot be used: {e}") from None

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a reply; cut: it was cut short by max_tokens (an unfinished
        call at its end is dropped, not returned as text)."""
        if not self.parses:
            return text, []
        content, calls = parse_calls(text, self.fmt, self.functions, cut=cut)
        if calls:
            return content, calls
        return (_without_cut_call(text, self.fmt, self.functions) or None) if cut else text, []

    def stream_parser(self) -> StreamParser | None:
        return StreamParser(self.fmt, self.functions) if self.parses else None
