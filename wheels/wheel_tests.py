"""pytest plugin for the test run cibuildwheel does against each built wheel.

The suite's Hugging Face folder fixtures (``smollm2_hf_f32``, ``gemma3_hf_bf16`` ...,
named ``<model>_hf_<dtype>`` in tests/conftest.py) are made from the GGUFs by
transformers and torch (`bash tests/run.sh`), which a wheel-test venv does not have
and should not get. There, those fixtures fail on purpose, so a broken development
setup is never silent. For the wheel run this plugin turns them into skips, whether a
test asks for them as arguments or through request.getfixturevalue. Everything else
runs: the GGUF models are pulled by pip as usual.

    python -m pytest -p wheels.wheel_tests -m "not slow" tests
"""
from __future__ import annotations

import re
from typing import Any

import pytest

_HF_FOLDER_FIXTURE = re.compile(r"^[a-z0-9]+_hf_(?:f32|bf16|f16)$")


def _skip_hf_folder(**_: Any) -> None:
    pytest.skip("Hugging Face folders are made with torch, which the wheel tests do not install")


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> None:
    # Swap the fixture's function and let pytest run it as usual: pytest then caches the
    # skip like any fixture outcome, so every later test asking for it skips too.
    if _HF_FOLDER_FIXTURE.match(fixturedef.argname):
        fixturedef.func = _skip_hf_folder  # type: ignore[misc]
