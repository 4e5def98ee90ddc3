"""The reference interpreter (torch + transformers) the comparison tests run in a subprocess."""
from __future__ import annotations

import os

import pytest


def ref_python() -> str:
    """ELLM_REF_PYTHON, or a test failure saying how to set it (a skip would hide a broken setup)."""
    ref = os.environ.get("ELLM_REF_PYTHON")
    if not ref:
        pytest.fail("ELLM_REF_PYTHON is not set: run the tests through `bash tests/run.sh`, or point it at a "
                    "Python with torch and transformers", pytrace=False)
    return ref


def llama_cpp_dir() -> str:
    """ELLM_LLAMA_CPP_DIR (llama.cpp's sources, for convert_hf_to_gguf.py), or a test failure
    saying how to set it."""
    path = os.environ.get("ELLM_LLAMA_CPP_DIR")
    if not path or not os.path.isfile(os.path.join(path, "convert_hf_to_gguf.py")):
        pytest.fail("ELLM_LLAMA_CPP_DIR does not hold llama.cpp's convert_hf_to_gguf.py: run the tests through "
                    "`bash tests/run.sh` (it fetches it), or point it at vendor/llama.cpp of the "
                    "llama-cpp-python 0.3.36 sdist", pytrace=False)
    return path
