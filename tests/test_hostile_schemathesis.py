"""A quick bounded schemathesis run against the real server's /openapi.json: no 5xx.
The long run (a few hundred examples per operation) is benchmarks/schemathesis_server.py;
its figures are in issue 13's note."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "schemathesis_server.py"


def test_schemathesis_finds_no_server_error(smollm2_gguf: Path) -> None:
    if shutil.which("schemathesis", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[fuzz]')")
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(smollm2_gguf), "--max-examples", "4",
                          "--phases", "examples,fuzzing"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "the server counted 0 5xx answers" in run.stdout
