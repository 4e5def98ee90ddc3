"""`ellm inspect` in a real browser: Debian's headless Chromium driven by Selenium through
Debian's chromedriver loads the page, types a prompt, waits for the grid, opens a cell,
clicks a head and steps the generation, asserting on the DOM; screenshots are written to
$ELLM_SCREENSHOTS (or the test's temporary folder).

Skips, saying which, when chromium, chromedriver or selenium is missing (.ci/run installs
them). The JSON API is also checked without a browser, against ellm's own recording.
"""
from __future__ import annotations

import importlib.resources
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import ellm

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from ellm.trace.inspect.app import Inspector, create_app  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
PROMPT = "The quick brown fox jumps over the lazy"


def visible(piece: str) -> str:
    """What app.js writes in a cell for a token piece."""
    return piece.replace("\n", "\u21b5").replace(" ", "\u00b7") or "\u2205"


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path):
    return ellm.load(smollm2_gguf, max_num_seqs=1, progress=False)


@pytest.fixture(scope="module")
def server(llm) -> Iterator[str]:
    """The inspect app under uvicorn on a free loopback port, in a thread."""
    config = uvicorn.Config(create_app(Inspector(llm, "smollm2", max_tokens=64)), host="127.0.0.1",
                            port=0, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the inspect server did not start")
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def test_static_files_ship_in_the_package() -> None:
    static = importlib.resources.files("ellm.trace.inspect") / "static"
    for name in ("index.html", "app.js", "style.css"):
        assert (static / name).is_file(), name
    html = (static / "index.html").read_text()
    assert "http://" not in html and "https://" not in html   # nothing from a CDN


def test_api_matches_the_recording(server: str, llm) -> None:
    import httpx
    r = httpx.post(f"{server}/api/trace", json={"prompt": PROMPT}, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    ids = llm.encode_prompt(PROMPT)
    assert data["ids"] == ids and data["layers"] == llm.config.num_hidden_layers
    assert np.array(data["norms"]).shape == (llm.config.num_hidden_layers, len(ids))
    # the last layer's lens is the model's output: its top token is the next token's top
    assert data["lens"][-1][-1][0]["id"] == data["next"][0]["id"] == int(llm.logits(ids)[-1].argmax())
    a = httpx.get(f"{server}/api/attention", params={"trace": data["trace"], "layer": 3, "head": 1}).json()
    m = np.array(a["matrix"])
    assert m.shape == (len(ids), len(ids))
    assert np.allclose(m.sum(1), 1.0, atol=1e-3) and np.allclose(np.triu(m, 1), 0.0)
    bad = [({"prompt": ""}, "non-empty"), ({"ids": ["x"]}, "list of integers"),
           ({"ids": [10 ** 9]}, "outside the vocabulary"), ({"ids": [1] * 65}, "at most 64")]
    for body, words in bad:
        r = httpx.post(f"{server}/api/trace", json=body)
        assert r.status_code == 400 and words in r.json()["error"], (body, r.text)
    r = httpx.get(f"{server}/api/attention", params={"trace": data["trace"], "layer": 99, "head": 0})
    assert r.status_code == 400 and "layer must be in 0..29" in r.json()["error"]
    r = httpx.get(f"{server}/api/attention", params={"trace": "nope", "layer": 0, "head": 0})
    assert r.status_code == 400 and "unknown or expired trace" in r.json()["error"]


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("headless Chromium test: needs Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver; .ci/run does)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the [test] extra)")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1600,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def screens_dir(tmp_path: Path) -> Path:
    d = Path(os.environ.get("ELLM_SCREENSHOTS", tmp_path))
    d.mkdir(parents=True, exist_ok=True)
    return d


def test_page_in_headless_chromium(server: str, browser, llm, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    shots = screens_dir(tmp_path)
    n_layers, n_heads = llm.config.num_hidden_layers, llm.config.num_attention_heads
    ids = llm.encode_prompt(PROMPT)
    wait = WebDriverWait(browser, 120)
    browser.get(server + "/")
    wait.until(lambda d: d.find_element(By.ID, "model-name").text)
    assert f"{n_layers} layers" in browser.find_element(By.ID, "model-name").text

    browser.find_element(By.ID, "prompt").send_keys(PROMPT)
    browser.find_element(By.ID, "run").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid tr.layer-row")) == n_layers)
    tokens = [th.get_attribute("textContent") for th in browser.find_elements(By.CSS_SELECTOR, "#grid th.token")]
    assert tokens == [visible(llm.tokenizer.decode([t])) for t in ids]
    cells = browser.find_elements(By.CSS_SELECTOR, "#grid td.cell")
    assert len(cells) == n_layers * len(ids)
    next_top = browser.find_element(By.CSS_SELECTOR, "#next li").get_attribute("data-id")
    last_cell = browser.find_element(By.CSS_SELECTOR, f'#grid td[data-layer="{n_layers - 1}"][data-pos="{len(ids) - 1}"]')
    assert last_cell.get_attribute("textContent") == visible(llm.tokenizer.decode([int(next_top)]))
    browser.save_screenshot(str(shots / "inspect-1-grid.png"))

    browser.find_element(By.CSS_SELECTOR, f'#grid td[data-layer="5"][data-pos="{len(ids) - 1}"]').click()
    heads = browser.find_elements(By.CSS_SELECTOR, "#heads button.head")
    assert len(heads) == n_heads
    heads[2].click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#attn-matrix tr.attn-row")) == len(ids))
    matrix = browser.find_element(By.ID, "attn-matrix")
    assert matrix.get_attribute("data-size") == f"{len(ids)}x{len(ids)}"
    rows = browser.find_elements(By.CSS_SELECTOR, "#attn-matrix tr.attn-row")
    assert all(len(r.find_elements(By.CSS_SELECTOR, "td.attn-cell")) == len(ids) for r in rows)
    # causal: the first token attends only to itself
    first_row = rows[0].find_elements(By.CSS_SELECTOR, "td.attn-cell")
    assert first_row[0].get_attribute("title").endswith(": 1")
    assert all(td.get_attribute("title").endswith(": 0") for td in first_row[1:])
    assert "layer 5, head 2" in browser.find_element(By.ID, "attn-title").text
    browser.save_screenshot(str(shots / "inspect-2-attention.png"))

    browser.find_element(By.ID, "step").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid th.token")) == len(ids) + 1)
    new_last = browser.find_elements(By.CSS_SELECTOR, "#grid th.token")[-1].get_attribute("textContent")
    assert new_last == visible(llm.tokenizer.decode([int(next_top)]))
    assert not browser.find_elements(By.CSS_SELECTOR, "#attn-matrix tr")   # the old trace's map is gone
    browser.save_screenshot(str(shots / "inspect-3-step.png"))
