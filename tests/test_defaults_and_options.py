"""Sampling defaults from the model (generation_config.json, GGUF general.sampling.*), the
defaults table of docs/python-api.md against the code, and ellm.load's threads / max_model_len / chat_template."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import ellm
from ellm import sampling_defaults
from ellm._native import _kernels
from ellm.engine.engine import RequestError
from ellm.sampling_params import SamplingParams
from ellm.tokenization.template import ChatTemplateError

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"
PROMPT = "The capital of France is"


def readme_defaults() -> dict[str, str]:
    """The `| field | default |` rows of docs/python-api.md's "Sampling defaults" section."""
    text = API_DOC.read_text()
    section = text.split("## Sampling defaults", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \|$", section, flags=re.M)
    assert rows, "no defaults table in docs/python-api.md's Sampling defaults section"
    return dict(rows)


def test_readme_defaults_are_the_codes() -> None:
    stated = readme_defaults()
    assert set(stated) == set(sampling_defaults.FALLBACK)
    neutral = SamplingParams()
    for name, value in stated.items():
        number = float(value.split()[0])
        assert number == sampling_defaults.FALLBACK[name], name
        assert number == getattr(sampling_defaults.SamplingDefaults(), name), name
        assert number == getattr(neutral, name), name   # SamplingParams() agrees with the table
    # "in the Python API max_tokens defaults to 256"
    said = re.search(r"`max_tokens` defaults to (\d+)", API_DOC.read_text())
    assert said and int(said.group(1)) == SamplingParams().max_tokens


def test_generation_config_values_and_bad_ones(caplog: pytest.LogCaptureFixture) -> None:
    d = sampling_defaults.from_generation_config(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": False, "max_new_tokens": 5})
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty) == (0.6, 0.9, 20, 0.0, 1.0)
    assert dict(d.sources) == {"temperature": "generation_config.json", "top_p": "generation_config.json",
                               "top_k": "generation_config.json", "min_p": "ellm", "repetition_penalty": "ellm"}
    with caplog.at_level(logging.WARNING, logger="ellm"):
        bad = sampling_defaults.from_generation_config({"top_p": 0.0, "temperature": "hot", "min_p": 0.1},
                                                       "x/generation_config.json")
    assert bad.top_p == 1.0 and bad.temperature == 1.0 and bad.min_p == 0.1
    assert "x/generation_config.json" in caplog.text and "top_p" in caplog.text and "temperature" in caplog.text
    with pytest.raises(ValueError, match="JSON object"):
        sampling_defaults.from_generation_config([1, 2])   # type: ignore[arg-type]
    p = d.params(max_tokens=7, temperature=None, top_k=3)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 3, 7)
    assert d.params(SamplingParams(temperature=0.1)).top_k == 0   # a given SamplingParams is kept


def _folder_copy(src: Path, dst: Path, generation: dict | None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (dst / f.name).symlink_to(f)
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    return dst


def test_folder_generation_config_sets_the_defaults(smollm2_hf_f32, tmp_path) -> None:
    # top_k 1 makes the model's default observable: sampling becomes greedy.
    folder = _folder_copy(smollm2_hf_f32, tmp_path / "m", {"temperature": 0.7, "top_k": 1, "min_p": 0.02})
    with ellm.load(folder, max_model_len=256, progress=False) as llm:
        assert llm.defaults.as_dict() == {"temperature": 0.7, "top_p": 1.0, "top_k": 1, "min_p": 0.02,
                                          "repetition_penalty": 1.0}
        p = llm.sampling_params(max_tokens=8)
        assert (p.temperature, p.top_k, p.min_p) == (0.7, 1, 0.02)
        greedy = llm.generate(PROMPT, temperature=0.0, max_tokens=8).token_ids
        assert llm.generate(PROMPT, max_tokens=8, seed=1).token_ids == greedy
        assert llm.generate(PROMPT, max_tokens=8, seed=2).token_ids == greedy
        # a SamplingParams given whole is not mixed with the model's defaults
        assert llm.sampling_params(SamplingParams(max_tokens=8)).top_k == 0
    with ellm.load(_folder_copy(smollm2_hf_f32, tmp_path / "plain", None), max_model_len=256,
                   progress=False) as plain:
        assert plain.defaults == sampling_defaults.SamplingDefaults()


def test_gguf_sampling_metadata_sets_the_defaults(smollm2_gguf, tmp_path) -> None:
    """A copy of the GGUF with general.sampling.* keys written by the gguf package."""
    ref = os.environ.get("ELLM_REF_PYTHON")
    if not ref:
        pytest.fail("ELLM_REF_PYTHON is not set (a Python with the gguf package)", pytrace=False)
    out = tmp_path / "sampled.gguf"
    code = (
        "import sys, gguf\n"
        "from gguf.scripts.gguf_new_metadata import copy_with_new_metadata, MetadataDetails\n"
        "reader = gguf.GGUFReader(sys.argv[1], 'r')\n"
        "arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()\n"
        "writer = gguf.GGUFWriter(sys.argv[2], arch=arch, endianess=reader.endianess)\n"
        "F32 = gguf.GGUFValueType.FLOAT32\n"
        "new = {'general.sampling.temp': MetadataDetails(F32, 0.5),\n"
        "       'general.sampling.top_k': MetadataDetails(gguf.GGUFValueType.INT32, 1),\n"
        "       'general.sampling.top_p': MetadataDetails(F32, 0.8),\n"
        "       'general.sampling.penalty_repeat': MetadataDetails(F32, 1.25)}\n"
        "copy_with_new_metadata(reader, writer, new, [])\n"
    )
    subprocess.run([ref, "-c", code, str(smollm2_gguf), str(out)], check=True, capture_output=True,
                   text=True, timeout=300)
    with ellm.load(out, max_model_len=256, progress=False) as llm:
        d = llm.defaults
        assert (d.temperature, d.top_k, d.top_p, d.min_p) == (0.5, 1, pytest.approx(0.8), 0.0)
        assert d.repetition_penalty == pytest.approx(1.25)
        assert dict(d.sources)["top_k"] == "gguf" and dict(d.sources)["min_p"] == "ellm"
        assert llm.sampling_params().repetition_penalty == pytest.approx(1.25)


def test_threads_option_sets_the_pool_and_keeps_results(smollm2_gguf) -> None:
    before = _kernels.num_threads()
    try:
        with ellm.load(smollm2_gguf, threads=1, max_model_len=256, progress=False) as llm:
            assert _kernels.num_threads() == 1
            ids = llm.tokenizer.encode(PROMPT)
            one = llm.logits(ids)
            _kernels.set_num_threads(2)   # the option is process-wide; change it under the LLM
            np.testing.assert_array_equal(llm.logits(ids), one)   # thread count never changes results
        with pytest.raises(ValueError, match="threads"):
            ellm.load(smollm2_gguf, threads="4")   # type: ignore[arg-type]
    finally:
        _kernels.set_num_threads(before)


def test_max_model_len_and_chat_template_options(smollm2_gguf, tmp_path) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    with ellm.load(smollm2_gguf, max_model_len=32, chat_template=template, progress=False) as llm:
        assert llm.engine.cfg.max_model_len == 32
        with pytest.raises(RequestError, match="32"):
            llm.generate([1] * 40, max_tokens=2)
        messages = [{"role": "user", "content": "Hi"}]
        ids = llm.encode_chat(messages)
        text = llm.tokenizer.decode(ids, skip_special_tokens=True)
        assert text == "[user] Hi\n[assistant] "
        assert llm.chat(messages, max_tokens=2, temperature=0.0).prompt_token_ids == ids
    path = tmp_path / "t.jinja"
    path.write_text(template)
    with ellm.load(smollm2_gguf, max_model_len=64, chat_template=str(path), progress=False) as llm:
        assert llm.tokenizer.chat_template == template
    with pytest.raises(ChatTemplateError, match="chat template"):
        ellm.load(smollm2_gguf, chat_template="{% for m in messages %}")
