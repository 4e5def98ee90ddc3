"""Where the server compiles requests' constraints: threads of their own, with a deadline.

Checking and compiling a grammar, schema or choice list (and building its llguidance
matcher against the vocabulary) is CPU work of up to about a second even within the
bounds of engine/constraint_bounds.py. Done on the event loop it froze /health and every
stream for that long; done in the tokenizer threads it would queue other clients' plain
prompts behind it. So it runs here, COMPILE_THREADS at a time; a request whose compile
takes longer than the deadline is answered 503 (the work finishes in its thread and its
result is kept for the next request with the same constraint). The seconds are observed
in ellm_constraint_compile_seconds and are part of the request's own latency.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .errors import APIError

COMPILE_THREADS = 2
COMPILE_DEADLINE_S = 30.0


class ConstraintCompiler:
    def __init__(self, threads: int = COMPILE_THREADS, deadline_s: float = COMPILE_DEADLINE_S,
                 observe: Callable[[float], None] | None = None) -> None:
        self.deadline_s = deadline_s
        self._observe = observe
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ellm-constraints")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in the compile threads, within the deadline."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        future = loop.run_in_executor(self._pool, functools.partial(fn, *args))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.deadline_s)
        except asyncio.TimeoutError:
            raise APIError(503, f"the request's structured-output constraint took more than {self.deadline_s:g} s "
                                f"to compile; try again or simplify it", type="server_error",
                           code="constraint_compile_timeout") from None
        finally:
            if self._observe is not None:
                self._observe(time.perf_counter() - t0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
