"""Hostile input, round two (issue #33), outside the HTTP server:

- preemption with n > 1: sequences sharing prompt blocks are never preempted after being
  planned for the step (that left a -1 block-table entry and a 500);
- constraints are bounded before llguidance compiles them (a chain of 3,000 Lark rules
  overflowed its stack: SIGSEGV), naming the limit; pure $ref cycles are refused at
  validation; a choice of 10,000 options compiles through a trie regex, not quadratically;
- image URL fetching: the address policy (loopback refused unless allowed by name),
  nothing of a non-image response repeated, the connection goes to the checked address;
- `ellm inspect`: Host and Origin checked, JSON only, oversize bodies refused from the
  headers, a lone surrogate is a 400;
- a mapped model file rewritten in place is noticed at the next request;
- `ellm pull` names a full disk (tests/test_hub.py), and --kv-cache-tokens sizes the cache.
"""
from __future__ import annotations

import http.server
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ellm
from ellm.engine.engine import EngineConfig
from ellm.sampling_params import SamplingParams


# ---------------------------------------------------------------------------------------
# 3. preemption with n > 1 on a tiny KV pool
# ---------------------------------------------------------------------------------------

def test_preemption_with_shared_prompt_blocks_never_plans_a_freed_sequence(smollm2_gguf: Path) -> None:
    llm = ellm.load(smollm2_gguf, max_model_len=512, progress=False)
    eng = llm.engine
    # 2 prompts x n=8, 40 tokens each, on 24 blocks of 16: the pool runs dry while the
    # copies decode, and they share their prompt blocks through the prefix cache.
    eng.__init__(llm.model, llm.tokenizer, EngineConfig(max_model_len=512, kv_cache_tokens=24 * 16,
                                                         max_batch_tokens=128))
    prompts = ["Write a long story about a dragon who learns to bake bread in a small village.",
               "List every prime number you know, one per line, with a short remark on each."]
    params = SamplingParams(n=8, max_tokens=40, temperature=0.8, seed=1, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    for group in outs:
        assert len(group) == 8
        for out in group:
            assert out.finish_reason == "length", (out.finish_reason, getattr(out, "error", None))
            assert len(out.token_ids) == 40
    eng.blocks.clear_prefix_cache()
    assert eng.blocks.num_used() == 0   # every block came back


# ---------------------------------------------------------------------------------------
# 1. constraints bounded before compiling
# ---------------------------------------------------------------------------------------

def _lark_chain(n: int, reverse: bool = False) -> str:
    rules = [f'r{k}: "x" r{k + 1} | "y"' for k in range(n)] + [f'r{n}: "z"']
    return "\n".join(["start: r0"] + (rules[::-1] if reverse else rules))


def _gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= r0"] + [f'r{k} ::= "x" r{k + 1} | "y"' for k in range(n)] + [f'r{n} ::= "z"'])


_CHILD = r"""
import sys
from ellm.sampling_params import SamplingParams
try:
    SamplingParams(grammar=open(sys.argv[1]).read())
except ValueError as e:
    print("REFUSED:", e)
else:
    print("ACCEPTED")
"""


@pytest.mark.parametrize("make", [lambda: _lark_chain(3000), lambda: _lark_chain(3000, reverse=True),
                                  lambda: _gbnf_chain(1900)])
def test_deep_rule_chains_are_refused_not_a_crash(make, tmp_path: Path) -> None:
    # in a child: on the code before the bounds this killed the process (SIGSEGV)
    path = tmp_path / "g.txt"
    path.write_text(make())
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "REFUSED" in r.stdout and "over the limit of" in r.stdout, r.stdout
    assert "rule depth" in r.stdout or "number of rules" in r.stdout, r.stdout


@pytest.mark.parametrize("kind,value,words", [
    ("grammar", "start: " + " | ".join('"a"' for _ in range(12_000)), "alternatives"),
    ("grammar", "start: " + "(" * 150 + '"x"' + ")" * 150, "nesting"),
    ("grammar", "start: " + '"' + "x" * 200_000 + '"', "size"),
    ("choice", [f"o{k}" for k in range(10_001)], "number of choices"),
    ("regex", "a" * 20_000, "size"),
    ("json_schema", {"type": "object", "properties": {"a": {"enum": list(range(30_000))}}}, "node count"),
])
def test_oversized_constraints_name_the_limit(kind: str, value, words: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=words):
        SamplingParams(**{kind: value})
    assert time.monotonic() - t0 < 5   # refused before compiling (a generous bound: shared host)


def test_deeply_nested_schema_is_refused_without_recursion() -> None:
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="nested more than 64 levels"):
        SamplingParams(json_schema=schema)
    with pytest.raises(ValueError, match="nested more than 64 levels"):
        SamplingParams(json_schema=json.dumps({"a": [[[[[[[[[[]]]]]]]]]]}).replace("[]", "[" * 80 + "]" * 80))


def _parsed_depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_parsed_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_parsed_depth(v) for v in value.values()), default=0)
    return 0


def test_body_depth_agrees_with_the_parser_when_strings_hold_brackets_and_escapes() -> None:
    from ellm.server.body_limits import json_depth
    rng = random.Random(5)
    leaves = [1, None, 2.5, "a\"b\\", "\\", 'x\\"[{', "]]}", '"}' * 3, "\u00e9[", 'q\\\\\\"{', "\\\\"]

    def doc(depth: int) -> object:
        r = rng.random()
        if depth > 7 or r < 0.3:
            return rng.choice(leaves)
        if r < 0.65:
            return [doc(depth + 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice(["k", "[", '\\"', "{}"]) + str(i): doc(depth + 1) for i in range(rng.randint(0, 4))}

    for _ in range(3000):
        value = doc(0)
        raw = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        assert json_depth(raw) == _parsed_depth(value), raw


def test_body_depth_of_an_unterminated_string_full_of_escaped_quotes() -> None:
    """The depth check runs on the event loop for every body. It used to cut strings out
    with a regex that, on a string with no closing quote, retried from every quote: quadratic
    (24 KB of 'a\\"' froze the loop for ~20 s). Brackets after the opening quote are the
    string's, as the parser reads them."""
    from ellm.server.body_limits import depth_error, json_depth
    raw = b'{"prompt": "' + b'a\\"' * 3000 + b"[[[["
    assert json_depth(raw) == 1
    deep = b'{"prompt": "' + b'a\\"' * 200_000 + b"]" + b"[" * 150   # 600 KB: answered at once
    assert json_depth(deep) == 1 and depth_error(deep) is None


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
])
def test_pure_ref_cycles_are_refused_at_validation(schema) -> None:
    with pytest.raises(ValueError, match=r"\$ref cycle"):
        SamplingParams(json_schema=schema)


def test_real_recursion_and_large_choices_still_work(smollm2_gguf: Path) -> None:
    llm = ellm.load(smollm2_gguf, max_model_len=256, progress=False)
    tree = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                             "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
            "required": ["name", "kids"]}
    out = llm.generate("A tree as JSON:", SamplingParams(json_schema=tree, max_tokens=60, temperature=0.0))
    if out.finish_reason == "stop":
        json.loads(out.text)
    options = [f"option number {k}" for k in range(9_990)] + ["a", "ab", "abc", "b/c", "d.e*", "tab\there"]
    t0 = time.monotonic()
    params = SamplingParams(choice=options, max_tokens=20, temperature=1.0, seed=3)
    compile_s = time.monotonic() - t0
    for seed in range(4):
        got = llm.generate("Pick one:", SamplingParams(choice=options, max_tokens=20, temperature=1.0, seed=seed))
        assert got.text in options, got.text
    got = llm.generate("Pick one:", SamplingParams(choice=["a", "ab", "abc"], max_tokens=5, temperature=0.0))
    assert got.text in ("a", "ab", "abc")
    assert params.constraint is not None and compile_s < 30


# ---------------------------------------------------------------------------------------
# 4. image URLs: the address policy, nothing repeated
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_host() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:   # noqa: N802
            body = b"SECRET-INTERNAL-PAGE " * 20
            self.send_response(403 if self.path == "/admin" else 200)
            self.send_header("Content-Type", "application/octet-stream" if self.path == "/octet" else "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize("url", [
    "http://{host}/", "http://localhost:{port}/", "http://[::1]:{port}/", "http://[::ffff:127.0.0.1]:{port}/",
    "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/", "http://192.168.1.1/", "http://0.0.0.0:{port}/",
    "http://2130706433:{port}/", "http://100.64.0.1/", "http://224.0.0.1/",
])
def test_image_urls_into_the_servers_network_are_refused(local_host: str, url: str) -> None:
    from ellm.vision.fetch import FetchLimits, fetch_image
    from ellm.vision.images import ImageError
    port = local_host.split(":")[1]
    t0 = time.monotonic()
    with pytest.raises(ImageError, match="not a public internet address|does not resolve") as e:
        fetch_image(url.format(host=local_host, port=port), "img", FetchLimits(timeout_s=5))
    assert time.monotonic() - t0 < 5    # refused before connecting
    assert "SECRET" not in str(e.value)


@pytest.mark.parametrize("path", ["/", "/admin", "/octet"])
def test_non_image_answers_are_not_repeated(local_host: str, path: str) -> None:
    from ellm.vision.fetch import FetchLimits, fetch_image
    from ellm.vision.images import ImageError
    with pytest.raises(ImageError) as e:
        fetch_image(f"http://{local_host}{path}", "img", FetchLimits(allowed_hosts=("127.0.0.1",)))
    msg = str(e.value)
    assert "SECRET" not in msg and "403" not in msg and "text/html" not in msg and "no image came back" in msg
    # a closed port says the same as a 403 page: no port-scan oracle
    with pytest.raises(ImageError) as closed:
        fetch_image("http://127.0.0.1:1/x.png", "img", FetchLimits(allowed_hosts=("127.0.0.1",)))
    assert str(closed.value) == msg


def test_address_policy_table() -> None:
    import ipaddress
    from ellm.vision.fetch import address_is_public
    public = ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"]
    private = ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.0.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
               "224.0.0.1", "255.255.255.255", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
               "64:ff9b::7f00:1", "2002:7f00:1::1", "::"]
    assert all(address_is_public(ipaddress.ip_address(a)) for a in public)
    assert not any(address_is_public(ipaddress.ip_address(a)) for a in private)


# ---------------------------------------------------------------------------------------
# 6. ellm inspect: Host, Origin, content type, body size, surrogates
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def inspect_url(smollm2_gguf: Path) -> Iterator[str]:
    uvicorn = pytest.importorskip("uvicorn")
    from ellm.trace.inspect.app import Inspector, create_app
    llm = ellm.load(smollm2_gguf, max_num_seqs=1, max_model_len=256, progress=False)
    config = uvicorn.Config(create_app(Inspector(llm, "smollm2", max_tokens=32), hosts=("127.0.0.1",)),
                            host="127.0.0.1", port=0, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the inspect server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    srv.should_exit = True
    thread.join(10)


def test_inspect_refuses_foreign_hosts_and_origins(inspect_url: str) -> None:
    httpx = pytest.importorskip("httpx")
    body = {"prompt": "Hello"}
    assert httpx.post(inspect_url + "/api/trace", json=body, timeout=60).status_code == 200
    r = httpx.post(inspect_url + "/api/trace", json=body, headers={"Origin": inspect_url}, timeout=60)
    assert r.status_code == 200   # the page itself
    r = httpx.get(inspect_url + "/api/model", headers={"Host": "evil.example:80"}, timeout=30)
    assert r.status_code == 421 and "Host" in r.json()["error"]
    r = httpx.post(inspect_url + "/api/trace", json=body, headers={"Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 403
    r = httpx.post(inspect_url + "/api/trace", content=json.dumps(body), headers={"Content-Type": "text/plain"},
                   timeout=30)
    assert r.status_code == 415


def test_inspect_bounds_bodies_and_refuses_surrogates(inspect_url: str) -> None:
    import socket
    httpx = pytest.importorskip("httpx")
    host, port = inspect_url.split("//")[1].split(":")
    # a Content-Length of 300 MB is refused before a byte of the body is sent
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /api/trace HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 300000000\r\n\r\n")
        head = s.recv(4096)
    assert b" 413 " in head.split(b"\r\n")[0], head[:200]

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'
    r = httpx.post(inspect_url + "/api/trace", content=chunks(), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413
    r = httpx.post(inspect_url + "/api/trace", content=b'{"prompt": "a\\ud800b"}',
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]
    r = httpx.post(inspect_url + "/api/trace", content=b"[" * 100_000 + b"]" * 100_000,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400


# ---------------------------------------------------------------------------------------
# 8. a mapped model file rewritten in place; the KV pool size on the command line
# ---------------------------------------------------------------------------------------

def test_model_file_rewritten_in_place_is_noticed(smollm2_gguf: Path, tmp_path: Path) -> None:
    from ellm.engine.engine import ModelFileChanged
    path = tmp_path / "m.gguf"
    shutil.copyfile(smollm2_gguf, path)
    llm = ellm.load(path, max_model_len=128, progress=False)
    assert llm.generate("Hi", max_tokens=2).text is not None
    os.replace(tmp_path / "m.gguf", tmp_path / "m.gguf")   # (no change)
    assert llm.generate("Hi", max_tokens=2).text is not None
    with open(path, "r+b") as f:                      # overwritten in place, same size
        f.seek(os.path.getsize(path) - 4096)
        f.write(b"\x00" * 16)
        f.flush()
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))   # (coarse clocks)
    with pytest.raises(ModelFileChanged, match="changed on disk while it was in use"):
        llm.generate("Hi", max_tokens=2)


def test_replacing_the_file_by_rename_is_not_a_change(smollm2_gguf: Path, tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    shutil.copyfile(smollm2_gguf, path)
    llm = ellm.load(path, max_model_len=128, progress=False)
    shutil.copyfile(smollm2_gguf, tmp_path / "new.gguf")
    os.replace(tmp_path / "new.gguf", path)   # the mapping keeps the old file's bytes
    assert len(llm.generate("Hi", max_tokens=2).token_ids) == 2


def test_kv_cache_tokens_flag(smollm2_gguf: Path) -> None:
    import argparse
    from ellm.server.cli import add_arguments
    serve = argparse.ArgumentParser()
    add_arguments(serve)
    assert serve.parse_args(["--kv-cache-tokens", "4096"]).kv_cache_tokens == 4096
    llm = ellm.load(smollm2_gguf, max_model_len=256, kv_cache_tokens=640, progress=False)
    assert sum(p.num_blocks for p in llm.engine.blocks.pools.values()) == 640 // 16
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        ellm.load(smollm2_gguf, kv_cache_tokens=-1, progress=False)
    r = subprocess.run([sys.executable, "-m", "ellm", "run", str(smollm2_gguf), "Hi", "-n", "3",
                        "--kv-cache-tokens", "256", "-c", "128"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
