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
