"""Images through ellm's front doors: llm.generate / stream / chat (sync and async), the
OpenAI server (the openai client sending a base64 image) and `ellm run --image`.

The models are the tiny random SmolVLM and Gemma 3 of tests/goldens/tiny_vision_models.py.
transformers runs each on what its own processor (Idefics3Processor over the PIL image
processor, Gemma3Processor) makes of the same image files and prompt: ellm's prompt ids
must be identical, its greedy tokens the same and its first-token logprobs within 2e-3.
"""
from __future__ import annotations

import asyncio
import base64
import http.server
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL", reason="the vision tests need Pillow (pip install 'ellm-engine[vision]')")
from PIL import Image  # noqa: E402

import ellm  # noqa: E402
from ellm.vision.fetch import FetchLimits, fetch_image  # noqa: E402
from ellm.vision.images import ImageError  # noqa: E402
from vision_data import run_ref, skimage_photos  # noqa: E402

NEW_TOKENS = 5
# A chat template of our own for the tiny models (their tokenizers carry none): it writes
# each image part as the processor's placeholder.
TEMPLATES = {
    "smolvlm": ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}"
                "{% if p['type'] == 'image' %}<image>{% else %} {{ p['text'] }}{% endif %}{% endfor %}"
                "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"),
    "gemma3": ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
               "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>{% else %}"
               "{{ p['text'] }}{% endif %}{% endfor %}<end_of_turn>\n{% endfor %}"
               "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
}
PLACEHOLDER = {"smolvlm": "<image>", "gemma3": "<start_of_image>"}


@pytest.fixture(scope="module")
def tiny(tiny_vision_dir: Path) -> Path:
    """tests/goldens/tiny_vision_models.py's folders (conftest.py makes them once for the session)."""
    return tiny_vision_dir


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, Path]:
    """A real photo, a wide Pillow-made one (2 x 1 tiles at SmolVLM's 64/32) and an RGBA one."""
    folder = tmp_path_factory.mktemp("pictures")
    rng = np.random.default_rng(3)
    wide = folder / "wide.png"
    Image.fromarray(rng.integers(0, 256, (40, 100, 3), dtype=np.uint8)).save(wide)
    rgba = folder / "rgba.png"
    Image.fromarray(rng.integers(0, 256, (50, 50, 4), dtype=np.uint8), mode="RGBA").save(rgba)
    return {"photo": skimage_photos() / "chelsea.png", "wide": wide, "rgba": rgba}


def _cases(family: str, pictures: dict[str, Path]) -> list[dict]:
    mark = PLACEHOLDER[family]
    return [
        {"name": "text", "text": f"A picture {mark} of a", "images": [str(pictures["photo"])]},
        {"name": "two", "text": f"{mark} and{mark}: the", "images": [str(pictures["wide"]), str(pictures["rgba"])]},
        {"name": "chat", "images": [str(pictures["photo"])],
         "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]},
    ]


@pytest.fixture(scope="module", params=["smolvlm", "gemma3"])
def family_run(request, tiny, pictures, tmp_path_factory):
    family = request.param
    folder = tiny / family
    tmp = tmp_path_factory.mktemp(f"ref-{family}")
    job = {"folder": str(folder), "family": family, "chat_template": TEMPLATES[family],
           "max_new_tokens": NEW_TOKENS, "cases": _cases(family, pictures)}
    (tmp / "job.json").write_text(json.dumps(job))
    run_ref("generate", str(tmp / "job.json"), str(tmp / "out.json"))
    want = json.loads((tmp / "out.json").read_text())
    llm = ellm.load(str(folder), max_model_len=1024, max_num_seqs=4, progress=False,
                    chat_template=TEMPLATES[family])
    yield family, folder, llm, job["cases"], want
    llm.close()


def _check(got, want: dict, name: str) -> None:
    assert got.prompt_token_ids == want["ids"], f"{name}: prompt ids differ"
    first = got.logprobs[0]
    top = dict(first.top)
    for tid, lp in zip(want["top_ids"][:3], want["top_logprobs"][:3]):
        assert tid in top, f"{name}: transformers' top token {tid} missing from {first.top}"
        assert abs(top[tid] - lp) < 2e-3, f"{name}: logprob of {tid}: {top[tid]} vs {lp}"
    margins = np.diff(sorted(want["top_logprobs"], reverse=True)[:2])
    if abs(float(margins[0])) > 1e-2:   # a clear first choice: the greedy runs must agree
        assert got.token_ids[:1] == want["greedy"][:1], name


def test_generate_and_chat_match_transformers(family_run):
    family, _, llm, cases, want = family_run
    assert llm.processing is not None and llm.processing.placeholder == PLACEHOLDER[family]
    for case in cases:
        kw = dict(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=5)
        if "messages" in case:
            messages = [{"role": "user", "content": [{"type": "image", "image": case["images"][0]},
                                                     case["messages"][0]["content"][1]]}]
            got = llm.chat(messages, **kw)
        else:
            got = llm.generate(case["text"], images=case["images"], **kw)
        _check(got, want[case["name"]], f"{family}/{case['name']}")


def test_stream_async_and_image_kinds_agree(family_run):
    family, _, llm, cases, want = family_run
    case = cases[0]
    path = Path(case["images"][0])
    sources = [path, str(path), path.read_bytes(), Image.open(path),
               "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()]
    texts = {llm.generate(case["text"], images=[s], max_tokens=NEW_TOKENS, temperature=0.0).text for s in sources}
    assert len(texts) == 1
    streamed = "".join(llm.stream(case["text"], images=[path], max_tokens=NEW_TOKENS, temperature=0.0))
    assert streamed == texts.pop()

    async def run() -> tuple[str, str]:
        pieces = [p async for p in llm.astream(case["text"], images=[path], max_tokens=NEW_TOKENS, temperature=0.0)]
        out = await llm.achat([{"role": "user", "content": [{"type": "image", "image": path},
                                                            {"type": "text", "text": "What is it?"}]}],
                              max_tokens=NEW_TOKENS, temperature=0.0)
        return "".join(pieces), out.text
    a, b = asyncio.run(run())
    assert a == streamed
    assert b == llm.chat([{"role": "user", "content": [{"type": "image", "image": str(path)},
                                                       {"type": "text", "text": "What is it?"}]}],
                         max_tokens=NEW_TOKENS, temperature=0.0).text


def test_image_errors_through_the_api(family_run, smollm2_gguf):
    family, _, llm, cases, _ = family_run
    mark = PLACEHOLDER[family]
    with pytest.raises(ImageError, match="1 image placeholder"):
        llm.generate(f"{mark} only one", images=[cases[0]["images"][0]] * 2)
    with pytest.raises(ImageError, match=r"messages\[0\].content\[0\]"):
        llm.chat([{"role": "user", "content": [{"type": "image", "image": b"not an image"}]}])
    with pytest.raises(ImageError, match="not fetched here"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.example/a.png"}}]}])
    if family == "smolvlm":
        text_only = ellm.load(str(smollm2_gguf), max_model_len=256, progress=False)
        try:
            with pytest.raises(ImageError, match="takes no images"):
                text_only.chat([{"role": "user", "content": [{"type": "image", "image": cases[0]["images"][0]},
                                                             {"type": "text", "text": "hi"}]}])
            with pytest.raises(ImageError, match="takes no images"):
                text_only.generate("<image> hi", images=[cases[0]["images"][0]])
        finally:
            text_only.close()


# ---------------------------------------------------------------------------------------
# the server and the CLI
# ---------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory) -> Iterator[str]:
    import httpx
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "template.jinja").write_text(TEMPLATES["smolvlm"])
    port = _free_port()
    log = tmp / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ellm", "serve", str(tiny / "smolvlm"), "--port", str(port),
                                 "--served-model-name", "tiny", "--max-model-len", "1024",
                                 "--chat-template", str(tmp / "template.jinja"), "--log-level", "warning"],
                                stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)
    assert proc.returncode in (0, -15), log.read_text()[-3000:]


def test_server_answers_a_base64_image_as_llm_chat_does(served, tiny, pictures):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served + "/v1", api_key="x", max_retries=0, timeout=120)
    data = base64.b64encode(pictures["photo"].read_bytes()).decode()
    resp = client.chat.completions.create(
        model="tiny", max_tokens=NEW_TOKENS, temperature=0.0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                                               {"type": "text", "text": "What is it?"}]}])
    llm = ellm.load(str(tiny / "smolvlm"), max_model_len=1024, progress=False, chat_template=TEMPLATES["smolvlm"])
    try:
        want = llm.chat([{"role": "user", "content": [{"type": "image", "image": pictures["photo"]},
                                                      {"type": "text", "text": "What is it?"}]}],
                        max_tokens=NEW_TOKENS, temperature=0.0)
    finally:
        llm.close()
    assert resp.choices[0].message.content == want.text
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.prompt_tokens > 4 * 5   # 2 x 2 tiles + the global image, 4 tokens each
    import httpx
    tok = httpx.post(served + "/tokenize", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": "What is it?"}]}]}, timeout=60).json()
    assert tok["tokens"] == want.prompt_token_ids

    bad = [({"url": "data:image/png;base64,@@@"}, "messages[0].content[0]", "base64"),
           ({"url": "data:image/png;base64," + base64.b64encode(b"%PDF-1.4 x").decode()}, "messages[0].content[0]", "PDF"),
           ({"url": "https://example.invalid/cat.png"}, "messages[0].content[0]", "--allow-image-urls"),
           ({"url": "ftp://example.invalid/cat.png"}, "messages[0].content[0].image_url.url", "data: URL")]
    for image_url, param, words in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": image_url}]}])
        err = e.value.body
        assert err["param"] == param and words in err["message"], err


def test_cli_run_with_an_image(tiny, pictures, smollm2_gguf, tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATES["smolvlm"])
    # `ellm run MODEL --image FILE "prompt"`: the prompt after the options
    cmd = [sys.executable, "-m", "ellm", "run", str(tiny / "smolvlm"), "--image", str(pictures["photo"]),
           "--chat-template", str(tmp_path / "t.jinja"), "--max-tokens", str(NEW_TOKENS), "--temperature", "0",
           "What is it?"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    llm = ellm.load(str(tiny / "smolvlm"), max_model_len=1024, progress=False, chat_template=TEMPLATES["smolvlm"])
    try:
        want = llm.chat([{"role": "user", "content": [{"type": "image", "image": pictures["photo"]},
                                                      {"type": "text", "text": "What is it?"}]}],
                        max_tokens=NEW_TOKENS, temperature=0.0).text
    finally:
        llm.close()
    assert out.stdout == want + "\n"
    bad = subprocess.run([sys.executable, "-m", "ellm", "run", str(smollm2_gguf), "--image", str(pictures["photo"]),
                          "hi"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "takes no images" in bad.stderr
    broken = tmp_path / "broken.png"
    broken.write_bytes(pictures["photo"].read_bytes()[:500])
    bad = subprocess.run(cmd[:6] + [str(broken)] + cmd[7:], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "corrupt header" in bad.stderr, bad.stderr[-1000:]


# ---------------------------------------------------------------------------------------
# fetching http(s) images (the server's --allow-image-urls)
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def image_host(pictures) -> Iterator[str]:
    body = pictures["photo"].read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:   # noqa: N802
            if self.path == "/slow.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    for i in range(0, len(body), 1000):   # trickles: past any short deadline
                        self.wfile.write(body[i:i + 1000])
                        self.wfile.flush()
                        time.sleep(0.2)
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the client gave up, as it should
                return
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "/redirect")
                self.end_headers()
                return
            if self.path != "/cat.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_fetch_is_bounded(image_host, pictures):
    local = FetchLimits(allowed_hosts=("127.0.0.1",))   # the test's image host is on loopback
    assert fetch_image(image_host + "/cat.png", limits=local) == pictures["photo"].read_bytes()
    with pytest.raises(ImageError, match="no image came back") as e:
        fetch_image(image_host + "/missing.png", limits=local)
    assert "404" not in str(e.value)   # the status is not repeated to the client
    with pytest.raises(ImageError, match="at most 1000"):
        fetch_image(image_host + "/cat.png", limits=FetchLimits(max_bytes=1000, allowed_hosts=("127.0.0.1",)))
    with pytest.raises(ImageError, match="redirects more than"):
        fetch_image(image_host + "/redirect", limits=local)
    t0 = time.monotonic()
    with pytest.raises(ImageError, match="more than 1 s"):
        fetch_image(image_host + "/slow.png", limits=FetchLimits(timeout_s=1.0, allowed_hosts=("127.0.0.1",)))
    assert time.monotonic() - t0 < 30   # it gave up (a generous bound: this host is shared)
    with pytest.raises(ImageError, match="only http"):
        fetch_image("file:///etc/passwd")
    with pytest.raises(ImageError, match="not a public internet address"):   # loopback, not allowed by name
        fetch_image(image_host + "/cat.png")


# ---------------------------------------------------------------------------------------
# GGUF + mmproj: the processor's settings from the mmproj's clip.vision.* metadata
# ---------------------------------------------------------------------------------------

def test_mmproj_gives_the_folders_preprocessing(tiny, tiny_vision_ggufs, pictures):
    from ellm.formats.gguf import GGUFFile
    from ellm.vision.images import decode_image
    from ellm.vision.preprocess import load_processing, processing_from_mmproj
    out = tiny_vision_ggufs
    for name in ("smolvlm", "gemma3"):
        path = out / f"mmproj-{name}-f32.gguf"
        from_gguf = processing_from_mmproj(GGUFFile(path).metadata, where=str(path))
        from_folder = load_processing(tiny / name)
        assert type(from_gguf) is type(from_folder)
        for image in pictures.values():
            a = from_gguf.preprocess(decode_image(image))
            b = from_folder.preprocess(decode_image(image))
            np.testing.assert_array_equal(a.pixel_values, b.pixel_values)
            assert from_gguf.prompt_text(a) == from_folder.prompt_text(b)
        # and through ellm.load(gguf, mmproj=): the same prompt ids as the folder gives
        text = f"A picture {PLACEHOLDER[name]} of a"
        llm = ellm.load(str(out / f"{name}-f32.gguf"), mmproj=str(path), max_model_len=1024, progress=False)
        ref = ellm.load(str(tiny / name), max_model_len=1024, progress=False)
        try:
            ids, _ = llm.encode_prompt_with_images(text, [pictures["photo"]])
            want, _ = ref.encode_prompt_with_images(text, [pictures["photo"]])
            assert ids == want
        finally:
            llm.close()
            ref.close()


def test_slow_image_urls_do_not_hold_up_other_clients(tiny, image_host, tmp_path):
    """Three chats whose image URL trickles for longer than the fetch deadline, then a
    plain text chat from another client: the text chat is answered while the three still
    wait for their images (fetches run in threads of their own, not the two tokenizer
    threads that the text chat needs)."""
    import concurrent.futures

    import httpx
    (tmp_path / "template.jinja").write_text(TEMPLATES["smolvlm"])
    port = _free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ellm", "serve", str(tiny / "smolvlm"), "--port", str(port),
                                 "--served-model-name", "tiny", "--max-model-len", "1024", "--allow-image-urls",
                                 "--allow-image-host", "127.0.0.1", "--chat-template", str(tmp_path / "template.jinja"),
                                 "--log-level", "warning"], stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)

        def chat(content) -> httpx.Response:
            return httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
        slow = [{"type": "image_url", "image_url": {"url": image_host + "/slow.png"}}, {"type": "text", "text": "?"}]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            slow_runs = [pool.submit(chat, slow) for _ in range(3)]
            time.sleep(1.0)   # the three fetches have started
            text = chat([{"type": "text", "text": "Hello"}])
            still_waiting = sum(not f.done() for f in slow_runs)
            results = [f.result() for f in slow_runs]
        assert text.status_code == 200, text.text[:300]
        assert still_waiting == 3, "the text chat waited for the image fetches"
        for r in results:   # each slow URL ran into the fetch deadline: a 400 that names it
            assert r.status_code == 400 and "more than 10 s" in r.json()["error"]["message"], r.text[:300]
    finally:
        proc.terminate()
        proc.wait(15)
