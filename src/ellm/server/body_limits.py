"""How deep a JSON request body may nest, measured on its bytes before it is parsed.

Python's json module parses nested arrays and objects by recursion: a body of 100,000
'[' raises RecursionError (a 500 where it escapes), and one a little under the
interpreter's limit still costs deep recursion in every validator that walks it. So the
server measures the nesting of each JSON body on the raw bytes first (strings removed by
one regex, the brackets counted by numpy: ~20 ms for the largest body allowed) and
answers one past MAX_JSON_DEPTH with a 400 naming the limit.
"""
from __future__ import annotations

import re

import numpy as np

MAX_JSON_DEPTH = 100   # a 64-level json_schema (constraint_bounds) fits inside a request

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_STEP = np.zeros(256, np.int8)
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (strings ignored); for
    text that is not JSON, some number the parser will refuse anyway."""
    if b"[" not in raw and b"{" not in raw:
        return 0
    bare = _STRING.sub(b"", raw) if b'"' in raw else raw
    steps = _STEP[np.frombuffer(bare, np.uint8)]
    steps = steps[steps != 0]
    if steps.size == 0:
        return 0
    return int(np.cumsum(steps, dtype=np.int64).max())


def depth_error(raw: bytes, limit: int = MAX_JSON_DEPTH) -> str | None:
    """None for a body within the limit, else the message of its 400."""
    depth = json_depth(raw)
    if depth > limit:
        return (f"the request body nests arrays and objects {depth} levels deep; "
                f"this server takes at most {limit}")
    return None
