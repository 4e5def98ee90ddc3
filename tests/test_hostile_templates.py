"""Hostile chat templates: a template must not exhaust memory or time.

Every trick that builds a huge string in one step (format widths and padding, doubling by
`~` / `+` / `*`, replace and join explosions, tojson indent) fails fast with a clear
ChatTemplateError; runaway loops stop at the wall-clock limit by themselves, also in a
worker thread, without freezing an event loop; the limits are configurable. Benign uses
of the same features render exactly as Jinja's stock sandbox renders them.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import jinja2.sandbox
import pytest

from ellm.tokenization.template import (
    ChatTemplateError,
    RenderLimits,
    default_limits,
    render_chat,
    set_default_limits,
)

MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
FAST = RenderLimits(max_seconds=0.5)


def refused(source: str, needle: str, limits: RenderLimits = FAST) -> str:
    """The render fails with ChatTemplateError matching needle; a hang fails the test
    (the render runs in a thread that is given 60 s) instead of hanging it."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            render_chat(source, MSGS, render_limits=limits)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            box[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"render of {source[:60]!r} did not stop"
    err = box[0]
    assert isinstance(err, ChatTemplateError), f"{source[:60]!r} gave {err!r}"
    assert pytest.importorskip("re").search(needle, str(err)), str(err)
    return str(err)


@pytest.mark.parametrize("source", [
    '{{ "%999999999s" % "x" }}',
    '{{ "%.999999999f" % 1.5 }}',
    '{{ "%(a)999999999s" % {"a": 1} }}',
    '{{ "%-0999999999d"|format(7) }}',
    '{{ "{:>999999999}".format("x") }}',
    '{{ "{0:.999999999f}".format(1.5) }}',
    '{{ "{a:^999999999}".format_map({"a": 1}) }}',
])
def test_format_widths(source: str) -> None:
    refused(source, "width 999999999 is over the limit")


@pytest.mark.parametrize("source", [
    '{{ "%*s" % (999999999, "x") }}',
    '{{ "%*s"|format(999999999, "x") }}',
    '{{ "{:>{w}}".format("x", w=999999999) }}',
])
def test_widths_from_arguments(source: str) -> None:
    refused(source, "width from its arguments|nest fields")


@pytest.mark.parametrize("source", [
    '{{ "x".ljust(999999999) }}', '{{ "x".rjust(999999999) }}', '{{ "x".center(999999999) }}',
    '{{ "7".zfill(999999999) }}', '{{ "a\tb".expandtabs(999999999) }}',
    '{{ "x"|center(999999999) }}', '{{ "a\nb"|indent(999999999) }}', '{{ [1, 2]|batch(999999999, 0)|list }}',
    '{{ [1, 2]|slice(999999999)|list }}', '{{ messages|tojson(indent=999999999) }}',
])
def test_padding_methods_and_filters(source: str) -> None:
    refused(source, "over the limit")


@pytest.mark.parametrize("source", [
    '{% set ns = namespace(s="ab") %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}',
    '{% set ns = namespace(s="ab") %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}',
    '{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}',
    '{% set ns = namespace(s="ab") %}{% for i in range(64) %}{% set ns.s = ns.s * 2 %}{% endfor %}',
    '{{ "ab" * 10**9 }}', '{{ [0] * 10**9 }}',
    '{% set ns = namespace(s="ab") %}{% for i in range(64) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}',
    '{% set ns = namespace(s="ab") %}{% for i in range(64) %}{% set ns.s = ns.s.join([ns.s, ns.s, "x"]) %}{% endfor %}',
    '{{ ("a" * 1000)|replace("a", "b" * 100000) }}',
    '{{ ("a" * 1000).replace("", "b" * 100000) }}',
])
def test_doubling_and_explosions(source: str) -> None:
    refused(source, "may not build .* items")


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(10) %}{{ '' }}{% endfor %}{% endfor %}{% endfor %}",
    "{% for a in [0] * 1000000 %}{% for b in [0] * 1000000 %}{% endfor %}{% endfor %}",
    "{% macro spin(n) %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endmacro %}{{ spin(1) }}",
    "{% for i in range(100000) %}{% set x = (range(100000)|list)|sort %}{% endfor %}",
])
def test_runaway_loops_stop_at_the_time_limit(source: str) -> None:
    refused(source, r"took more than 0.5 s to render")


def test_output_limit_and_configurable_limits() -> None:
    big = "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}"
    refused(big, "may not render more than 4000000 characters", RenderLimits(max_seconds=30))
    small = RenderLimits(max_output_chars=10)
    refused("{% for m in messages %}{{ m.content }}{% endfor %}{{ 'x' * 20 }}", "10", small)
    assert render_chat("{{ '%8s' % 'x' }}", MSGS, render_limits=RenderLimits(max_format_width=8)) == "       x"
    refused("{{ '%9s' % 'x' }}", "width 9 is over the limit of 8", RenderLimits(max_format_width=8))
    before = default_limits()
    try:
        set_default_limits(RenderLimits(max_output_chars=3))
        with pytest.raises(ChatTemplateError, match="3 characters"):
            render_chat("{{ 'abcd' }}", MSGS)
    finally:
        set_default_limits(before)
    assert render_chat("{{ 'abcd' }}", MSGS) == "abcd"
    for bad in ({"max_output_chars": 0}, {"max_seconds": 0}, {"max_seconds": float("inf")}, {"max_format_width": True}):
        with pytest.raises(ValueError, match="RenderLimits"):
            RenderLimits(**bad)


BENIGN = [
    "{{ '%5s|%-4d|%.2f' % ('ab', 7, 3.14159) }}",
    "{{ '%s and %s'|format('a', 'b') }}",
    "{{ '{:>6}|{:^5}|{:.3f}'.format('x', 'y', 2.5) }}",
    "{{ 'ab'.ljust(5) ~ '|' ~ 'ab'.rjust(5) ~ '|' ~ '7'.zfill(3) ~ '|' ~ 'x'.center(5) }}",
    "{{ 'title'|center(11) }}|{{ 'a\nb'|indent(2, first=true) }}",
    "{{ [1, 2, 3, 4, 5]|batch(2, 0)|list }}{{ [1, 2, 3]|slice(2)|list }}",
    "{{ messages|tojson(indent=2) }}",
    "{{ ['a', 'b', 'c']|join(', ') }}{{ '-'.join(['x', 'y']) }}{{ 'aXbX'|replace('X', '--') }}{{ 'aXb'.replace('X', '_') }}",
    "{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s ~ m.role ~ ':' ~ m.content ~ ';' %}{% endfor %}{{ ns.s }}",
    "{{ 'ab' * 3 }}{{ [1] + [2] }}{{ 'x' + 'y' }}{{ 2 ** 10 }}{{ 7 % 3 }}",
    "{% for m in messages %}{% for i in range(3) %}{{ loop.index }}{{ m.role[:1] }}{% endfor %}{% endfor %}",
]


@pytest.mark.parametrize("source", BENIGN)
def test_benign_uses_render_as_the_stock_sandbox(source: str) -> None:
    stock = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    stock.filters["tojson"] = lambda v, indent=None: __import__("json").dumps(v, indent=indent)
    want = stock.from_string(source).render(messages=MSGS)
    assert render_chat(source, MSGS) == want


def test_runaway_render_in_a_worker_thread_leaves_the_event_loop_free() -> None:
    """The server renders in a thread pool; a runaway template there must stop by itself,
    and the loop keeps running meanwhile (counted in ticks, not timed)."""
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"

    async def main() -> tuple[BaseException | None, int]:
        loop = asyncio.get_running_loop()
        ticks = 0
        with ThreadPoolExecutor(2) as pool:
            fut = loop.run_in_executor(pool, lambda: render_chat(spin, MSGS, render_limits=RenderLimits(max_seconds=1.0)))
            while not fut.done():
                await asyncio.sleep(0.01)
                ticks += 1
            return fut.exception(), ticks

    err, ticks = asyncio.run(asyncio.wait_for(main(), 60))
    assert isinstance(err, ChatTemplateError) and "took more than 1 s" in str(err)
    assert ticks >= 10  # the loop ran while the template spun


def test_limits_of_one_thread_do_not_leak_into_another() -> None:
    tight = RenderLimits(max_output_chars=5)
    results: dict[str, object] = {}

    def render(name: str, limits: RenderLimits | None) -> None:
        try:
            results[name] = render_chat("{% for i in range(200) %}{{ 'ab' ~ i }}{% endfor %}", MSGS, render_limits=limits)
        except ChatTemplateError as e:
            results[name] = e

    threads = [threading.Thread(target=render, args=(f"t{i}", tight if i % 2 else None)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(6):
        r = results[f"t{i}"]
        assert isinstance(r, ChatTemplateError) if i % 2 else r == "".join(f"ab{j}" for j in range(200))
