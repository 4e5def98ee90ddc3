"""The Python code passes ruff's pyflakes and pycodestyle rules as pyproject.toml sets them
(undefined and unused names, redefinitions, lines past 120 columns outside the tests), and
mypy's type check of the package (its [tool.mypy] settings), whose view of the compiled
modules, the .pyi files beside their .pyx, matches the modules as built."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
# the compiled modules the .pyi files describe
NATIVE_MODULES = sorted(f"ellm._native.{p.stem}" for p in (SRC / "ellm" / "_native").glob("*.pyi"))


def test_ruff_finds_nothing() -> None:
    pytest.importorskip("ruff", reason="ruff comes with the [test] extra")
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


def _needs_sources_and_mypy() -> None:
    pytest.importorskip("mypy", reason="mypy comes with the [test] extra")
    if not (SRC / "ellm").is_dir():
        pytest.skip("the package's sources are not here (a test run against an installed wheel)")


def test_mypy_finds_nothing() -> None:
    _needs_sources_and_mypy()
    # no cache: a cache made before a .pyi appeared can still say its module is missing
    p = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                        "--cache-dir", os.devnull], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]


def test_native_stubs_match_the_compiled_modules(tmp_path: Path) -> None:
    # mypy trusts the .pyi files; stubtest checks each one against its module as imported:
    # every name it declares exists, with the same parameters (names, order, defaults).
    _needs_sources_and_mypy()
    assert len(NATIVE_MODULES) == len(list((SRC / "ellm" / "_native").glob("*.pyx")))   # one per module
    # MappedFile's buffer protocol is a C slot, which Python 3.12+ shows as __buffer__
    allow = tmp_path / "allowlist.txt"
    allow.write_text("ellm._native._core.MappedFile.__buffer__\nellm._native._core.MappedFile.__release_buffer__\n")
    # (stubs found through MYPYPATH: without it stubtest finds none and reports success)
    p = subprocess.run([sys.executable, "-m", "mypy.stubtest", "--concise", "--ignore-missing-stub",
                        "--ignore-disjoint-bases", "--ignore-unused-allowlist", "--allowlist", str(allow),
                        *NATIVE_MODULES], cwd=ROOT, env={**os.environ, "MYPYPATH": str(SRC)},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
